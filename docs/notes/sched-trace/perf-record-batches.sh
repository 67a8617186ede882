#!/bin/bash
# kvd-1d batches with perf sched recording the batch phase (CLOCK_MONOTONIC stamps)
cd /work/main
D=/tmp/runs/perf1
rm -f $D/perf.data $D/bench.log
flock /tmp/kvd-vllm.lock .venv-vllm/bin/python -m kvd bench vllm --systems kvd-1d \
  --rounds 3 --batch 6 --batch-rounds 8 --breakdown --out $D/run.json --work-dir $D/work \
  > $D/stdout.txt 2> >(tee $D/bench.log >&2) &
BENCH=$!
while ! grep -q "round 3/3 done" $D/bench.log 2>/dev/null; do sleep 0.5; kill -0 $BENCH 2>/dev/null || exit 1; done
perf record -e sched:sched_switch,sched:sched_wakeup,sched:sched_waking -a -k CLOCK_MONOTONIC -o $D/perf.data 2> $D/perf.log &
PERF=$!
while ! grep -q "batch 8/8 done" $D/bench.log 2>/dev/null; do sleep 0.5; kill -0 $BENCH 2>/dev/null || break; done
kill -INT $PERF; wait $PERF
wait $BENCH
echo done rc=$? > $D/done

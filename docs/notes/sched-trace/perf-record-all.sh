#!/bin/bash
# kvd-1d singles (round 0 = a pair's first transfer) and batches under perf sched,
# plus the daemon's user page faults, all stamped with CLOCK_MONOTONIC
cd /work/main
D=/tmp/runs/perf3
rm -rf $D/*; mkdir -p $D
flock /tmp/kvd-vllm.lock .venv-vllm/bin/python -m kvd bench vllm --systems kvd-1d \
  --rounds 4 --batch 6 --batch-rounds 4 --breakdown --out $D/run.json --work-dir $D/work \
  > $D/stdout.txt 2> >(tee $D/bench.log >&2) &
BENCH=$!
while ! grep -q "kvd-1d-decode up" $D/bench.log 2>/dev/null; do sleep 0.5; kill -0 $BENCH 2>/dev/null || exit 1; done
DPID=$(pgrep -f "venv-vllm/bin/python -m kvd serve" | head -1); echo "daemon $DPID" > $D/pids
pgrep -af "vllm|kvd" >> $D/pids
perf record -e sched:sched_switch,sched:sched_wakeup,sched:sched_waking -a -k CLOCK_MONOTONIC -o $D/perf.data 2> $D/perf.log &
PERF=$!
perf record -e exceptions:page_fault_user,exceptions:page_fault_kernel -p $DPID -k CLOCK_MONOTONIC -o $D/faults.data 2> $D/faults.log &
PF=$!
while ! grep -q "batch 4/4 done" $D/bench.log 2>/dev/null; do sleep 0.5; kill -0 $BENCH 2>/dev/null || break; done
kill -INT $PERF $PF; wait $PERF; wait $PF
wait $BENCH
echo done rc=$? > $D/done

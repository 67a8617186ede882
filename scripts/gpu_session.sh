#!/usr/bin/env bash
# Every GPU check of kvd in one call on a lent GPU machine (a bare image with CUDA torch):
#   bash scripts/gpu_session.sh            (results under $OUT, or /tmp/kvd-gpu-out)
# kvd's other dependencies travel as one archive, .whl/site.tar.xz (nixl-cu13 without its
# expert-parallel extension, pyzmq, msgspec: see docs/notes/2026-11-27-gpu-local-copy.md).
# Build it where pip works (git-ignore .whl/; cp312 wheels for a Python 3.12 GPU image):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d /tmp/w nixl-cu13 pyzmq msgspec
#   mkdir /tmp/s && for w in /tmp/w/*.whl; do unzip -qo $w -d /tmp/s; done
#   rm -rf /tmp/s/nixl_ep_cu13 && tar cf - -C /tmp/s . | xz -T2 -6 > .whl/site.tar.xz
# Order: the copier's tests (byte-exactness of both kernels first), kvd bench vram (the
# ratios), the copier's own figures (shapes, block copies, 1-block latency,
# host<->device), then the daemon-level CUDA tests (local pulls, faults mid-copy).
# Each step has a cap in seconds (KVD_GPU_*_S); the whole stays under KVD_GPU_TOTAL_S
# (default 415): the last step gets what is left. At most 8 files come back from $OUT.
set -u
OUT=${OUT:-/tmp/kvd-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
t0=$(date +%s)
total=${KVD_GPU_TOTAL_S:-415}
left() { echo $(( total - ($(date +%s) - t0) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }
{ nvidia-smi -L; python3 -c "import sys, torch, zmq, msgspec; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'zmq', zmq.zmq_version()); from kvd.transport.remote.nixl import import_nixl; print(import_nixl().__name__)"; } 2>&1 | tee "$OUT/env.txt"
timeout "$(cap "${KVD_GPU_COPIER_TESTS_S:-70}")" python3 -m pytest -q -p no:cacheprovider -rs \
  --timeout 60 tests/transport/copies/test_cudacopy_cuda.py tests/transport/copies/test_cudacopy_blocks.py \
  tests/transport/copies/test_cudacopy_plan.py tests/daemon/pull/test_local_mover_cuda.py \
  >"$OUT/pytest.log" 2>&1
echo "== copier tests rc=$? at +$(( $(date +%s) - t0 )) s"; tail -6 "$OUT/pytest.log"
timeout "$(cap "${KVD_GPU_BENCH_S:-170}")" python3 -m kvd bench vram --json --nbytes-mib 1024 \
  >"$OUT/bench_vram.json" 2>"$OUT/bench_vram.err"
echo "== bench vram rc=$? at +$(( $(date +%s) - t0 )) s"; head -c 2500 "$OUT/bench_vram.json"; tail -3 "$OUT/bench_vram.err"
timeout "$(cap "${KVD_GPU_COPIER_S:-90}")" python3 scripts/gpu_check_local_copy.py --no-tests \
  --out "$OUT/gpu_check_local_copy.json" >"$OUT/gpu_check.log" 2>&1
echo "== copier check rc=$? at +$(( $(date +%s) - t0 )) s"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); b=r.get('blocks_1GiB',{}); print(json.dumps({k: b.get(k) for k in ('kernel_compile_s','shapes','post_us_max_over_min','one_block_latency','error')})[:2500])" "$OUT/gpu_check_local_copy.json" 2>&1
timeout "$(cap "${KVD_GPU_TESTS_S:-240}")" python3 -m pytest -q -p no:cacheprovider -rs -s \
  --timeout 120 tests/daemon/pull/test_cuda_local_pull_faults.py tests/pool/test_cuda_pool.py \
  tests/daemon/pull/test_cuda_local_pull.py tests/pool/test_pool_cuda_share.py \
  >>"$OUT/pytest.log" 2>&1
echo "== daemon tests rc=$? at +$(( $(date +%s) - t0 )) s"; grep -E "passed|failed|GPU free|^FAILED|^ERROR" "$OUT/pytest.log" | tail -15

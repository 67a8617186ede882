#!/usr/bin/env bash
# Every GPU check of kvd in one call on a lent GPU machine (a bare image with CUDA torch):
#   bash tools/gpu_session.sh            (results under $OUT, or /tmp/kvd-gpu-out)
# kvd's other dependencies travel as one archive, .whl/site.tar.xz (nixl-cu13 without its
# expert-parallel extension, pyzmq, msgspec: see docs/notes/2026-11-27-gpu-local-copy.md).
# Build it where pip works (git-ignore .whl/; cp312 wheels for a Python 3.12 GPU image):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d /tmp/w nixl-cu13 pyzmq msgspec
#   mkdir /tmp/s && for w in /tmp/w/*.whl; do unzip -qo $w -d /tmp/s; done
#   rm -rf /tmp/s/nixl_ep_cu13 && tar cf - -C /tmp/s . | xz -T2 -6 > .whl/site.tar.xz
# Order: the CUDA tests (byte-exactness first), kvd bench vram (the ratios), then the
# copier's own figures (shapes, 1-block latency, host<->device).
set -u
OUT=${OUT:-/tmp/kvd-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
t0=$(date +%s)
{ nvidia-smi -L; python3 -c "import torch, zmq, msgspec; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'zmq', zmq.zmq_version()); from kvd.transport.nixl import import_nixl; print(import_nixl().__name__)"; } 2>&1 | tee "$OUT/env.txt"
timeout "${KVD_GPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 \
  tests/pool/test_cuda_pool.py tests/daemon/pull/test_cuda_local_pull.py \
  tests/transport/test_cudacopy_cuda.py tests/pool/test_pool_cuda_share.py \
  tests/transport/test_cudacopy_plan.py 2>&1 | tee "$OUT/pytest.log" | tail -25
echo "== tests done at +$(( $(date +%s) - t0 )) s"
timeout "${KVD_GPU_BENCH_S:-200}" python3 -m kvd bench vram --json --nbytes-mib 1024 \
  >"$OUT/bench_vram.json" 2>"$OUT/bench_vram.err"
echo "== bench vram rc=$? at +$(( $(date +%s) - t0 )) s"; head -c 3000 "$OUT/bench_vram.json"; tail -5 "$OUT/bench_vram.err"
timeout "${KVD_GPU_COPIER_S:-100}" python3 tools/gpu_check_local_copy.py --no-tests \
  --out "$OUT/gpu_check_local_copy.json" >"$OUT/gpu_check.log" 2>&1
echo "== copier check rc=$? at +$(( $(date +%s) - t0 )) s"; tail -c 2500 "$OUT/gpu_check.log"

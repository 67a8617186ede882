#!/usr/bin/env bash
# Make .venv-vllm033: vLLM 0.33.0 beside CPU torch, for the scheduler-level cases
# (README, "The vLLM suites"). About 6 min and 4 GB the first time.
#
# No CPU build of vLLM 0.33 exists, so the CUDA wheel goes in with --no-deps, next to
# the CPU torch kvd's constraints pin, and then vLLM's own requirements minus the
# CUDA-only kernels and libraries (CUDA_ONLY below): enough for its scheduler, which is
# all these tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm033
python3 -m venv "$venv"
"$venv/bin/pip" install -c constraints-cpu.txt torch==2.13.0
"$venv/bin/pip" install --no-deps vllm==0.33.0
"$venv/bin/python" - > "$venv/requirements.txt" <<'PY'
import importlib.metadata as metadata
import re

CUDA_ONLY = re.compile(r"(torch|flashinfer|apache-tvm|tilelang|nvidia-|nvtx|fastsafetensors|"
                       r"instanttensor|quack|tokenspeed|humming|pynvvideocodec|certifi)", re.I)
needed = [r for r in metadata.requires("vllm")
          if "extra ==" not in r and not CUDA_ONLY.match(r)]
print("\n".join(["certifi", *needed]))  # certifi without vLLM's bound on it
PY
"$venv/bin/pip" install -c constraints-cpu.txt -r "$venv/requirements.txt" -e '.[test]'
echo "$venv ready: $venv/bin/python -m pytest -q -m vllm tests/integrations/vllm/test_scheduler_pd.py" \
     "tests/integrations/vllm/test_scheduler_pd_geometry.py tests/integrations/vllm/test_connector_hooks.py"

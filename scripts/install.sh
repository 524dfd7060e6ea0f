#!/usr/bin/env bash
# Creates the project virtualenv (.venv) with the pinned fairseq stack and installs this plugin.
# Order matters: torch first, then fairseq-fixed built WITHOUT build isolation so its C++
# extensions compile against the torch already installed (an isolated build pulls a second torch).
# Set TORCH_SPEC to use your own torch build (e.g. a CUDA wheel) instead of the pinned CPU one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
PIP_FLAGS=(--no-cache-dir --disable-pip-version-check -q)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install "${PIP_FLAGS[@]}" --upgrade "pip>=23" 
# 1. torch (never let a later step replace it)
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install "${PIP_FLAGS[@]}" -c constraints.txt "${TORCH_SPEC:-torch==2.13.0}"
fi
# 2. build tools for fairseq's extensions
"$VPY" -m pip install "${PIP_FLAGS[@]}" -c constraints.txt numpy cython setuptools wheel
# 3. fairseq (fork that works on Python 3.11), compiled against the installed torch
if ! "$VPY" -c "import fairseq" 2>/dev/null; then
  "$VPY" -m pip install "${PIP_FLAGS[@]}" -c constraints.txt --no-build-isolation fairseq-fixed==0.12.3.1
fi
# 4. evaluation / tokenisation tools and test runner
"$VPY" -m pip install "${PIP_FLAGS[@]}" -c constraints.txt sacrebleu sentencepiece subword-nmt \
  tensorboardX pytest pytest-xdist matplotlib tensorly tqdm
# 4b. Triton: CUDA builds of torch bring their own (never replace it); on a CPU build it runs the
#     fused kernels' tests in its interpreter (tests/test_pkm_triton.py). Linux x86-64 wheels only.
if ! "$VPY" -c "import triton" 2>/dev/null && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  "$VPY" -m pip install "${PIP_FLAGS[@]}" triton==3.9.0
fi
# 5. this plugin (editable) with its fairseq extra: everything it names is installed above, so
#    pip only checks it (the plain PyTorch modules alone need torch only: pip install -e .)
"$VPY" -m pip install "${PIP_FLAGS[@]}" -c constraints.txt --no-build-isolation -e ".[fairseq]"
"$VPY" -m pip check || true
"$VPY" -c "import torch, fairseq; print('torch', torch.__version__, '| fairseq', fairseq.__version__)"

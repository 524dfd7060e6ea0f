#!/usr/bin/env bash
# Install fairseq-fixed and its missing dependencies on a machine with torch but no package index
# (e.g. a GPU box), from a folder of downloaded wheels and sdists; then our plugin runs from the
# checkout (PYTHONPATH). Prepare the folder where pip works (docs/gpu.md, "Setup"):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl hydra-core==1.3.2 omegaconf==2.3.0 bitarray cffi tensorboardX
#   pip download --no-deps --no-binary :all: -d .whl antlr4-python3-runtime==4.9.3
#   (and the fairseq-fixed 0.12.3.1 sdist, fairseq_fixed-0.12.3.1.tar.gz, into the same folder)
# Usage: bash scripts/install_offline.sh [WHEEL_DIR=.whl] [TARGET=/tmp/site]
#        export PYTHONPATH=TARGET:$PWD PATH=TARGET/bin:$PATH
set -euo pipefail
WHL=${1:-.whl}
TARGET=${2:-/tmp/site}
PIP=(python3 -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check
     --target "$TARGET")
"${PIP[@]}" --no-compile "$WHL"/*.whl
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
for sdist in "$WHL"/antlr4-python3-runtime-*.tar.gz; do
  "${PIP[@]}" --no-build-isolation "$sdist"
done
# fairseq's C++ extensions compile against the torch already there (ninja, all cores); the CUDA
# extensions (lightconv/dynamicconv kernels) are not needed by this plugin: CUDA_HOME unset
# (--upgrade: pip --target would otherwise skip fairseq's console scripts when TARGET/bin exists)
env -u CUDA_HOME MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${PIP[@]}" --upgrade --no-build-isolation \
  "$WHL"/fairseq_fixed-0.12.3.1.tar.gz
python3 -c "import fairseq, torch; print('fairseq', fairseq.__version__, '| torch', torch.__version__)"

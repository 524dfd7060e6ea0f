#!/usr/bin/env bash
# Install fairseq-fixed and its missing dependencies on a machine with torch but no package index
# (e.g. a GPU box), from a folder of downloaded wheels and sdists; then our plugin runs from the
# checkout (PYTHONPATH). docs/performance.md, "Offline clusters":
#   bash scripts/install_offline.sh --download DIR [PYTHON_VERSION=3.12]   where pip works: the
#        fairseq-fixed sdist and the wheels such a machine lacks, into DIR (copy it over)
#   bash scripts/install_offline.sh [DIR=.whl] [TARGET=/tmp/site]   there (nothing to do when
#        fairseq already imports); then export PYTHONPATH=TARGET:$PWD PATH=TARGET/bin:$PATH
set -euo pipefail
if [ "${1:-}" = --download ]; then
  DL=(${PYBIN:-python3} -m pip download -q --no-deps --disable-pip-version-check -d "$2")
  "${DL[@]}" --only-binary=:all: --python-version "${3:-3.12}" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 hydra-core==1.3.2 omegaconf==2.3.0 bitarray regex cffi \
      tensorboardX
  # the benchmark's peer for the PKM layer (docs/performance.md), pure Python
  "${DL[@]}" --only-binary=:all: product-key-memory==0.3.0 einops einx colt5-attention \
      local-attention hyper-connections torch-einops-utils frozendict
  # (the sdists' metadata is built here: PYBIN needs setuptools and wheel, e.g. the .venv's python)
  "${DL[@]}" --no-binary :all: --no-build-isolation antlr4-python3-runtime==4.9.3 \
      fairseq-fixed==0.12.3.1 fairscale==0.4.13  # (fairscale: --ddp-backend fully_sharded)
  exit 0
fi
WHL=${1:-.whl}
TARGET=${2:-/tmp/site}
if PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import fairseq, hydra" 2>/dev/null
then
  echo "fairseq already importable from $TARGET"
  exit 0
fi
PIP=(python3 -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check
     --target "$TARGET")
"${PIP[@]}" --no-compile "$WHL"/*.whl
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
for sdist in "$WHL"/antlr4-python3-runtime-*.tar.gz "$WHL"/fairscale-*.tar.gz; do
  [ ! -e "$sdist" ] || "${PIP[@]}" --no-build-isolation "$sdist"  # (fairscale: if carried)
done
# fairseq's extensions compile against the torch already there (ninja, all cores); the CUDA
# extensions (NAT edit distance, n-gram blocking) are not needed by this plugin: CUDA_HOME unset.
# Of the rest, only the Cython batching helpers (data_utils_fast, token_block_utils_fast) and
# libbleu are on the paths this plugin runs; the three built against torch's C++ API (libbase:
# BASE layers, libnat: non-autoregressive models, examples/operators' alignment binding) are most
# of the build's time (the script: 21 s without them, 1 min 58 s with, on 2 cores), so they are
# left out unless FAIRSEQ_TORCH_EXTENSIONS=1 (fairseq imports each one only when that model runs)
SDIST="$WHL"/fairseq_fixed-0.12.3.1.tar.gz
if [ "${FAIRSEQ_TORCH_EXTENSIONS:-0}" != 1 ]; then
  SRC=$(mktemp -d)
  tar xzf "$SDIST" -C "$SRC"
  SDIST="$SRC"/fairseq_fixed-0.12.3.1
  python3 - "$SDIST/setup.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
start = text.find('extensions.extend(\n    [\n        cpp_extension.CppExtension(\n            "fairseq.libbase"')
end = text.find('if "CUDA_HOME" in os.environ:')
if 0 <= start < end:
    open(path, "w").write(text[:start] + text[end:])
    print("fairseq: building without its torch C++ extensions (libbase, libnat, alignment)")
else:  # another setup.py than 0.12.3.1's: build it as it is
    print("fairseq: setup.py not as expected, building every extension")
PY
fi
# (--upgrade: pip --target would otherwise skip fairseq's console scripts when TARGET/bin exists)
env -u CUDA_HOME MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${PIP[@]}" --upgrade --no-build-isolation \
  "$SDIST"
[ -z "${SRC:-}" ] || rm -rf "$SRC"
python3 -c "import fairseq, torch; print('fairseq', fairseq.__version__, '| torch', torch.__version__,
'| CUDA', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else '')"

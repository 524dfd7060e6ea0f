#!/usr/bin/env bash
# The benchmark on a machine without a package index (an offline cluster node, a lent GPU), in
# stages of at most STAGE_SECONDS (default 600) each; every stage is one `python -m scripts.bench`
# call whose records are appended to RECORDS row by row, so a stage cut off keeps what it finished
# (docs/performance.md, "Offline clusters").
#
#   bash scripts/bench/stages.sh wheelhouse DIR [PYTHON_VERSION]   where pip works: fairseq-fixed's
#                                        sdist and the wheels the node lacks, into DIR (carry it)
#   bash scripts/bench/stages.sh install DIR [SITE]   on the node: install them into SITE
#                                        (default /tmp/site), then print torch and the device
#   bash scripts/bench/stages.sh plan                 the stages and their cases
#   bash scripts/bench/stages.sh run RECORDS STAGE... run stages (BENCH_ARGS: more harness flags)
#
# DRY=1: every stage at toy size on the CPU with this checkout's .venv (VENV=) (check a plan before
# spending device time on it).
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH
PY=python3
if [ -n "${DRY:-}" ]; then
    export PYTHONPATH=$PWD PATH=${VENV:-$PWD/.venv}/bin:$PATH TRITON_INTERPRET=1
    PY=python BENCH_ARGS="--size tiny --device cpu --repeats 1 --epochs 1 --log-interval 1 ${BENCH_ARGS:-}"
fi
# a stage: harness calls separated by ";", each its cases and flags
declare -A STAGES=(
    [baseline]="device/* ; baseline/mt-transformer --precision fp16 --repeats 1 ; baseline/a-a-mt --precision bf16 --repeats 1"
    [kernels]="device aop/sublayer-vs-ffn pkm/value-read pkm/layer-vs-ffn"
    [attention]="device synthesizer/sublayer-vs-mha synthesizer/table-kernel synthesizer/pad-aware-gather collab/inference-vs-mha adaptive_span/sublayer-vs-example"
    [sweep]="device pkm/launch-sweep"
    [sdpa]="sdpa/new-shapes"
    [mt-synth]="synthesizer/mt-*"
    [mt-aop]="aop/mt-*"
    [mt-other]="collab/mt-* pkm/mt-*"
    [lm]="pkm/lm-*"
    [span]="adaptive_span/vs-example"
    [memory-lm]="pkm/memory-lm"
    [precision]="precision/*")
case "${1:-}" in
wheelhouse)
    DIR=$2 VER=${3:-3.12}
    DL=(${PYBIN:-python3} -m pip download -q --no-deps --disable-pip-version-check -d "$DIR")
    "${DL[@]}" --only-binary=:all: --python-version "$VER" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 hydra-core==1.3.2 omegaconf==2.3.0 bitarray regex cffi \
        tensorboardX
    "${DL[@]}" --no-binary :all: --no-build-isolation antlr4-python3-runtime==4.9.3 \
        fairseq-fixed==0.12.3.1
    ls "$DIR"
    ;;
install)
    if $PY -c "import fairseq, hydra" 2>/dev/null; then
        echo "fairseq already importable"
    else
        bash scripts/install_offline.sh "$2" "${3:-$SITE}" || exit 1
    fi
    $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    ;;
plan)
    for s in "${!STAGES[@]}"; do echo "$s: ${STAGES[$s]}"; done | sort
    ;;
run)
    RECORDS=$2; shift 2
    for stage in "$@"; do
        [ -n "${STAGES[$stage]:-}" ] || { echo "unknown stage $stage (bash $0 plan)" >&2; exit 2; }
        # (the patterns are the harness's to expand: no shell globbing)
        set -f; IFS=';' read -ra CALLS <<< "${STAGES[$stage]}"
        end=$((SECONDS + ${STAGE_SECONDS:-600}))
        for call in "${CALLS[@]}"; do
            # (the CPU of a dry run has no fp16: fp32 there)
            [ -z "${DRY:-}" ] || call=${call//--precision fp16/--precision fp32}
            timeout $((end > SECONDS ? end - SECONDS : 1)) $PY -m scripts.bench $call \
                --records "$RECORDS" ${BENCH_ARGS:-}; echo "stage $stage: $call: rc $?"
        done; set +f
    done
    ;;
*)
    echo "usage: bash $0 wheelhouse DIR | install DIR [SITE] | plan | run RECORDS STAGE..." >&2
    exit 2 ;;
esac

#!/usr/bin/env bash
# The benchmark on a machine without a package index (an offline cluster node, a lent GPU; install
# there with scripts/install_offline.sh), in stages that each fit one short visit (STAGE_SECONDS,
# default 480, for all of a stage's harness calls); records are appended to RECORDS as they are
# complete (a kernel row at once, a train call's rows once all its runs are done), so a stage cut
# off keeps what it finished (docs/performance.md, "Offline clusters").
#   bash scripts/bench/stages.sh plan                 the stages, in order, their calls and runs
#   bash scripts/bench/stages.sh run RECORDS STAGE... run stages (BENCH_ARGS: more harness flags)
# DRY=1: every stage at toy size on the CPU with this checkout's .venv (VENV=), fp16 as fp32 (the
# CPU has none), 2 updates profiled where a stage profiles (what an epoch of the tests' toy data,
# 5 updates, allows: BENCH_ARGS may name it), no time limit unless STAGE_SECONDS names one (a toy
# run trains the whole corpus: 2-3 minutes on 2 cores): a plan checked, and its runs counted,
# before device time is spent on it.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH
PY=python3 FROM="$SITE (bash scripts/install_offline.sh WHEELS $SITE)"  # (FROM: where PY imports)
if [ -n "${DRY:-}" ]; then
    export PYTHONPATH=$PWD PATH=${VENV:-$PWD/.venv}/bin:$PATH TRITON_INTERPRET=1
    PY=python FROM="the venv ${VENV:-$PWD/.venv} (make install)"
    BENCH_ARGS="--size tiny --device cpu --repeats 1 --epochs 1 --log-interval 1 ${BENCH_ARGS:-}"
    STAGE_SECONDS=${STAGE_SECONDS:-86400}
fi
if [ "${1:-}" = plan ] || [ "${1:-}" = run ]; then  # one line, not a traceback per call
    $PY -c "import torch, fairseq" >/dev/null 2>&1 || { echo "stages.sh: $PY cannot import torch" \
        "and fairseq from $FROM: install there first (docs/performance.md, \"Offline clusters\")" >&2
        exit 2; }
fi
# a stage: harness calls separated by ";" (the memory layer's kernels first: issue 54; then the
# GPU issue's stages 1-5, then the rest); on an H100 a transformer-base run of this corpus takes
# 60-90 s (its first epoch builds cuDNN plans). memory: kernel rows only, in four processes, each
# with its own rooflines (a kernel that faults on its first device takes only its own call's
# rows): the value read, the search, the layer (its defaults in bf16/fp16/fp32 at 512² and 1024²
# slots, the peer), the layer's parts; about 5 minutes by the H200 rows of 2026-11-28 (16 rows in
# 40-60 s a process, ~3.5 s a layer row), AOP's 56 rows (4 minutes) left to the stage kernels)
ORDER=(memory gpu-bound-bf16 gpu-bound-fp16 baseline mt-bf16-synth mt-bf16-rest host-bound
       mt-fp16-synth mt-fp16-rest lm span kernels decode attention sweep memory-lm precision fsdp)
# the stock transformer-base's profile below its floor is taken by the first two stages; later
# calls of it skip that extra run. mt-bf16-rest profiles 10 warm updates of every run (AOP's
# sublayer missed its kernel target: where its time goes end to end). host-bound: the same model
# at 4x the tokens per update, against the baseline at 8,192 (a host-bound step runs faster per
# token with a larger batch)
# gpu-bound-*: the stock transformer-base at 16k, 32k and 64k tokens an update, each run's warm
# updates profiled (the GPU's busy share): the size where the GPU, not the host, is the limit
# (the GPU issue's stage 2; at 8,192 the GPU was busy 13 % of an update)
declare -A STAGES=(
    [gpu-bound-bf16]="--arch transformer --precision bf16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=16384 ; --arch transformer --precision bf16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=32768 ; --arch transformer --precision bf16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=65536"
    [gpu-bound-fp16]="--arch transformer --precision fp16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=16384 ; --arch transformer --precision fp16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=32768 ; --arch transformer --precision fp16 --repeats 1 --epochs 1 --profile 10 --profile-below-floor 0 --flags=--max-tokens=65536"
    [memory]="device pkm/value-read ; device pkm/search-forward pkm/search-backward ; device pkm/layer-vs-ffn ; device pkm/layer-parts"
    [baseline]="device/* ; baseline/mt-transformer --precision fp16 --repeats 1 ; --arch transformer --precision bf16 --repeats 1"
    [mt-bf16-synth]="translation/train --only synth --precision bf16 --repeats 1 --epochs 1 ; --arch transformer --precision bf16 --repeats 1 --epochs 1 --profile-below-floor 0"
    [mt-bf16-rest]="translation/train --only aop collab pkm --precision bf16 --repeats 1 --epochs 1 --profile-below-floor 0 --profile 10"
    [host-bound]="--arch transformer --flags=--max-tokens=32768 --precision bf16 --repeats 1 --epochs 1 --profile-below-floor 0"
    [mt-fp16-synth]="translation/train --only synth --precision fp16 --repeats 1 --epochs 1 --profile-below-floor 0"
    [mt-fp16-rest]="translation/train --only aop collab pkm --precision fp16 --repeats 1 --epochs 1 --profile-below-floor 0"
    [lm]="--arch attnzoo_lm --precision bf16 --repeats 1 ; lm/train --precision bf16 --repeats 1"
    [span]="adaptive_span/vs-example --precision bf16 --repeats 1"
    [kernels]="device aop/sublayer-vs-ffn pkm/value-read pkm/layer-vs-ffn"
    [decode]="translation/decode --precision fp16 --repeats 1 ; lm/eval --precision fp16 --repeats 1"
    [attention]="device synthesizer/table-kernel adaptive_span/sublayer-vs-example"
    [sweep]="device pkm/launch-sweep"
    [memory-lm]="pkm/memory-lm"
    [precision]="precision/*"
    [fsdp]="pkm/fsdp-* --precision fp32")  # (fairscale: install_offline.sh --download carries it)
calls() { IFS=';' read -ra CALLS <<< "${STAGES[$1]}"; }  # a stage's harness calls, in CALLS
case "${1:-}" in
plan)  # each stage, its calls and the fairseq processes each starts
    set -f
    for s in "${ORDER[@]}"; do
        echo "$s: ${STAGES[$s]}"
        calls "$s"
        for call in "${CALLS[@]}"; do $PY -m scripts.bench $call --count | sed 's/^/    /'; done
    done
    ;;
run)
    RECORDS=$2; shift 2
    for stage in "$@"; do
        [ -n "${STAGES[$stage]:-}" ] || { echo "unknown stage $stage (bash $0 plan)" >&2; exit 2; }
        # (the patterns are the harness's to expand: no shell globbing)
        set -f; calls "$stage"
        end=$((SECONDS + ${STAGE_SECONDS:-480}))
        for call in "${CALLS[@]}"; do
            [ -z "${DRY:-}" ] || call=${call//--precision fp16/--precision fp32}
            [ -z "${DRY:-}" ] || call=${call//--profile 10/--profile 2}
            timeout $((end > SECONDS ? end - SECONDS : 1)) $PY -m scripts.bench $call \
                --records "$RECORDS" ${BENCH_ARGS:-}; echo "stage $stage: $call: rc $?"
        done; set +f
    done
    ;;
*)
    echo "usage: bash $0 plan | run RECORDS STAGE..." >&2
    exit 2 ;;
esac

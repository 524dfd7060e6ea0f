#!/usr/bin/env bash
# The GPU checks recorded in docs/gpu.md, on a machine that has torch + CUDA but no package index
# (wheels and the fairseq sdist carried in .whl/, the demo data in data/; docs/gpu.md "Setup").
#
#   bash scripts/bench/gpu_checks.sh wheels           HERE, where pip works: fill .whl/ (carry it)
#   bash scripts/bench/gpu_checks.sh setup  [OUT]     install fairseq & co into /tmp/site (from a
#                                                     carried .site/site.tgz.* if there; SAVE_SITE=1:
#                                                     write OUT/site.tgz.* to carry to a fresh one)
#   bash scripts/bench/gpu_checks.sh sweep  OUT       tests/test_precision.py on the GPU's kernels
#   bash scripts/bench/gpu_checks.sh runs   OUT ARCH...   scripts/bench/precision_runs.py (--fp16, --amp)
#   bash scripts/bench/gpu_checks.sh bench  OUT       sublayer benchmarks + adaptive span vs fairseq
#   bash scripts/bench/gpu_checks.sh nccl   OUT       sparse PKM values / Memory+ through NCCL (world 1)
#   bash scripts/bench/gpu_checks.sh kernels OUT      the fused kernels' tests on CUDA, then the
#                                                     sublayer targets (scripts/bench/bench_kernels.py;
#                                                     env DTYPES STAGES TIMEOUT, TESTS=0 to skip tests)
#   bash scripts/bench/gpu_checks.sh paper  OUT [GROUP...]  paper-size fairseq-train vs the stock
#                                                     baselines, fp16 and bf16, with profiles
#                                                     (scripts/bench/bench_paper_size.py; env
#                                                     TIMEOUT UPDATES REPEATS PRECISIONS ARCHS
#                                                     SEEDS (one per repeat in turn)
#                                                     BASELINE=pair|bracket PROFILE= to skip,
#                                                     PROFILE=--profile-only, BENCH_FLAGS: more
#                                                     flags, e.g. --no-cudnn-sdpa)
#
# DRY=1 (on the CPU machine, for a runbook call before a loan): the same commands with this
# checkout's .venv, on the CPU at the benchmarks' toy sizes (setup and the CUDA tests skipped), so
# that a call's flags and stages are known to run before device time is spent on them.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root (scripts/bench/ -> ../..)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
DEVICE=cuda PAPER_SIZE=base KERNEL_SIZE=paper
if [ -n "${DRY:-}" ]; then  # (fairseq trains no fp16 on the CPU: fp32 stands in for it)
    export PYTHONPATH=$PWD PATH=$PWD/.venv/bin:$PATH TESTS=0 TRITON_INTERPRET=1
    DEVICE=cpu PAPER_SIZE=tiny KERNEL_SIZE=tiny PRECISIONS=${PRECISIONS:-fp16 bf16}
    PRECISIONS=${PRECISIONS//fp16/fp32}
fi
stage=$1
OUT=${2:-/tmp/gpu_out}
mkdir -p "$OUT"
case "$stage" in
wheels)  # Python 3.12 wheels for the lent machine + the fairseq-fixed sdist + the PKM peer
    PYBIN=${PYBIN:-.venv/bin/python}
    DL=("$PYBIN" -m pip download -q --no-deps --disable-pip-version-check -d .whl)
    "${DL[@]}" --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 hydra-core==1.3.2 omegaconf==2.3.0 bitarray regex cffi \
        tensorboardX product-key-memory==0.3.0 einops einx colt5-attention local-attention \
        hyper-connections frozendict
    "${DL[@]}" --no-binary :all: --no-build-isolation antlr4-python3-runtime==4.9.3 \
        fairseq-fixed==0.12.3.1  # (its metadata step needs torch: the venv's)
    ls .whl
    ;;
setup)  # once per machine: a later call on the same (still warm) machine skips it
    if [ -n "${DRY:-}" ]; then  # (no site to build, no GPU to name, no site to bring back)
        echo "setup: DRY, this checkout's .venv"; exit 0
    fi
    if python3 -c "import fairseq, hydra" 2>/dev/null; then
        echo "setup: fairseq already in /tmp/site"
    elif ls .site/site.tgz.* >/dev/null 2>&1; then  # built by an earlier call (SAVE_SITE=1)
        cat .site/site.tgz.* | tar xzf - -C /tmp && echo "setup: /tmp/site unpacked from .site/"
    else
        bash scripts/install_offline.sh .whl /tmp/site > "$OUT/install.log" 2>&1 || {
            tail -30 "$OUT/install.log"; exit 1; }
    fi
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    if [ -n "${SAVE_SITE:-}" ]; then  # bring the built site back (in parts under the 16 MiB a
        # returned file may have): copy OUT/site.tgz.* to .site/ and carry it next time
        tar czf - -C /tmp site | split -b 15m - "$OUT/site.tgz." && ls -l "$OUT"/site.tgz.*
    fi
    ;;
sweep)
    ATTNZOO_TEST_DEVICE=cuda OMP_NUM_THREADS=1 timeout "${TIMEOUT:-150}" python3 -m pytest -q \
        -n "${JOBS:-12}" -p no:cacheprovider tests/test_precision.py -k test_reduced_precision \
        > "$OUT/sweep_cuda.log" 2>&1
    echo "sweep rc $?"; tail -4 "$OUT/sweep_cuda.log"
    ;;
runs)
    shift 2
    timeout "${TIMEOUT:-300}" python -m scripts.bench.precision_runs --jobs "${JOBS:-16}" --updates 100 \
        --precisions fp16 amp --archs "$@" --json "$OUT/runs.json" --out "$OUT/runs.md" \
        --work /tmp/prec > "$OUT/runs.log" 2>&1
    echo "runs rc $?"; grep -c '"status": "ok"' "$OUT/runs.log"; grep -v '"status": "ok"' \
        "$OUT/runs.log" | grep '^\[' | cut -c1-300
    ;;
bench)
    timeout "${TIMEOUT:-200}" python -m scripts.bench.bench --device cuda --repeats 10 \
        --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    echo "bench rc $?"; tail -25 "$OUT/bench.log" | cut -c1-400
    timeout "${SPAN_TIMEOUT:-150}" python -m scripts.bench.bench_adaptive_span_vs_fairseq --device cuda \
        --updates 200 --segments 2 --json "$OUT/span_vs_fairseq.json" --work /tmp/spanb \
        > "$OUT/span.log" 2>&1
    echo "span rc $?"; tail -8 "$OUT/span.log"
    ;;
nccl)
    : > "$OUT/nccl.log"
    for ddp in legacy_ddp pytorch_ddp; do
        timeout 120 torchrun --nproc_per_node 1 --no-python fairseq-train data/wiki-gensim/bin \
            --user-dir fairseq_attnzoo --arch transformer_lm_memplus --task language_modeling \
            --sample-break-mode none --tokens-per-sample 128 --max-tokens 2048 --decoder-layers 4 \
            --decoder-embed-dim 128 --decoder-ffn-embed-dim 512 --decoder-attention-heads 4 \
            --pkm-n-keys 128 --pkm-k-dim 64 --pkm-heads 4 --pkm-knn 16 --optimizer pkm_adam \
            --pkm-sparse true --lr 0.001 --max-update 100 --log-format json --log-interval 25 \
            --distributed-backend nccl --distributed-init-method env:// --distributed-no-spawn \
            --distributed-world-size 1 --distributed-rank 0 --device-id 0 --ddp-backend "$ddp" \
            --no-save --disable-validation >> "$OUT/nccl.log" 2>&1
        echo "nccl $ddp rc $?"
    done
    grep -E "train_inner|distributed init|num. expert|Error" "$OUT/nccl.log" | cut -c1-300 | tail -14
    ;;
kernels)
    if [ "${TESTS:-1}" = 1 ]; then
        ATTNZOO_TEST_DEVICE=cuda OMP_NUM_THREADS=1 timeout "${TEST_TIMEOUT:-120}" python3 -m pytest \
            -q -p no:cacheprovider tests/test_pkm_triton.py tests/test_pkm.py \
            > "$OUT/kernels_tests.log" 2>&1
        echo "kernel tests rc $?"; tail -3 "$OUT/kernels_tests.log"
        ATTNZOO_TEST_DEVICE=cuda OMP_NUM_THREADS=1 timeout 60 python3 -m pytest -q \
            -p no:cacheprovider tests/test_adaptive_span.py -k sdpa_band > "$OUT/span_tests.log" 2>&1
        echo "adaptive-span sdpa tests rc $?"; tail -3 "$OUT/span_tests.log"
        ATTNZOO_TEST_DEVICE=cuda OMP_NUM_THREADS=1 timeout 60 python3 -m pytest -q \
            -p no:cacheprovider tests/test_synthesizer.py -k equals_the_formula \
            > "$OUT/synth_tests.log" 2>&1
        echo "synthesizer kernel tests rc $?"; tail -3 "$OUT/synth_tests.log"
    fi
    for dtype in ${DTYPES:-bf16 fp16}; do
        timeout "${TIMEOUT:-240}" python3 -m scripts.bench.bench_kernels --device "$DEVICE" \
            --size "$KERNEL_SIZE" --dtype "$dtype" ${STAGES:+--stages $STAGES} \
            --out "$OUT/kernels.md" \
            > "$OUT/kernels_$dtype.log" 2>&1
        echo "bench_kernels $dtype rc $?"
    done
    cat "$OUT/kernels.md" | cut -c1-300
    ;;
paper)
    shift 2
    timeout "${TIMEOUT:-540}" python -m scripts.bench.bench_paper_size --size "$PAPER_SIZE" \
        --device "$DEVICE" \
        --precisions ${PRECISIONS:-fp16 bf16} --groups ${@:-mt lm span} --updates "${UPDATES:-300}" \
        --repeats "${REPEATS:-1}" --baseline "${BASELINE:-pair}" ${ARCHS:+--archs $ARCHS} \
        ${SEEDS:+--seeds $SEEDS} \
        ${PROFILE---profile} ${BENCH_FLAGS:-} --out "$OUT/paper_size.md" > "$OUT/paper.log" 2>&1
    # (a profile-only run has no such rows: the stage still succeeds, so a call can go on)
    echo "paper rc $?"; grep -E "^\| (mt|lm|fp16|bf16) " "$OUT/paper_size.md" | cut -c1-300 || true
    ;;
*)
    echo "unknown stage $stage: wheels | setup | sweep | runs | bench | nccl | kernels | paper" >&2; exit 2 ;;
esac

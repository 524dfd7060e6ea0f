#!/usr/bin/env bash
# Train one architecture on WMT'14 English->German, transformer-base setting (fairseq "Scaling NMT"
# hyperparameters for the base model; see README.md in this folder).
#
#   examples/wmt14_en_de/train.sh ARCH [extra fairseq-train flags...]
#
# Environment (all optional):
#   PYTHON       interpreter with fairseq + this plugin          (python)
#   DATA         output of prepare.sh; binaries in $DATA/bin      (<repo>/data/wmt14_en_de)
#   SAVE         checkpoint directory                              (<repo>/checkpoints/wmt14_en_de/ARCH)
#   GPUS         number of GPUs to train on                        (all visible; 0 = CPU)
#   UPDATE_FREQ  gradient accumulation                             (8 / GPUS: 8 GPU-equivalents)
#   MAX_TOKENS   tokens per GPU per step                           (4096)
#   MAX_UPDATE   training steps                                    (100000)
#   LR           peak learning rate                                (7e-4)
#   FP16         1 = --fp16 (Volta or newer), 0 = fp32             (1 on GPU, 0 on CPU)
#   SAVE_INTERVAL_UPDATES  update checkpoint interval             (1500, ~10 min of base training)
#   KEEP_CHECKPOINTS       update checkpoints kept for averaging   (5)
#   DRY_RUN      1 = print the fairseq-train command and exit
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"
# every translation arch of the plugin, from its registry (attnzoo-archs --list --task translation)
known() {
    local names
    if ! names="$(cd "$ROOT" && "$PYTHON" -m fairseq_attnzoo.cli.archs --list --task translation 2>/dev/null)"; then
        echo "train.sh: '$PYTHON' cannot list the plugin's archs: set PYTHON to the interpreter with fairseq and this plugin" >&2
        exit 2
    fi
    echo transformer $names
}

if [[ $# -lt 1 ]]; then
    KNOWN="$(known)" || exit 2
    echo "usage: $0 ARCH [fairseq-train flags...]; ARCH is one of: $KNOWN" >&2
    exit 2
fi
ARCH="$1"
shift

OPTIM=(--optimizer adam)
case "$ARCH" in
    transformer)  # fairseq's own transformer (base): the baseline, no plugin code involved
        EXTRA=""
        ;;
    attnzoo_transformer)  # the same model through our extension point (identical outputs)
        EXTRA=""
        ;;
    transformer_synth_dense)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_random)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_fixed_random)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_factorized_dense)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_factorized_random)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_random_dense)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_dense_vanilla)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_synth_random_vanilla)
        EXTRA=""  # N = --synth-max-len 256 (arch preset); longer sentences are skipped by fairseq's size filter
        ;;
    transformer_aop)  # AOP1: h_p=8, h_p*d_pk=d, n_p=d_ff-d=1536 (sized from the model by default)
        EXTRA=""  # memory dropout = --attention-dropout, as tensor2tensor
        ;;
    transformer_aop_h16)  # AOP2: 16 heads everywhere, h_p*d_pk=2d, n_p=512 (sized from the model)
        EXTRA=""
        ;;
    transformer_collab_fork)  # the authors' fairseq fork = the setup of the paper's WMT'14 table
        EXTRA="--collab-key-dim 128"  # table rows: D~k 512 | 256 | 128 | 64
        ;;
    transformer_collab)  # our default configuration (EPFL package: content bias, 1/sqrt(D~k/H))
        EXTRA="--collab-key-dim 128"  # D~k = 128 (= the default d/4)
        ;;
    transformer_pkm)
        # Lample et al.: memory values get their own Adam lr 1e-3; pkm_adam keeps the model on
        # the same Adam/schedule (sparse value rows on 1 GPU without fp16, dense otherwise).
        OPTIM=(--optimizer pkm_adam --pkm-values-lr 1e-3)
        EXTRA="--fp16-no-flatten-grads"  # pkm_adam refuses fairseq's flattened fp16 buffer; multi-GPU uses dense values automatically
        ;;
    *)  # any other registered translation arch: its preset as it is
        KNOWN="$(known)" || exit 2
        if [[ " $KNOWN " != *" $ARCH "* ]]; then
            echo "train.sh: unknown ARCH '$ARCH'; known: $KNOWN" >&2
            exit 2
        fi
        EXTRA=""
        ;;
esac
read -r -a EXTRA_ARGS <<< "$EXTRA"

DATA="${DATA:-$ROOT/data/wmt14_en_de}"
SAVE="${SAVE:-$ROOT/checkpoints/wmt14_en_de/$ARCH}"
if [[ -z "${GPUS:-}" ]]; then
    GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
fi
if [[ "$GPUS" -gt 0 ]]; then
    WORLD="$GPUS"
    DEVICE=()
    FP16="${FP16:-1}"
else
    WORLD=1
    DEVICE=(--cpu)
    FP16="${FP16:-0}"
fi
# 8 GPU-equivalents of 4096 tokens per update (~32k tokens, the base model's batch)
UPDATE_FREQ="${UPDATE_FREQ:-$(( (8 + WORLD - 1) / WORLD ))}"
if [[ $(( WORLD * UPDATE_FREQ )) -ne 8 ]]; then
    echo "train.sh: warning: GPUs x UPDATE_FREQ = $WORLD x $UPDATE_FREQ = $(( WORLD * UPDATE_FREQ )), not 8" >&2
fi
PRECISION=()
if [[ "$FP16" == 1 ]]; then
    PRECISION=(--fp16)
fi

CMD=("$PYTHON" -m fairseq_cli.train "$DATA/bin"
    --user-dir "$ROOT/fairseq_attnzoo"
    --task translation --source-lang en --target-lang de
    --arch "$ARCH" --share-all-embeddings --dropout 0.1
    "${OPTIM[@]}" --adam-betas "(0.9, 0.98)" --adam-eps 1e-8 --clip-norm 0.0 --weight-decay 0.0
    --lr "${LR:-7e-4}" --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1
    --max-tokens "${MAX_TOKENS:-4096}" --update-freq "$UPDATE_FREQ"
    --max-update "${MAX_UPDATE:-100000}"
    --distributed-world-size "$WORLD" "${DEVICE[@]}" "${PRECISION[@]}"
    --save-dir "$SAVE" --save-interval-updates "${SAVE_INTERVAL_UPDATES:-1500}"
    --keep-interval-updates "${KEEP_CHECKPOINTS:-5}" --no-epoch-checkpoints
    --skip-invalid-size-inputs-valid-test
    --log-format simple --log-interval 100 --seed 1
    "${EXTRA_ARGS[@]}" "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
if [[ ! -f "$DATA/bin/dict.en.txt" ]]; then
    echo "train.sh: no binarised data in $DATA/bin: run examples/wmt14_en_de/prepare.sh (or set DATA)" >&2
    exit 2
fi
mkdir -p "$SAVE"
echo "+ ${CMD[*]}" | tee -a "$SAVE/train.log"
"${CMD[@]}" 2>&1 | tee -a "$SAVE/train.log"

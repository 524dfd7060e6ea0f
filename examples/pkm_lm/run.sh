#!/usr/bin/env bash
# Product-key memory language model on WikiText-103 with the stock fairseq tools
# (Lample et al. 2019 memory settings; see README.md in this folder).
#
#   examples/pkm_lm/run.sh prepare                 # download + fairseq-preprocess (needs internet)
#   examples/pkm_lm/run.sh train [fairseq-train flags...]
#   examples/pkm_lm/run.sh eval  [fairseq-eval-lm flags...]
#   examples/pkm_lm/run.sh usage                   # key usage / KL + pkm_usage.png
#
# Environment (all optional):
#   PYTHON      interpreter with fairseq + this plugin                 (python)
#   DATA        data folder; binaries in $DATA/bin                     (<repo>/data/wikitext-103)
#   SAVE        checkpoint directory                                   (<repo>/checkpoints/pkm_lm)
#   GPUS        GPUs to train on (0 = CPU)                             (all visible)
#   MAX_TOKENS  tokens per GPU per step                                (4096)
#   UPDATE_FREQ gradient accumulation                                  (8 / GPUS: 32k tokens/update)
#   MAX_UPDATE  training steps                                         (200000)
#   FP16        1 = --fp16 (dense values then: sparse values need fp32)  (0)
#   DRY_RUN     1 = print the commands instead of running them
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"
DATA="${DATA:-$ROOT/data/wikitext-103}"
SAVE="${SAVE:-$ROOT/checkpoints/pkm_lm}"
USER_DIR="$ROOT/fairseq_attnzoo"
URL="https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip"

run() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

STEP="${1:-}"
shift || true

case "$STEP" in
prepare)
    run mkdir -p "$DATA"
    if [[ ! -f "$DATA/wikitext-103/wiki.train.tokens" ]]; then
        run curl -L -o "$DATA/wikitext-103-v1.zip" "$URL"
        run unzip -o -q "$DATA/wikitext-103-v1.zip" -d "$DATA"
    fi
    run "$PYTHON" -m fairseq_cli.preprocess --only-source \
        --trainpref "$DATA/wikitext-103/wiki.train.tokens" \
        --validpref "$DATA/wikitext-103/wiki.valid.tokens" \
        --testpref "$DATA/wikitext-103/wiki.test.tokens" \
        --destdir "$DATA/bin" --workers 8
    ;;
train)
    if [[ -z "${GPUS:-}" ]]; then
        GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
    fi
    DEVICE=()
    WORLD="$GPUS"
    if [[ "$GPUS" -eq 0 ]]; then
        DEVICE=(--cpu)
        WORLD=1
    fi
    PRECISION=()
    if [[ "${FP16:-0}" == 1 ]]; then
        # fp16 gives dense value gradients (--pkm-sparse auto); pkm_adam needs unflattened params
        PRECISION=(--fp16 --fp16-no-flatten-grads)
    fi
    UPDATE_FREQ="${UPDATE_FREQ:-$(( (8 + WORLD - 1) / WORLD ))}"
    run mkdir -p "$SAVE"
    # model: 12 layers, d 1024, 16 heads, FFN 4096; memory in layer 6 (0-based, the middle)
    # memory: 512² = 262,144 slots, 4 heads, knn 32, k_dim 256, batch-normalised queries
    # optimizer: Adam lr 2.5e-4 for the model, 1e-3 for the memory values (sparse rows in fp32,
    # exchanged across GPUs by pkm_adam)
    run "$PYTHON" -m fairseq_cli.train "$DATA/bin" --user-dir "$USER_DIR" \
        --task language_modeling --arch transformer_lm_pkm \
        --decoder-layers 12 --decoder-embed-dim 1024 --decoder-ffn-embed-dim 4096 \
        --decoder-attention-heads 16 --share-decoder-input-output-embed --dropout 0.1 \
        --pkm-decoder-layers 6 --pkm-n-keys 512 --pkm-heads 4 --pkm-knn 32 --pkm-k-dim 256 \
        --pkm-query-batchnorm true \
        --tokens-per-sample 512 --sample-break-mode none \
        --optimizer pkm_adam --adam-betas "(0.9, 0.98)" \
        --lr 2.5e-4 --pkm-values-lr 1e-3 --lr-scheduler inverse_sqrt \
        --warmup-updates 4000 --warmup-init-lr 1e-07 --clip-norm 0.0 \
        --max-tokens "${MAX_TOKENS:-4096}" --update-freq "$UPDATE_FREQ" \
        --max-update "${MAX_UPDATE:-200000}" \
        --distributed-world-size "$WORLD" "${DEVICE[@]}" "${PRECISION[@]}" \
        --save-dir "$SAVE" --save-interval-updates 5000 --keep-interval-updates 3 \
        --no-epoch-checkpoints --log-format simple --log-interval 100 --seed 1 "$@"
    ;;
eval)
    run "$PYTHON" -m fairseq_cli.eval_lm "$DATA/bin" --user-dir "$USER_DIR" \
        --path "$SAVE/checkpoint_best.pt" --gen-subset test \
        --tokens-per-sample 512 --context-window 400 --max-tokens 4096 "$@"
    ;;
usage)
    run "$PYTHON" "$ROOT/scripts/plot_pkm_usage.py" --path "$SAVE/checkpoint_best.pt" \
        --data "$DATA/bin" --subset valid --out "$SAVE/pkm_usage.png" "$@"
    ;;
*)
    echo "usage: $0 prepare|train|eval|usage [extra flags...]" >&2
    exit 2
    ;;
esac

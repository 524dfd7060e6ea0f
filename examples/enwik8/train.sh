#!/usr/bin/env bash
# Train an adaptive-span or All-Attention character LM with the papers' settings.
#
#   bash examples/enwik8/train.sh CONFIG [DATA] [extra fairseq-train flags...]
#
# CONFIG (paper settings; global batch 64 sequences of 512 bytes unless noted):
#   adaptive_span_small   reference enwik8_small.sh: 8 layers, d 256, S 1024, block 256, 150k updates
#   adaptive_span         12 layers, d 512, S 8192 (paper: 1.02 bpc enwik8 test, 1.11 text8), 600k
#   adaptive_span_large   24 layers, d 768 (paper: 0.98 enwik8, 1.07 text8), 150k + 20k at lr/10
#   all_attention         18 layers, N 1024, no FFN (paper: 1.01 enwik8, 1.11 text8), 450k + 30k
#   all_attention_large   36 layers, N 2048 (paper: 0.98 enwik8, 1.08 text8), 200k + 10k
# DATA: data/enwik8/bin (default; python -m scripts.data.prepare_enwik8 --download), data/text8/bin
# (examples/enwik8/prepare_text8.py), or the offline stand-in data/wiki-gensim/bin.
#
# GPUS (default: all visible) x --batch-size x UPDATE_FREQ = the global batch (64 sequences);
# --update-freq U on one GPU computes exactly the update of U GPUs (streams are laid out by
# batch x GPUs x U). With fp16 add: --fp16 --fp16-no-flatten-grads (per-tensor clipping).
# DRY_RUN=1 prints the fairseq-train command(s) instead of running them. The same settings as
# fairseq-hydra-train configs: examples/enwik8/config/ (python -m scripts.make_hydra_configs).
set -euo pipefail
CONFIG=${1:?usage: train.sh CONFIG [DATA] [flags...]}
DATA=${2:-data/enwik8/bin}
shift $(( $# >= 2 ? 2 : 1 ))
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NAME=$(basename "$(dirname "$DATA")")
SAVE=${SAVE:-checkpoints/${NAME}_${CONFIG}}
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
BATCH=64  # sequences per update, all GPUs together
BLOCK=512
WARMUP=32000
case "$CONFIG" in
  adaptive_span_small) ARCH=adaptive_span_lm_small; BLOCK=256; WARMUP=8000; UPDATES=150000; FT=0 ;;
  adaptive_span)       ARCH=adaptive_span_lm;       UPDATES=600000; FT=0 ;;
  adaptive_span_large) ARCH=adaptive_span_lm_large; UPDATES=150000; FT=20000 ;;
  all_attention)       ARCH=all_attention_lm;       UPDATES=450000; FT=30000 ;;
  all_attention_large) ARCH=all_attention_lm_large; UPDATES=200000; FT=10000 ;;
  *) echo "unknown CONFIG $CONFIG" >&2; exit 2 ;;
esac
if [[ "$NAME" == text8 && "$CONFIG" == adaptive_span ]]; then UPDATES=900000; fi        # text8.sh
if [[ "$NAME" == text8 && "$CONFIG" == adaptive_span_large ]]; then UPDATES=250000; fi  # text8_large.sh
PER_GPU=${PER_GPU:-$(( BATCH / GPUS ))}
UPDATE_FREQ=$(( BATCH / (GPUS * PER_GPU) ))

COMMON=(
  "$DATA" --user-dir "$REPO/fairseq_attnzoo" --task attnzoo_stream_lm --arch "$ARCH"
  --tokens-per-sample "$BLOCK" --batch-size "$PER_GPU" --update-freq "$UPDATE_FREQ"
  --batch-size-valid 8 --criterion attnzoo_span_loss
  --optimizer adagrad_clip --grad-clip-per-tensor 0.03 --lr-scheduler fixed
  --warmup-updates "$WARMUP" --save-dir "$SAVE" --keep-last-epochs 2
  --validate-interval-updates 1000 --save-interval-updates 1000 --keep-interval-updates 2
  --max-valid-steps 200 --log-format json --log-interval 100 --seed 1
)
run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
run fairseq-train "${COMMON[@]}" --lr 0.07 --max-update "$UPDATES" "$@"
if (( FT > 0 )); then  # the papers' fine-tuning: more updates with a 10x smaller learning rate
  run fairseq-train "${COMMON[@]}" --lr 0.007 --max-update $(( UPDATES + FT )) \
    --reset-lr-scheduler --warmup-updates 0 "$@"
fi
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
echo "evaluate: bash $REPO/examples/enwik8/eval.sh $SAVE/checkpoint_best.pt $DATA"

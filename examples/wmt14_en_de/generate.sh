#!/usr/bin/env bash
# Translate newstest2014 with the average of the last 5 checkpoints and score it with sacreBLEU.
#
#   examples/wmt14_en_de/generate.sh ARCH [extra fairseq-generate flags...]
#
# Environment (all optional):
#   PYTHON      interpreter with fairseq + this plugin             (python)
#   DATA        output of prepare.sh                               (<repo>/data/wmt14_en_de)
#   SAVE        checkpoint directory of train.sh                   (<repo>/checkpoints/wmt14_en_de/ARCH)
#   N_AVG       how many of the newest checkpoints to average      (5)
#   CKPT        use this checkpoint instead of averaging
#   SUBSET      test (newstest2014) or valid (newstest2013)        (test)
#   MAX_TOKENS  tokens per generation batch                        (8192)
#   CPU         1 = add --cpu                                      (0)
#   DRY_RUN     1 = print the commands and exit
# Writes $SAVE/gen.$SUBSET.out (fairseq output), $SAVE/hyp.$SUBSET.de (detokenised hypotheses in
# test-set order) and $SAVE/score.$SUBSET.txt (sacreBLEU BLEU and chrF), and prints the BLEU line.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"

if [[ $# -lt 1 ]]; then
    echo "usage: $0 ARCH [fairseq-generate flags...]" >&2
    exit 2
fi
ARCH="$1"
shift

DATA="${DATA:-$ROOT/data/wmt14_en_de}"
SAVE="${SAVE:-$ROOT/checkpoints/wmt14_en_de/$ARCH}"
N_AVG="${N_AVG:-5}"
SUBSET="${SUBSET:-test}"
REF="$DATA/raw/$SUBSET.de"
GEN="$SAVE/gen.$SUBSET.out"
HYP="$SAVE/hyp.$SUBSET.de"
SCORE="$SAVE/score.$SUBSET.txt"
DEVICE=()
if [[ "${CPU:-0}" == 1 ]]; then
    DEVICE=(--cpu)
fi

AVG_CMD=()
if [[ -z "${CKPT:-}" ]]; then
    CKPT="$SAVE/checkpoint.avg$N_AVG.pt"
    AVG_CMD=("$PYTHON" -m fairseq_attnzoo.cli.average_checkpoints --inputs "$SAVE" --last "$N_AVG"
        --output "$CKPT")
fi
# --required-batch-size-multiple 1: every one of newstest2014's 3,003 sentences is translated even
# where the plugin's fix of fairseq's batching is switched off (ATTNZOO_COMPAT_DISABLE)
GEN_CMD=("$PYTHON" -m fairseq_cli.generate "$DATA/bin"
    --user-dir "$ROOT/fairseq_attnzoo"
    --task translation --source-lang en --target-lang de
    --path "$CKPT" --gen-subset "$SUBSET"
    --beam 4 --lenpen 0.6 --remove-bpe sentencepiece
    --max-tokens "${MAX_TOKENS:-8192}" --required-batch-size-multiple 1 "${DEVICE[@]}" "$@")
SCORE_CMD=("$PYTHON" -m sacrebleu "$REF" -i "$HYP" -m bleu chrf -f text)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    if [[ ${#AVG_CMD[@]} -gt 0 ]]; then
        printf '%q ' "${AVG_CMD[@]}"
        echo
    fi
    printf '%q ' "${GEN_CMD[@]}"
    echo "> $(printf '%q' "$GEN")"
    printf '%q ' "${SCORE_CMD[@]}"
    echo
    exit 0
fi

if [[ ! -f "$REF" ]]; then
    echo "generate.sh: no reference $REF: run examples/wmt14_en_de/prepare.sh (or set DATA)" >&2
    exit 2
fi
if [[ ${#AVG_CMD[@]} -gt 0 ]]; then
    "${AVG_CMD[@]}"
fi
"${GEN_CMD[@]}" > "$GEN"
# D-<id>\t<score>\t<detokenised hypothesis>, in batch order: put them back in test-set order
grep '^D-' "$GEN" | sed 's/^D-//' | sort -s -t $'\t' -k1,1n | cut -f3- > "$HYP" || true
n_hyp="$(awk 'END { print NR }' "$HYP")"
n_ref="$(awk 'END { print NR }' "$REF")"
if [[ "$n_hyp" != "$n_ref" ]]; then
    echo "generate.sh: $n_hyp hypotheses for $n_ref reference lines (see $GEN)" >&2
    exit 1
fi
"${SCORE_CMD[@]}" > "$SCORE"
sed -n 's/^[[:space:]]*\(BLEU|\)/\1/p' "$SCORE"  # sacreBLEU right-aligns "BLEU" under "chrF2"

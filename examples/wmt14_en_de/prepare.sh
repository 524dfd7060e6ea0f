#!/usr/bin/env bash
# Download and prepare WMT'14 English->German (Europarl v7 + Common Crawl + News Commentary v9;
# newstest2013 valid; newstest2014 full test): clean, joint SentencePiece BPE 32k, fairseq binaries.
#
#   examples/wmt14_en_de/prepare.sh [extra flags of scripts/data/prepare_wmt14_en_de.py...]
#
# Environment (all optional):
#   PYTHON   interpreter with fairseq, sentencepiece (python)
#   DATA     output directory                        (<repo>/data/wmt14_en_de)
#   CACHE    downloaded archives                     (<repo>/data/cache/wmt14)
#   WORKERS  SentencePiece threads / preprocess workers (8)
# Needs ~1.6 GB of downloads and ~7 GB of disk in all. No internet? Put plain-text
# train/valid/test.{en,de} in a folder and run
#   $PYTHON -m scripts.data.prepare_wmt14_en_de --raw-dir FOLDER --out "$DATA"   (repository root)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python}"

cd "$ROOT"  # scripts/ is a package of the repository
exec "$PYTHON" -m scripts.data.prepare_wmt14_en_de --download \
    --out "${DATA:-$ROOT/data/wmt14_en_de}" --cache "${CACHE:-$ROOT/data/cache/wmt14}" \
    --workers "${WORKERS:-8}" "$@"

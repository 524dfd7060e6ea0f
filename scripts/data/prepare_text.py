"""Your own text as a fairseq data directory, in one step: SentencePiece, encoding, fairseq-preprocess.

Translation (raw parallel text, one sentence a line, ``PREFIX.SRC`` and ``PREFIX.TGT`` line by line
aligned, for the train, valid and test prefixes)::

    python -m scripts.data.prepare_text --src es --tgt en --train raw/train --valid raw/valid \\
        --test raw/test --out data/my-es-en

Language model (raw text files, one paragraph or sentence a line)::

    python -m scripts.data.prepare_text --train raw/train.txt --valid raw/valid.txt \\
        --test raw/test.txt --out data/my-lm

What it does, into ``OUT``:

1. one SentencePiece model on the training text (joint over source and target for translation):
   ``OUT/spm.model``, ``OUT/spm.vocab`` (unigram by default, ``--spm-type bpe``; every
   character kept, a fixed seed);
2. every file encoded to ``OUT/spm/`` as space-separated pieces (``▁`` marks a word start);
3. ``fairseq-preprocess`` (this interpreter's ``fairseq_cli.preprocess``) into ``OUT/bin``: a
   joined dictionary for translation, ``--only-source`` for a language model.

It ends by printing the commands that train on ``OUT/bin`` and score with ``--remove-bpe
sentencepiece`` (the segmentation of this data). The ``sentencepiece`` Python package is all it
needs besides fairseq (no ``spm_train`` binary). A mistake is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from scripts.data.preplib import (
    PrepError, add_progress_flag, configure_progress, count_lines, encode_file, run_main,
    run_preprocess, train_spm, write_stats)

SPLITS = ("train", "valid", "test")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.data.prepare_text",
        description="Raw text (parallel with --src/--tgt, else monolingual for a language model) "
                    "-> SentencePiece -> fairseq-preprocess, into OUT/bin.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for split in SPLITS:
        p.add_argument(f"--{split}", required=True, metavar="PATH",
                       help=f"the {split} text: a prefix (PATH.SRC, PATH.TGT) with --src/--tgt, "
                            "else a file")
    p.add_argument("--src", help="source language suffix of the parallel files (e.g. es)")
    p.add_argument("--tgt", help="target language suffix of the parallel files (e.g. en)")
    p.add_argument("--out", required=True, help="output directory (OUT/bin is the data-bin)")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="the most SentencePiece pieces (a small text gets fewer)")
    p.add_argument("--spm-type", default="unigram", choices=["unigram", "bpe"],
                   help="SentencePiece model type")
    p.add_argument("--seed", type=int, default=1, help="SentencePiece's random seed")
    p.add_argument("--workers", type=int, default=1, help="threads and fairseq-preprocess workers")
    add_progress_flag(p)
    return p


def _inputs(args) -> dict:
    """{split: [(raw file, encoded name)]}, each file checked; parallel files line-aligned."""
    if bool(args.src) != bool(args.tgt):
        raise PrepError("pass both --src and --tgt (translation) or neither (a language model)")
    files = {}
    for split in SPLITS:
        prefix = getattr(args, split)
        if args.src:
            pair = [(Path(f"{prefix}.{lang}"), f"{split}.{lang}") for lang in (args.src, args.tgt)]
        else:
            pair = [(Path(prefix), f"{split}.txt")]
        for path, _ in pair:
            if not path.is_file():
                raise PrepError(f"--{split} {prefix}: {path} does not exist"
                                + (f" (with --src/--tgt, --{split} is the prefix of "
                                   f"PREFIX.{args.src} and PREFIX.{args.tgt})" if args.src else ""))
            if count_lines(path) == 0:
                raise PrepError(f"--{split}: {path} is empty; give it at least one line")
        if args.src:
            counts = [count_lines(path) for path, _ in pair]
            if counts[0] != counts[1]:
                raise PrepError(f"--{split}: {pair[0][0]} has {counts[0]:,} lines and "
                                f"{pair[1][0]} {counts[1]:,}: parallel files must be aligned "
                                "line by line")
        files[split] = pair
    return files


def prepare(args) -> dict:
    t0 = time.time()
    files = _inputs(args)
    out = Path(args.out)
    (out / "spm").mkdir(parents=True, exist_ok=True)
    timings = {}
    t = time.time()
    sp = train_spm([path for path, _ in files["train"]], out / "spm", args.vocab_size,
                   args.spm_type, args.seed, args.workers, hard_vocab_limit=False)
    for split in SPLITS:
        for path, name in files[split]:
            encode_file(sp, path, out / "spm" / name, args.workers)
    timings["sentencepiece"] = round(time.time() - t, 2)
    t = time.time()
    prefixes = [out / "spm" / split for split in SPLITS]
    if args.src:
        run_preprocess(out / "bin", prefixes, args.workers, joined_dictionary=True,
                       lead=["--source-lang", args.src, "--target-lang", args.tgt])
    else:
        run_preprocess(out / "bin", [p.with_suffix(".txt") for p in prefixes], args.workers,
                       lead=["--only-source"])
    timings["binarize"] = round(time.time() - t, 2)
    stats = {"settings": vars(args),
             "lines": {split: count_lines(files[split][0][0]) for split in SPLITS},
             "spm_vocab_size": sp.get_piece_size()}
    write_stats(out, stats, timings, t0, size_dirs=("spm", "bin"))
    return stats


#: the --tokens-per-sample of the printed language-model commands (training and eval-lm alike)
LM_TOKENS = 512


def summary(args, stats: dict) -> str:
    """What was made, and the commands that use it (with this data's --remove-bpe)."""
    out, bin_dir = Path(args.out), Path(args.out) / "bin"
    lines = ", ".join(f"{k} {v:,}" for k, v in stats["lines"].items())
    head = (f"{bin_dir}: lines {lines}; SentencePiece {stats['spm_vocab_size']:,} pieces "
            f"({out / 'spm.model'})")
    spm = f"--bpe sentencepiece --sentencepiece-model {out / 'spm.model'}"
    if args.src:
        return (f"{head}\nnext: fairseq-train {bin_dir} --user-dir fairseq_attnzoo --arch ARCH "
                f"... (README, Translation)\n      fairseq-generate {bin_dir} --user-dir "
                "fairseq_attnzoo --path CHECKPOINT --gen-subset test --remove-bpe sentencepiece "
                f"--scoring sacrebleu\n      fairseq-interactive {bin_dir} --user-dir "
                f"fairseq_attnzoo --path CHECKPOINT {spm} (translate typed text)")
    # eval-lm's --tokens-per-sample defaults to 1024, not to the model's: both commands name it
    return (f"{head}\nnext: fairseq-train {bin_dir} --user-dir fairseq_attnzoo --task "
            f"language_modeling --tokens-per-sample {LM_TOKENS} --arch ARCH ... (README, Word "
            f"language model)\n      fairseq-eval-lm {bin_dir} --user-dir fairseq_attnzoo --path "
            f"CHECKPOINT --tokens-per-sample {LM_TOKENS} --gen-subset test (the "
            "--tokens-per-sample it was trained with)\n      attnzoo-sample "
            f"{bin_dir} --path CHECKPOINT {spm} --prompt TEXT --sampling")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    configure_progress(args)
    return run_main(Path(args.out), False, lambda: prepare(args), lambda s: summary(args, s))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Prepare WMT'14 English->German (the Transformer / Synthesizer / AOP / collab papers' benchmark).

Sources (exactly one)
    --download     fetch with urllib into ``--cache``; the URLs of fairseq's
                   ``examples/translation/prepare-wmt14en2de.sh --icml17`` (WMT'14 data only):

        train  Europarl v7        http://statmt.org/wmt13/training-parallel-europarl-v7.tgz
               Common Crawl       http://statmt.org/wmt13/training-parallel-commoncrawl.tgz
               News Commentary 9  http://statmt.org/wmt14/training-parallel-nc-v9.tgz
        valid  newstest2013       http://data.statmt.org/wmt17/translation-task/dev.tgz
                                  (plain text dev/newstest2013.{en,de})
        test   newstest2014 full  http://statmt.org/wmt14/test-full.tgz (3003 sentences, the
                                  "full" version the papers report)

                   About 1.6 GB of archives; only the en/de members are extracted. The test SGM
                   files are read exactly as sacrebleu reads ``-t wmt14/full -l en-de`` (the same
                   tarball): every ``<seg ...>text</seg>`` line, whitespace collapsed and stripped,
                   no entity unescaping -- so ``OUT/raw/test.de`` is the text that
                   ``sacrebleu -t wmt14/full -l en-de --echo ref`` prints, and scoring against it
                   equals scoring with ``-t wmt14/full``.
    --raw-dir DIR  plain text you provide, one sentence a line, line-aligned:
                   ``DIR/{train,valid,test}.{en,de}`` (e.g. built by hand from the archives
                   above, or ``sacrebleu -t wmt14/full -l en-de --echo src > DIR/test.en`` and
                   ``--echo ref > DIR/test.de``; ``-t wmt13`` for valid).

Pipeline
    1. Normalise (train, and the model input of valid/test): control characters become spaces,
       invisible format characters (soft hyphen, zero-width spaces, BOM, direction marks) are
       removed -- like Moses' remove-non-printing-char -- and whitespace is collapsed.
    2. Clean train like Moses ``clean-corpus-n.perl -ratio R CORPUS en de OUT 1 MAX``: drop pairs
       with an empty side, more than ``--max-len`` (250) words on either side, or a word-count
       ratio above ``--ratio`` (1.5) either way; also drop exact duplicate pairs (first kept).
       Words are whitespace-separated tokens of the detokenised text (fairseq counts BPE tokens
       after Moses tokenisation; the effect is similar). valid and test are never filtered: the
       full newstest2013 / newstest2014 are kept so BLEU is computed on the whole sets.
    3. ``OUT/raw/``: cleaned ``train.{en,de}``, and ``{valid,test}.{en,de}`` byte-for-byte as
       given (``raw/test.de`` is the detokenised reference for sacrebleu).
    4. One joint SentencePiece model (``--spm-type bpe``, ``--vocab-size`` 32000) on train en+de:
       at most ``--spm-sentences`` lines sampled with a fixed seed, ``--character-coverage``
       0.9999 (crawl data carries thousands of stray characters that would otherwise take
       vocabulary slots). All splits are encoded to ``OUT/spm/{split}.{en,de}``.
    5. ``python -m fairseq_cli.preprocess --source-lang en --target-lang de --joined-dictionary``
       (same interpreter) into ``OUT/bin``.
    6. ``OUT/stats.json`` records counts, timings and the settings; a rerun with the same settings
       and inputs prints "cached" and exits 0 (``--force`` redoes everything).

Evaluation: see ``examples/wmt14_en_de/generate.sh`` (fairseq-generate ``--remove-bpe
sentencepiece``, then ``sacrebleu OUT/raw/test.de -i hyp``).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

from scripts.data.preplib import (
    PrepError, add_progress_flag, binarize, configure_progress, count_lines, encode_file,
    fetch_url, is_cached, progress, read_lines, run_main, train_spm, write_lines, write_stats,
)

SRC, TGT = "en", "de"
SPLITS = ("train", "valid", "test")
SCHEMA_VERSION = 1

# (name, url, archive member prefix; members are PREFIX.en / PREFIX.de)
TRAIN_CORPORA = (
    ("europarl-v7", "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
     "training/europarl-v7.de-en"),
    ("commoncrawl", "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
     "commoncrawl.de-en"),
    ("news-commentary-v9", "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
     "training/news-commentary-v9.de-en"),
)
DEV_URL = "http://data.statmt.org/wmt17/translation-task/dev.tgz"
DEV_MEMBERS = {SRC: "dev/newstest2013.en", TGT: "dev/newstest2013.de"}
TEST_URL = "http://statmt.org/wmt14/test-full.tgz"
TEST_MEMBERS = {SRC: "test-full/newstest2014-deen-src.en.sgm",
                TGT: "test-full/newstest2014-deen-ref.de.sgm"}

RAW_FILES = tuple(f"{split}.{lang}" for split in SPLITS for lang in (SRC, TGT))


# --------------------------------------------------------------------------------------------
# Text normalisation and cleaning
# --------------------------------------------------------------------------------------------
# C0/C1 control characters -> space; invisible format characters -> removed.
_INVISIBLE = [0x00AD, 0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0x2061, 0x2062, 0x2063,
              0x2064, 0xFEFF] + list(range(0x202A, 0x202F))
_TRANSLATE = {c: " " for c in list(range(0x00, 0x20)) + list(range(0x7F, 0xA0))}
_TRANSLATE.update({c: None for c in _INVISIBLE})


def normalize_line(line: str) -> str:
    """Controls -> space, invisible format characters removed, whitespace collapsed."""
    return " ".join(line.translate(_TRANSLATE).split())


def iter_clean_pairs(pairs, max_len: int = 250, ratio: float = 1.5, dedup: bool = True,
                     stats: dict | None = None, seen: set | None = None):
    """Yield the (src, tgt) pairs that survive Moses-style cleaning; count drops in ``stats``.

    Each dropped pair is counted once, under the first rule it fails, in this order:
    ``empty`` (a side with no words), ``too_long`` (> max_len words on a side), ``ratio``
    (longer/shorter word count > ratio), ``duplicate`` (same normalised pair seen before;
    pass the same ``seen`` set to several calls to deduplicate across corpora).
    """
    c = stats if stats is not None else {}
    for key in ("read", "empty", "too_long", "ratio", "duplicate", "kept"):
        c.setdefault(key, 0)
    seen = set() if seen is None else seen
    for src, tgt in pairs:
        c["read"] += 1
        src, tgt = normalize_line(src), normalize_line(tgt)
        ns, nt = len(src.split()), len(tgt.split())
        if ns == 0 or nt == 0:
            c["empty"] += 1
            continue
        if ns > max_len or nt > max_len:
            c["too_long"] += 1
            continue
        if ns > ratio * nt or nt > ratio * ns:
            c["ratio"] += 1
            continue
        if dedup:
            # 8-byte digest instead of the pair itself: ~4.5M WMT pairs fit in a few hundred MB
            key = hashlib.blake2b(f"{src}\t{tgt}".encode("utf-8"), digest_size=8).digest()
            if key in seen:
                c["duplicate"] += 1
                continue
            seen.add(key)
        c["kept"] += 1
        yield src, tgt


def clean_pairs(src_lines, tgt_lines, max_len: int = 250, ratio: float = 1.5,
                dedup: bool = True):
    """List version of :func:`iter_clean_pairs`: returns ``(pairs, stats)``."""
    src_lines, tgt_lines = list(src_lines), list(tgt_lines)
    if len(src_lines) != len(tgt_lines):
        raise PrepError(f"{len(src_lines)} source lines but {len(tgt_lines)} target lines")
    stats: dict = {}
    pairs = list(iter_clean_pairs(zip(src_lines, tgt_lines), max_len, ratio, dedup, stats))
    return pairs, stats


def read_pairs(src_path: Path, tgt_path: Path, desc: str = ""):
    """Aligned (src, tgt) lines of two files (with a progress bar named ``desc``); a PrepError if
    their line counts differ."""
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise PrepError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: the files "
                        f"must be line-aligned")
    pairs = zip(read_lines(src_path), read_lines(tgt_path))
    return progress(pairs, total=n_src, desc=desc, unit="pair") if desc else pairs


def sgm_segments(lines):
    """Segments of a WMT (fake) SGML file, read the way sacrebleu reads ``-t wmt14/full``: lines
    starting with ``<seg `` lose the tag, then whitespace is collapsed and stripped."""
    seg = re.compile(r"<seg[^>]*>(.*)</seg>")
    for line in lines:
        if line.startswith("<seg "):
            m = seg.match(line)
            text = m.group(1) if m else line
            yield " ".join(text.split())


# --------------------------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------------------------
def _hand_hint(cache: Path) -> str:
    return (f"download it by hand into {cache}/ and rerun, or pass --raw-dir DIR with plain-text "
            f"{' '.join(RAW_FILES)}")


def download(url: str, cache: Path) -> Path:
    """``cache/<basename of url>``, fetched with urllib unless already there."""
    dest = cache / url.rsplit("/", 1)[-1]
    if dest.exists():
        print(f"cached {dest}", flush=True)
        return dest
    print(f"downloading {url}", flush=True)
    fetch_url(url, dest, _hand_hint(cache))
    return dest


def _member_name(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def extract_members(archive: Path, members: dict, dest_dir: Path) -> dict:
    """Write the named members of a .tgz to ``dest_dir`` (never extracting anything else);
    returns {key: path}. ``members`` maps key -> member name inside the archive."""
    want = {_member_name(name): key for key, name in members.items()}
    out = {key: dest_dir / Path(name).name for key, name in members.items()}
    if all(p.exists() for p in out.values()):
        return out
    dest_dir.mkdir(parents=True, exist_ok=True)
    found = set()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                name = _member_name(info.name)
                if name in want and info.isfile():
                    key = want[name]
                    tmp = out[key].with_name(out[key].name + ".part")
                    with tar.extractfile(info) as src, open(tmp, "wb") as dst, \
                            progress(total=info.size, desc=f"extract {out[key].name}",
                                     nbytes=True) as bar:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            dst.write(block)
                            bar.update(len(block))
                    tmp.rename(out[key])
                    found.add(key)
                    if len(found) == len(want):
                        break
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepError(f"cannot read {archive} ({e}); delete it and rerun to download it "
                        f"again") from None
    missing = [members[k] for k in members if k not in found and not out[k].exists()]
    if missing:
        raise PrepError(f"{archive} lacks {', '.join(missing)}; delete it and rerun, or "
                        f"{_hand_hint(archive.parent)}")
    return out


def fetch_wmt14(cache: Path) -> dict:
    """Download and extract everything; returns {"train": [(name, en_path, de_path)],
    "valid": (en_path, de_path), "test": (en_sgm, de_sgm)}."""
    archives = [download(url, cache) for _, url, _ in TRAIN_CORPORA]
    dev = download(DEV_URL, cache)
    test = download(TEST_URL, cache)
    ex = cache / "extracted"
    train = []
    for (name, _, prefix), archive in zip(TRAIN_CORPORA, archives):
        print(f"extracting {name}", flush=True)
        p = extract_members(archive, {SRC: f"{prefix}.{SRC}", TGT: f"{prefix}.{TGT}"}, ex)
        train.append((name, p[SRC], p[TGT]))
    dev_p = extract_members(dev, DEV_MEMBERS, ex)
    test_p = extract_members(test, TEST_MEMBERS, ex)
    return {"train": train, "valid": (dev_p[SRC], dev_p[TGT]),
            "test": (test_p[SRC], test_p[TGT])}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Prepare WMT'14 English->German: clean, joint SentencePiece, fairseq binaries.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--download", action="store_true",
                     help="download the WMT'14 corpora (Europarl v7, Common Crawl, News Commentary "
                     "v9, newstest2013, newstest2014 full) into --cache")
    src.add_argument("--raw-dir", metavar="DIR",
                     help="use plain-text DIR/{train,valid,test}.{en,de} (one sentence a line, "
                     "aligned) instead of downloading")
    p.add_argument("--out", default="data/wmt14_en_de",
                   help="output directory (raw/, spm/, spm.model, bin/, stats.json)")
    p.add_argument("--cache", default="data/cache/wmt14",
                   help="where --download keeps the archives and the extracted files")
    p.add_argument("--max-len", type=int, default=250,
                   help="train: drop pairs with more words than this on either side")
    p.add_argument("--ratio", type=float, default=1.5,
                   help="train: drop pairs whose word-count ratio exceeds this either way")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="joint SentencePiece vocabulary size")
    p.add_argument("--spm-type", default="bpe", choices=["bpe", "unigram"],
                   help="SentencePiece model type")
    p.add_argument("--spm-sentences", type=int, default=10_000_000,
                   help="SentencePiece trains on at most this many train lines (en+de together; "
                   "seeded random sample). Needs RAM: lower it (e.g. 2000000) on small machines")
    p.add_argument("--character-coverage", type=float, default=0.9999,
                   help="SentencePiece character_coverage (rarer characters become <unk>)")
    p.add_argument("--seed", type=int, default=1, help="SentencePiece sampling seed")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="threads for SentencePiece and workers for fairseq-preprocess")
    p.add_argument("--skip-binarize", action="store_true",
                   help="stop after the SentencePiece files; do not run fairseq-preprocess")
    p.add_argument("--force", action="store_true", help="redo everything even if cached")
    add_progress_flag(p)
    return p


def _inputs_fingerprint(args) -> dict:
    if args.download:
        return {"source": "download", "urls": [u for _, u, _ in TRAIN_CORPORA]
                + [DEV_URL, TEST_URL]}
    raw = Path(args.raw_dir).resolve()
    files = {}
    for name in RAW_FILES:
        path = raw / name
        files[name] = [path.stat().st_size, int(path.stat().st_mtime)] if path.exists() else None
    return {"source": str(raw), "files": files}


def _settings(args) -> dict:
    return {
        "schema": SCHEMA_VERSION, "max_len": args.max_len, "ratio": args.ratio,
        "vocab_size": args.vocab_size, "spm_type": args.spm_type,
        "spm_sentences": args.spm_sentences, "character_coverage": args.character_coverage,
        "seed": args.seed, "inputs": _inputs_fingerprint(args),
    }


def _is_cached(out: Path, args) -> bool:
    needed = [out / "spm.model"] + [out / d / n for d in ("raw", "spm") for n in RAW_FILES]
    bin_needed = [out / "bin" / f"dict.{TGT}.txt", out / "bin" / f"test.{SRC}-{TGT}.{TGT}.bin"]
    return is_cached(out, _settings(args), needed, None if args.skip_binarize else bin_needed)


def _print_clean(name: str, c: dict):
    print(f"  {name}: read {c['read']}, dropped empty {c['empty']}, too long {c['too_long']}, "
          f"ratio {c['ratio']}, duplicate {c['duplicate']}; kept {c['kept']}", flush=True)


def prepare(args) -> dict:
    t0 = time.time()
    out = Path(args.out)
    timings = {}
    (out / "stats.json").unlink(missing_ok=True)  # a run that fails half-way is never "cached"

    # ---- sources ---------------------------------------------------------------------------
    if args.download:
        got = fetch_wmt14(Path(args.cache))
        train_sources, valid_src, test_sgm = got["train"], got["valid"], got["test"]
    else:
        raw_in = Path(args.raw_dir)
        missing = [n for n in RAW_FILES if not (raw_in / n).is_file()]
        if missing:
            raise PrepError(f"--raw-dir {raw_in}: missing {' '.join(missing)} (expected plain "
                            f"text {' '.join(RAW_FILES)})")
        train_sources = [("train", raw_in / f"train.{SRC}", raw_in / f"train.{TGT}")]
        valid_src = (raw_in / f"valid.{SRC}", raw_in / f"valid.{TGT}")
        test_sgm = None
    timings["sources"] = round(time.time() - t0, 2)

    # ---- raw text: cleaned train, verbatim valid/test ---------------------------------------
    t = time.time()
    raw_dir, spm_dir = out / "raw", out / "spm"
    raw_dir.mkdir(parents=True, exist_ok=True)
    spm_dir.mkdir(parents=True, exist_ok=True)
    print("cleaning train", flush=True)
    per_corpus: dict = {}
    total = dict.fromkeys(("read", "empty", "too_long", "ratio", "duplicate", "kept"), 0)
    seen: set = set()  # one duplicate filter across all corpora
    with open(raw_dir / f"train.{SRC}", "w", encoding="utf-8", newline="\n") as fs, \
            open(raw_dir / f"train.{TGT}", "w", encoding="utf-8", newline="\n") as ft:
        for name, src_path, tgt_path in train_sources:
            c: dict = {}
            pairs = read_pairs(src_path, tgt_path, desc=f"clean {name}")
            for s, tt in iter_clean_pairs(pairs, args.max_len, args.ratio, True, c, seen):
                fs.write(s + "\n")
                ft.write(tt + "\n")
            per_corpus[name] = c
            if len(train_sources) > 1:
                _print_clean(name, c)
            for k in total:
                total[k] += c[k]
    _print_clean("train total", total)
    if total["kept"] == 0:
        raise PrepError("no training pairs left after cleaning (check --max-len / --ratio and the "
                        "input files)")

    for split in ("valid", "test"):
        for lang in (SRC, TGT):
            dest = raw_dir / f"{split}.{lang}"
            if split == "valid":
                shutil.copyfile(valid_src[0 if lang == SRC else 1], dest)
            elif test_sgm is None:
                shutil.copyfile(Path(args.raw_dir) / f"test.{lang}", dest)
            else:
                write_lines(dest, sgm_segments(read_lines(test_sgm[0 if lang == SRC else 1])))
        n_src = count_lines(raw_dir / f"{split}.{SRC}")
        n_tgt = count_lines(raw_dir / f"{split}.{TGT}")
        if n_src != n_tgt:
            raise PrepError(f"{split}: {n_src} {SRC} lines but {n_tgt} {TGT} lines; the files must "
                            f"be line-aligned")
    counts = {"train": total["kept"], "valid": count_lines(raw_dir / f"valid.{SRC}"),
              "test": count_lines(raw_dir / f"test.{SRC}")}
    timings["clean"] = round(time.time() - t, 2)

    # ---- SentencePiece ------------------------------------------------------------------------
    t = time.time()
    print(f"training SentencePiece {args.spm_type} {args.vocab_size} on train {SRC}+{TGT} (at most "
          f"{args.spm_sentences} lines)", flush=True)
    try:
        sp = train_spm([raw_dir / f"train.{SRC}", raw_dir / f"train.{TGT}"], out / "spm",
                       args.vocab_size, args.spm_type, args.seed, args.workers,
                       character_coverage=args.character_coverage,
                       input_sentence_size=args.spm_sentences,  # a seeded random sample if larger
                       shuffle_input_sentence=True)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        raise PrepError(f"SentencePiece training failed ({msg[-300:]}); try another "
                        f"--vocab-size") from None
    timings["spm_train"] = round(time.time() - t, 2)
    t = time.time()
    for split in SPLITS:
        for lang in (SRC, TGT):
            encode_file(sp, raw_dir / f"{split}.{lang}", spm_dir / f"{split}.{lang}", args.workers,
                        normalize=normalize_line)
    timings["spm_encode"] = round(time.time() - t, 2)

    stats = {
        "settings": _settings(args),
        "pairs": counts,
        "clean": {"total": total, **(per_corpus if len(per_corpus) > 1 else {})},
        "spm_vocab_size": sp.get_piece_size(),
        "binarized": False,
    }
    if not args.skip_binarize:
        binarize(stats, timings, out / "bin" / f"dict.{TGT}.txt", out / "bin",
                 [spm_dir / s for s in SPLITS], args.workers,
                 lead=["--source-lang", SRC, "--target-lang", TGT], joined_dictionary=True)
    write_stats(out, stats, timings, t0, size_dirs=("raw", "spm", "bin"))
    return stats


def _summary(stats: dict, out: Path) -> str:
    p = stats["pairs"]
    return (f"pairs train {p['train']}, valid {p['valid']}, test {p['test']}; spm vocab "
            f"{stats['spm_vocab_size']}; {stats['timings_s']['total']} s -> {out}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    configure_progress(args)
    out = Path(args.out)
    return run_main(out, not args.force and _is_cached(out, args), lambda: prepare(args),
                    lambda stats: _summary(stats, out), redo="redo")


if __name__ == "__main__":
    sys.exit(main())

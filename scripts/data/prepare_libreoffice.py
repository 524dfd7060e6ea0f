#!/usr/bin/env python3
"""Build a German<->English MT corpus from Debian's LibreOffice offline help.

Source
    The Debian packages ``libreoffice-help-de`` and ``libreoffice-help-en-us`` (MPL-2.0) ship the
    LibreOffice help as HTML under ``usr/share/libreoffice/help/{de,en-US}/text/``. Both languages
    are generated from the same XHP sources, so every paragraph carries the same ``id``
    (``par_id...``, ``hd_id...``, ``bm_id...``; a few older ones are ``par_123``/``hd_123``) in both
    languages and sentence pairs align exactly by (help file, id). ``apt-get download`` needs no root.

Pipeline (``python -m scripts.data.prepare_libreoffice --help`` for the options)
    1. ``apt-get download`` both packages into ``--cache`` and ``dpkg-deb -x`` them there (skipped when
       already there; ``--debs DIR`` uses .deb files or extracted trees you provide instead).
    2. Parse every help page with the stdlib ``html.parser``. The text of an element is its visible
       text: markup dropped, entities unescaped, whitespace collapsed. Hidden platform/application
       variants (``<span hidden="true" id="MACtext...">`` etc. inside ``class="switchinline"``) are
       dropped except the ``defaulttext...`` variant, i.e. the text a Linux user sees
       ("Ctrl", not "CommandCtrl"). Content of ``<div class="embedded">`` blocks is skipped: it is
       copied from another help page (with that page's ids) and would otherwise leak across splits.
    3. Align by (relative file path, id). An id that occurs several times in one page (about 250
       pages reuse snippets, sometimes with *different* text under the same id) is aligned by
       occurrence: the k-th occurrence in German pairs with the k-th in English, and only when both
       pages have the same number of occurrences; otherwise all occurrences are dropped.
    4. Filter: drop empty pairs, pairs with fewer than ``--min-words`` or more than ``--max-words``
       whitespace-separated words on either side, untranslated pairs (src == tgt), and exact duplicate
       pairs (the first occurrence in sorted file order is kept).
    5. Split by help file (never at random: near-identical UI strings would leak): files are ordered
       by a salted SHA-1 of their relative path and dealt to test/valid until each holds
       ``max(frac * N, min(--min-heldout, N/10))`` pairs; the rest is train. Afterwards valid/test
       pairs whose source sentence also occurs in train (or test pairs whose source occurs in valid)
       are removed, so no held-out source sentence was seen in training.
    6. Raw text: ``OUT/raw/{train,valid,test}.{src,tgt}`` (one sentence per line, detokenised).
    7. One joint SentencePiece model on train src+tgt (``OUT/spm.model``/``OUT/spm.vocab``; unigram
       by default, ``--spm-type bpe`` for BPE), character_coverage 1.0, fixed seed. Every split is
       encoded to ``OUT/spm/{split}.{lang}`` as space-separated pieces.
    8. ``fairseq-preprocess --joined-dictionary`` (run as ``sys.executable -m fairseq_cli.preprocess``)
       into ``OUT/bin``: ``dict.{src}.txt`` == ``dict.{tgt}.txt`` and ``{split}.{src}-{tgt}.{lang}.{bin,idx}``.
    9. ``OUT/stats.json`` records counts and the settings; a rerun with the same settings prints
       "cached" and exits 0 (``--force`` rebuilds).

Evaluation (BLEU)
    The binarised data holds SentencePiece pieces. Remove them at generation time and score the
    detokenised output against the raw reference with sacrebleu, e.g.::

        fairseq-generate data/libreoffice/bin --path ckpt.pt --gen-subset test --beam 5 \\
            --remove-bpe sentencepiece > gen.out          # or --post-process sentencepiece
        grep ^H- gen.out | sed 's/^H-//' | sort -n | cut -f3 > hyp.txt
        sacrebleu data/libreoffice/raw/test.en -i hyp.txt

    (``fairseq-generate --scoring sacrebleu --remove-bpe sentencepiece`` prints the same score.)
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from html.parser import HTMLParser
from pathlib import Path

from scripts.data.preplib import (
    PrepError, add_progress_flag, binarize, configure_progress, encode_file, is_cached, progress,
    run_main, train_spm, write_lines, write_stats,
)

HELP_SUBDIR = Path("usr/share/libreoffice/help")
SPLITS = ("train", "valid", "test")
# Ids of translatable paragraphs/headings. bm_id... are index entries; bm_module/bm_system/bm_HID
# (boilerplate on every page) deliberately do not match.
PARA_ID_RE = re.compile(r"^(?:par_|hd_|bm_id)")
# Elements that never have an end tag (must not be counted as open elements).
VOID_TAGS = frozenset(
    "area base br col embed hr img input link meta param source track wbr".split()
)
# Elements whose text never shows (or is code/metadata).
INVISIBLE_TAGS = frozenset(["script", "style", "noscript", "head", "title", "template"])
# Elements that separate words visually.
BREAK_TAGS = frozenset(["br", "p", "div", "li", "td", "th", "tr", "h1", "h2", "h3", "h4", "h5",
                        "h6", "h", "pre", "table", "ul", "ol", "dt", "dd"])
SCHEMA_VERSION = 1


def lang_info(lang: str) -> tuple[str, str]:
    """Debian package name and help directory name for a language code ('en' -> en-US)."""
    if lang.lower() in ("en", "en-us"):
        return "libreoffice-help-en-us", "en-US"
    return "libreoffice-help-" + lang.lower(), lang


# --------------------------------------------------------------------------------------------
# HTML extraction
# --------------------------------------------------------------------------------------------
class _ParagraphParser(HTMLParser):
    """Collects the visible text of every element whose id matches PARA_ID_RE.

    A "region" is an element we are inside of and care about: a paragraph being collected, a
    hidden/embedded/invisible block being skipped. A region ends when the number of open elements
    with its tag name drops back to zero, which is robust to the odd unclosed inline tag.
    """

    def __init__(self, skip_embedded: bool = True):
        super().__init__(convert_charrefs=True)
        self.skip_embedded = skip_embedded
        self.items: list[tuple[str, str]] = []  # (id, text) in document order
        self._collect: list[list] = []  # stack of [tag, depth, id, parts]
        self._skip: list[list] = []  # stack of [tag, depth]

    # depth bookkeeping -------------------------------------------------------------------
    def _open(self, tag):
        for region in self._collect:
            if region[0] == tag:
                region[1] += 1
        for region in self._skip:
            if region[0] == tag:
                region[1] += 1

    def _close(self, tag):
        for region in self._skip:
            if region[0] == tag:
                region[1] -= 1
        while self._skip and self._skip[-1][1] <= 0:
            self._skip.pop()
        for region in self._collect:
            if region[0] == tag:
                region[1] -= 1
        while self._collect and self._collect[-1][1] <= 0:
            _, _, pid, parts = self._collect.pop()
            self.items.append((pid, normalize_space("".join(parts))))

    def _add_text(self, text):
        if self._skip:
            return
        for region in self._collect:
            region[3].append(text)

    # HTMLParser hooks --------------------------------------------------------------------
    def handle_starttag(self, tag, attrs):
        if tag in VOID_TAGS:
            if tag in BREAK_TAGS:
                self._add_text(" ")
            return
        self._open(tag)
        attrs = dict(attrs)
        ident = attrs.get("id") or ""
        classes = (attrs.get("class") or "").split()
        if tag in BREAK_TAGS:
            self._add_text(" ")
        if (
            tag in INVISIBLE_TAGS
            or ("hidden" in attrs and not ident.startswith("default"))
            or (self.skip_embedded and "embedded" in classes)
        ):
            self._skip.append([tag, 1])
        elif not self._skip and PARA_ID_RE.match(ident):
            self._collect.append([tag, 1, ident, []])

    def handle_startendtag(self, tag, attrs):  # <br/>, <img/>: contribute no text
        if tag in BREAK_TAGS:
            self._add_text(" ")

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if tag in BREAK_TAGS:
            self._add_text(" ")
        self._close(tag)

    def handle_data(self, data):
        self._add_text(data)

    def close(self):
        super().close()
        while self._collect:  # unclosed at end of document
            _, _, pid, parts = self._collect.pop()
            self.items.append((pid, normalize_space("".join(parts))))


def normalize_space(text: str) -> str:
    """Collapse all whitespace (incl. NBSP and other Unicode spaces) to single spaces."""
    return " ".join(text.split())


def extract_paragraphs(html_text: str, skip_embedded: bool = True) -> dict[str, str]:
    """Visible text of every ``par_id``/``hd_id``/``bm_id`` element of one help page.

    Returns {key: text} in document order. The key is the id for its first occurrence and
    ``"{id}#{k}"`` for the k-th occurrence (k >= 2) of an id repeated within the page.
    Nested id'd elements each get their full text.
    """
    parser = _ParagraphParser(skip_embedded=skip_embedded)
    parser.feed(html_text)
    parser.close()
    # Elements are recorded when they close (an inner id'd element before its outer one); both
    # language versions are numbered in the same order, which is all alignment needs.
    out: dict[str, str] = {}
    seen: Counter = Counter()
    for pid, text in parser.items:
        seen[pid] += 1
        key = pid if seen[pid] == 1 else f"{pid}#{seen[pid]}"
        out[key] = text
    return out


def _base_id(key: str) -> str:
    return key.split("#", 1)[0]


def _html_files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)).replace(os.sep, "/")
        for p in root.rglob("*")
        if p.suffix.lower() in (".html", ".htm", ".xhtml") and p.is_file()
    )


def align_dirs(de_root, en_root, skip_embedded: bool = True, stats: dict | None = None):
    """Align two help trees by (relative file path, paragraph id).

    ``de_root``/``en_root`` are any two language directories (e.g. ``.../help/de/text`` and
    ``.../help/en-US/text``); the result is ``[(relpath, key, text_a, text_b)]`` in sorted file
    order and document order, for keys present in both. Ids whose occurrence count differs
    between the two versions of a page are dropped entirely. No filtering is done here.
    ``stats`` (optional dict) receives diagnostic counters.
    """
    de_root, en_root = Path(de_root), Path(en_root)
    de_files = set(_html_files(de_root))
    en_files = set(_html_files(en_root))
    common = sorted(de_files & en_files)
    counters = Counter(
        files_a_only=len(de_files - en_files),
        files_b_only=len(en_files - de_files),
        files_common=len(common),
    )
    pairs = []
    for rel in progress(common, desc="align help files", unit="file"):
        a = extract_paragraphs((de_root / rel).read_text(encoding="utf-8", errors="replace"),
                               skip_embedded)
        b = extract_paragraphs((en_root / rel).read_text(encoding="utf-8", errors="replace"),
                               skip_embedded)
        count_a = Counter(_base_id(k) for k in a)
        count_b = Counter(_base_id(k) for k in b)
        for base, n in count_a.items():
            if n > 1:
                counters["repeated_ids"] += 1
                if count_b.get(base, n) != n:
                    counters["repeated_ids_count_mismatch"] += 1
        for key, text_a in a.items():
            base = _base_id(key)
            if key not in b:
                counters["unmatched_a"] += 1
                continue
            if count_a[base] != count_b[base]:
                counters["dropped_occurrence_mismatch"] += 1
                continue
            pairs.append((rel, key, text_a, b[key]))
        counters["unmatched_b"] += sum(1 for k in b if k not in a)
    if stats is not None:
        stats.update(counters)
    return pairs


def filter_pairs(pairs, min_words=3, max_words=50, stats: dict | None = None):
    """Drop empty, too short/long (either side), untranslated and exact-duplicate pairs."""
    out, seen = [], set()
    c = Counter()
    for rel, key, a, b in pairs:
        if not a or not b:
            c["empty"] += 1
            continue
        na, nb = len(a.split()), len(b.split())
        if min(na, nb) < min_words or max(na, nb) > max_words:
            c["length"] += 1
            continue
        if a == b:
            c["untranslated"] += 1
            continue
        if (a, b) in seen:
            c["duplicate"] += 1
            continue
        seen.add((a, b))
        out.append((rel, key, a, b))
    if stats is not None:
        stats.update({f"dropped_{k}": v for k, v in c.items()})
    return out


# --------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------
def _file_hash(rel: str, seed) -> str:
    return hashlib.sha1(f"{seed}\0{rel}".encode("utf-8")).hexdigest()


def split_by_file(pairs, valid_frac=0.03, test_frac=0.03, seed=1, min_heldout=1000):
    """Deterministic split by help file: returns ``(train, valid, test)`` lists of pairs.

    Files are ordered by SHA-1(seed, relpath) and dealt alternately to test and valid until each
    holds at least ``max(frac * N, min(min_heldout, N / 10))`` pairs (N = all pairs; a fraction of 0
    gives an empty split); all remaining files go to train. A file never contributes to two
    splits, and the result depends only on the pairs, not on their order.
    """
    by_file: dict[str, list] = defaultdict(list)
    for p in pairs:
        by_file[p[0]].append(p)
    n = len(pairs)

    def target(frac):
        return 0 if frac <= 0 else max(frac * n, min(min_heldout, n / 10))

    t_valid, t_test = target(valid_frac), target(test_frac)
    train, valid, test = [], [], []
    for rel in sorted(by_file, key=lambda r: (_file_hash(r, seed), r)):
        items = by_file[rel]
        want_test = len(test) < t_test
        want_valid = len(valid) < t_valid
        if want_test and (not want_valid or len(test) <= len(valid)):
            test.extend(items)
        elif want_valid:
            valid.extend(items)
        else:
            train.extend(items)
    # keep a stable (file, document) order inside each split
    order = {id(p): i for i, p in enumerate(pairs)}
    return tuple(sorted(s, key=lambda p: order[id(p)]) for s in (train, valid, test))


def remove_overlap(train, valid, test, stats: dict | None = None):
    """Drop held-out pairs whose source sentence is in train (valid/test) or in valid (test)."""
    train_src = {p[2] for p in train}
    valid2 = [p for p in valid if p[2] not in train_src]
    seen = train_src | {p[2] for p in valid2}
    test2 = [p for p in test if p[2] not in seen]
    if stats is not None:
        stats["dropped_overlap_valid"] = len(valid) - len(valid2)
        stats["dropped_overlap_test"] = len(test) - len(test2)
    return train, valid2, test2


# --------------------------------------------------------------------------------------------
# Getting the packages
# --------------------------------------------------------------------------------------------
def _text_dir(root: Path, help_dir: str) -> Path:
    return root / HELP_SUBDIR / help_dir / "text"


def _find_tree(base: Path, package: str, help_dir: str) -> Path | None:
    """An extracted help tree for ``help_dir`` under base/package/ or base/ itself."""
    for root in (base / package, base):
        if _text_dir(root, help_dir).is_dir():
            return _text_dir(root, help_dir)
    return None


def _find_deb(base: Path, package: str) -> Path | None:
    debs = sorted(glob.glob(str(base / f"{package}_*.deb")))
    return Path(debs[-1]) if debs else None


def _extract(deb: Path, dest: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        raise PrepError(
            f"dpkg-deb not found: install dpkg (apt-get install dpkg) or pass --debs DIR with the "
            f"extracted trees (DIR/{deb.name.split('_')[0]}/{HELP_SUBDIR}/...)"
        )
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    r = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        raise PrepError(f"dpkg-deb -x {deb} failed: {r.stderr.strip().splitlines()[-1:]}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _expected_paths(base: Path, langs) -> str:
    parts = []
    for lang in langs:
        pkg, hd = lang_info(lang)
        parts.append(f"{base}/{pkg}_*.deb or {base}/{pkg}/{HELP_SUBDIR}/{hd}/text/")
    return "; ".join(parts)


def get_help_tree(lang: str, cache: Path, debs: Path | None, all_langs=None) -> Path:
    """Path of ``.../help/<lang dir>/text`` for ``lang``; downloads/extracts as needed.

    ``all_langs`` only widens the list of expected paths printed in error messages.
    """
    package, help_dir = lang_info(lang)
    langs = list(all_langs or [lang])
    if debs is not None:
        tree = _find_tree(debs, package, help_dir)
        if tree is not None:
            return tree
        deb = _find_deb(debs, package)
        if deb is None:
            raise PrepError(
                f"--debs {debs}: neither {package}_*.deb nor an extracted tree found "
                f"(expected {_expected_paths(debs, langs)})"
            )
        _extract(deb, cache / package)
        return _text_dir(cache / package, help_dir)

    tree = _find_tree(cache, package, help_dir)
    if tree is not None:
        return tree
    deb = _find_deb(cache, package)
    if deb is None:
        missing = [t for t in ("apt-get", "dpkg-deb") if shutil.which(t) is None]
        if missing:
            raise PrepError(
                f"{' and '.join(missing)} not found (this needs a Debian/Ubuntu system): install "
                f"apt/dpkg, or download {package} yourself and pass --debs DIR "
                f"(expected {_expected_paths(Path('DIR'), langs)})"
            )
        cache.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True,
                           text=True)
        deb = _find_deb(cache, package)
        if r.returncode != 0 or deb is None:
            why = (r.stderr.strip().splitlines() or ["no .deb file appeared"])[-1]
            raise PrepError(
                f"'apt-get download {package}' failed ({why}); run 'sudo apt-get update' and retry, "
                f"or pass --debs DIR (expected {_expected_paths(Path('DIR'), langs)})"
            )
    print(f"extracting {deb.name}", flush=True)
    _extract(deb, cache / package)
    return _text_dir(cache / package, help_dir)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Prepare a German<->English MT corpus (raw text, SentencePiece, fairseq "
        "binaries) from the Debian LibreOffice help packages.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="data/libreoffice", help="output directory")
    p.add_argument("--cache", default="data/cache",
                   help="where downloaded .deb files are kept and extracted")
    p.add_argument("--debs", default=None, metavar="DIR",
                   help="use .deb files (NAME_*.deb) or extracted trees (DIR/NAME/usr/share/... or "
                   "DIR/usr/share/...) from DIR instead of running apt-get download")
    p.add_argument("--src", default="de", help="source language (de or en)")
    p.add_argument("--tgt", default="en", help="target language (en or de)")
    p.add_argument("--vocab-size", type=int, default=3000,
                   help="size of the joint SentencePiece vocabulary")
    p.add_argument("--spm-type", default="unigram", choices=["unigram", "bpe"],
                   help="SentencePiece model type")
    p.add_argument("--min-words", type=int, default=3,
                   help="drop pairs with fewer words on either side")
    p.add_argument("--max-words", type=int, default=50,
                   help="drop pairs with more words on either side")
    p.add_argument("--valid-frac", type=float, default=0.03,
                   help="fraction of pairs (by whole files) for valid")
    p.add_argument("--test-frac", type=float, default=0.03,
                   help="fraction of pairs (by whole files) for test")
    p.add_argument("--min-heldout", type=int, default=1000,
                   help="valid and test each get at least this many pairs (before overlap "
                   "removal; capped at 10%% of the corpus)")
    p.add_argument("--seed", type=int, default=1, help="salt of the file hash and SentencePiece seed")
    p.add_argument("--keep-embedded", action="store_true",
                   help="also keep paragraphs inside <div class=embedded> (copies of other pages)")
    p.add_argument("--max-train", type=int, default=None, metavar="N",
                   help="keep only the first N training pairs (tiny test corpora)")
    p.add_argument("--skip-binarize", action="store_true",
                   help="stop after the SentencePiece files; do not run fairseq-preprocess")
    p.add_argument("--workers", type=int, default=1,
                   help="threads for SentencePiece and workers for fairseq-preprocess")
    p.add_argument("--force", action="store_true", help="rebuild even if outputs are cached")
    add_progress_flag(p)
    return p


def _settings(args) -> dict:
    return {
        "schema": SCHEMA_VERSION, "src": args.src, "tgt": args.tgt, "vocab_size": args.vocab_size,
        "spm_type": args.spm_type, "min_words": args.min_words, "max_words": args.max_words,
        "valid_frac": args.valid_frac, "test_frac": args.test_frac,
        "min_heldout": args.min_heldout, "seed": args.seed, "keep_embedded": args.keep_embedded,
        "max_train": args.max_train,
    }


def _is_cached(out: Path, args) -> bool:
    needed = [out / "spm.model"] + [out / "spm" / f"{s}.{l}" for s in SPLITS
                                    for l in (args.src, args.tgt)]
    return is_cached(out, _settings(args), needed,
                     None if args.skip_binarize else [out / "bin" / f"dict.{args.tgt}.txt"])


def prepare(args) -> dict:
    t0 = time.time()
    out, cache = Path(args.out), Path(args.cache)
    debs = Path(args.debs) if args.debs else None
    if args.src == args.tgt:
        raise PrepError("--src and --tgt must differ")
    timings = {}

    langs = [args.src, args.tgt]
    src_root = get_help_tree(args.src, cache, debs, langs)
    tgt_root = get_help_tree(args.tgt, cache, debs, langs)
    timings["get_packages"] = round(time.time() - t0, 2)

    t = time.time()
    diag: dict = {}
    pairs = align_dirs(src_root, tgt_root, skip_embedded=not args.keep_embedded, stats=diag)
    diag["aligned"] = len(pairs)
    pairs = filter_pairs(pairs, args.min_words, args.max_words, stats=diag)
    diag["kept"] = len(pairs)
    if not pairs:
        raise PrepError(f"no aligned pairs found under {src_root} and {tgt_root}")
    train, valid, test = split_by_file(pairs, args.valid_frac, args.test_frac, args.seed,
                                       args.min_heldout)
    train, valid, test = remove_overlap(train, valid, test, stats=diag)
    if args.max_train is not None:
        train = train[: args.max_train]
    splits = {"train": train, "valid": valid, "test": test}
    timings["extract_align_split"] = round(time.time() - t, 2)

    t = time.time()
    raw_dir, spm_dir = out / "raw", out / "spm"
    raw_dir.mkdir(parents=True, exist_ok=True)
    spm_dir.mkdir(parents=True, exist_ok=True)
    for name, items in splits.items():
        write_lines(raw_dir / f"{name}.{args.src}", (p[2] for p in items))
        write_lines(raw_dir / f"{name}.{args.tgt}", (p[3] for p in items))
        with open(raw_dir / f"{name}.ids", "w", encoding="utf-8") as f:
            for p in items:
                f.write(f"{p[0]}\t{p[1]}\n")

    sp = train_spm([raw_dir / f"train.{args.src}", raw_dir / f"train.{args.tgt}"],
                   out / "spm", args.vocab_size, args.spm_type, args.seed, args.workers)
    for name in SPLITS:
        for lang in (args.src, args.tgt):
            encode_file(sp, raw_dir / f"{name}.{lang}", spm_dir / f"{name}.{lang}", args.workers)
    timings["sentencepiece"] = round(time.time() - t, 2)

    stats = {
        "settings": _settings(args),
        "pairs": {k: len(v) for k, v in splits.items()},
        "files": {k: len({p[0] for p in v}) for k, v in splits.items()},
        "files_total": diag.get("files_common", 0),
        "spm_vocab_size": sp.get_piece_size(),
        "diagnostics": diag,
        "sources": {args.src: str(src_root), args.tgt: str(tgt_root)},
        "binarized": False,
    }
    if not args.skip_binarize:
        binarize(stats, timings, out / "bin" / f"dict.{args.tgt}.txt", out / "bin",
                 [spm_dir / s for s in SPLITS], args.workers,
                 lead=["--source-lang", args.src, "--target-lang", args.tgt],
                 joined_dictionary=True)
    write_stats(out, stats, timings, t0, size_dirs=("raw", "spm", "bin"))
    return stats


def _summary(stats: dict, out: Path) -> str:
    p, f = stats["pairs"], stats["files"]
    return ("pairs " + ", ".join(f"{k} {p[k]} ({f[k]} files)" for k in SPLITS)
            + f"; spm vocab {stats['spm_vocab_size']}; {stats['timings_s']['total']} s -> {out}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    configure_progress(args)
    out = Path(args.out)
    return run_main(out, not args.force and _is_cached(out, args), lambda: prepare(args),
                    lambda stats: _summary(stats, out))


if __name__ == "__main__":
    sys.exit(main())

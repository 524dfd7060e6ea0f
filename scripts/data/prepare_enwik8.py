#!/usr/bin/env python3
"""Prepare byte-level language-modelling data in the standard enwik8 format.

Sources (exactly one)
    --zip enwik8.zip      the Hutter-prize file (member ``enwik8``, 100,000,000 bytes).
                          With --download, it is fetched from http://mattmahoney.net/dc/enwik8.zip
                          first when the path does not exist (needs the internet).
    --gensim              offline stand-in: ``pip download --no-deps gensim==4.4.0`` (cached in
                          --cache) and read only the member
                          gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2
                          from the wheel: ~6.1 MB of real Wikipedia XML (206 articles, CC BY-SA), the
                          same kind of text as enwik8. gensim itself is never installed.
    --xml FILE            a local copy of such an XML dump (plain or .bz2).

Split
    The standard rule: the last 5,000,000 bytes are test, the 5,000,000 before them valid, the
    rest (90,000,000) train. For other inputs the same code uses the proportional 90/5/5 split
    (``split_bytes``): n_test = round(0.05 n), n_valid = round(0.05 n), train gets the rest, in the
    original byte order (train first). --max-bytes N keeps only the first N bytes before splitting.

Text format (``OUT/{train,valid,test}.txt``; the exact bytes are also kept as ``*.txt.raw``)
    One token per byte: the byte's decimal value (0-255), tokens separated by single spaces.
    The newline byte (10) is NOT written as a token: it ends the line, exactly like the standard
    ``prep_enwik8.py`` of Transformer-XL / adaptive-span / awd-lstm (which writes
    ``' '.join(str(c) if c != ord('\\n') else '\\n' for c in data)``; our lines just carry no stray
    leading/trailing spaces, which tokenises identically). fairseq appends ``</s>`` to every line,
    so ``</s>`` plays the role of the newline byte and the token count equals the byte count
    (+1 if the data does not end with a newline) -- loss per token in bits is bits per byte/char.
    ``--newline-token`` additionally writes ``10`` as the last token of every newline-terminated
    line (non-standard: the newline is then counted twice, once as ``10`` and once as ``</s>``).
    Round trip: ``b"\\n".join(bytes(map(int, line.split())) for line in lines) == data``.

Binarised (unless --skip-binarize)
    ``python -m fairseq_cli.preprocess --only-source --trainpref OUT/train.txt --validpref
    OUT/valid.txt --testpref OUT/test.txt --destdir OUT/bin --workers N`` (same interpreter), giving
    ``OUT/bin/dict.txt`` and ``OUT/bin/{train,valid,test}.{bin,idx}`` for ``--task language_modeling``
    or ``truncated_bptt_lm``. ``OUT/stats.json`` records sizes and settings; a rerun with the same
    settings prints "cached" and exits 0 (--force rebuilds).
"""
from __future__ import annotations

import argparse
import bz2
import glob
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from scripts.data.preplib import (
    PrepError, add_progress_flag, binarize, configure_progress, fail, fetch_url, is_cached,
    progress, run_main, write_stats,
)

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
GENSIM_SPEC = "gensim==4.4.0"
GENSIM_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
SPLITS = ("train", "valid", "test")
SCHEMA_VERSION = 1
_TOK = [str(i) for i in range(256)]


# --------------------------------------------------------------------------------------------
# Core functions (importable)
# --------------------------------------------------------------------------------------------
def split_bytes(data: bytes, fractions=(0.9, 0.05, 0.05)):
    """Split ``data`` into contiguous (train, valid, test) parts in this order.

    valid and test get ``round(frac * len(data))`` bytes each, train the rest; for the 10^8 bytes
    of enwik8 that is exactly 90M/5M/5M, i.e. the standard split.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1: {fractions}")
    n = len(data)
    n_valid = int(round(n * fractions[1]))
    n_test = int(round(n * fractions[2]))
    n_train = n - n_valid - n_test
    return data[:n_train], data[n_train:n_train + n_valid], data[n_train + n_valid:]


def iter_lines(data: bytes, newline_token: bool = False):
    """Yield the text lines (without line break) of ``data`` in the enwik8 format (see module doc)."""
    segments = data.split(b"\n")
    last = len(segments) - 1
    for i, seg in enumerate(segments):
        line = " ".join(map(_TOK.__getitem__, seg))
        if newline_token and i < last:
            line = f"{line} 10" if line else "10"
        yield line


def bytes_to_lines(data: bytes, newline_token: bool = False) -> list[str]:
    """One string per original line: its bytes as space-separated decimal values.

    There are ``data.count(b"\\n") + 1`` lines (the last one is empty when ``data`` ends with a
    newline); ``b"\\n".join(bytes(map(int, l.split())) for l in lines)`` gives ``data`` back. With
    ``newline_token=True`` every line but the last also ends with the token ``10`` and
    ``b"".join(...)`` gives ``data`` back.
    """
    return list(iter_lines(data, newline_token))


def write_split(path: Path, data: bytes, newline_token: bool = False) -> int:
    """Write the enwik8 text format of ``data`` to ``path`` (+ ``path.raw``).

    Returns the number of lines as fairseq reads them (= sentences, each gets one ``</s>``).
    """
    n_lines = data.count(b"\n") + 1
    with open(path, "w", encoding="ascii", newline="\n") as f:
        lines = progress(iter_lines(data, newline_token), total=n_lines, desc=f"write {path.name}",
                         unit="line")
        for i, line in enumerate(lines):
            if i:
                f.write("\n")
            f.write(line)
    Path(str(path) + ".raw").write_bytes(data)
    return data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def read_enwik8_zip(path: Path, download: bool) -> bytes:
    if not path.exists():
        if not download:
            raise PrepError(f"{path} not found: pass --zip PATH to enwik8.zip, add --download to "
                            f"fetch {ENWIK8_URL}, or use --gensim / --xml FILE for the offline stand-in")
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"downloading {ENWIK8_URL} -> {path}", flush=True)
        fetch_url(ENWIK8_URL, path, "fetch it by hand and pass --zip PATH, or use --gensim / "
                  "--xml FILE")
    try:
        with zipfile.ZipFile(path) as z:
            return z.read("enwik8")
    except (zipfile.BadZipFile, KeyError) as e:
        raise PrepError(f"{path} is not enwik8.zip with a member 'enwik8' ({e})") from None


def gensim_wheel(cache: Path) -> Path:
    """The cached gensim wheel, downloading it with pip if needed."""
    name, version = GENSIM_SPEC.split("==")
    pattern = str(cache / f"{name}-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", GENSIM_SPEC, "-d", str(cache)]
        print("+ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(glob.glob(pattern))
        if r.returncode != 0 or not found:
            why = (r.stderr.strip().splitlines() or ["no wheel appeared"])[-1]
            raise PrepError(f"'pip download {GENSIM_SPEC}' failed ({why}); pass --xml FILE with a "
                            f"local copy of {GENSIM_MEMBER.rsplit('/', 1)[-1]} (or its unpacked "
                            f"XML), or --zip enwik8.zip")
    return Path(found[-1])


def read_gensim(cache: Path) -> tuple[bytes, Path]:
    wheel = gensim_wheel(cache)
    try:
        with zipfile.ZipFile(wheel) as z:
            packed = z.read(GENSIM_MEMBER)
    except (zipfile.BadZipFile, KeyError) as e:
        raise PrepError(f"{wheel}: cannot read {GENSIM_MEMBER} ({e}); delete the file and retry, or "
                        f"pass --xml FILE") from None
    return bz2.decompress(packed), wheel


def read_xml(path: Path) -> bytes:
    if not path.exists():
        raise PrepError(f"{path} not found")
    data = path.read_bytes()
    return bz2.decompress(data) if data[:3] == b"BZh" else data


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Prepare enwik8-format byte-level LM data (text + fairseq binaries).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--zip", default=None, metavar="PATH",
                     help="enwik8.zip (default with --download: CACHE/enwik8.zip)")
    src.add_argument("--gensim", action="store_true",
                     help=f"offline stand-in: Wikipedia XML from the {GENSIM_SPEC} wheel's test data")
    src.add_argument("--xml", default=None, metavar="FILE",
                     help="a local Wikipedia XML dump (plain or .bz2), e.g. the gensim test file")
    p.add_argument("--download", action="store_true",
                   help=f"fetch {ENWIK8_URL} to the --zip path if it is missing (needs internet)")
    p.add_argument("--out", default=None,
                   help="output directory (default data/enwik8, or data/wiki-gensim for "
                   "--gensim/--xml)")
    p.add_argument("--cache", default="data/cache", help="where downloads (wheel, zip) are kept")
    p.add_argument("--max-bytes", type=int, default=None, metavar="N",
                   help="use only the first N bytes (tiny test corpora)")
    p.add_argument("--newline-token", action="store_true",
                   help="also write the newline byte as token 10 at the end of each line "
                   "(non-standard; see module docstring)")
    p.add_argument("--skip-binarize", action="store_true",
                   help="only write the text files; do not run fairseq-preprocess")
    p.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    p.add_argument("--force", action="store_true", help="rebuild even if outputs are cached")
    add_progress_flag(p)
    return p


def _source(args) -> tuple[str, Path | None]:
    cache = Path(args.cache)
    if args.gensim:
        return "gensim", None
    if args.xml:
        return "xml", Path(args.xml)
    if args.zip or args.download:
        return "zip", Path(args.zip) if args.zip else cache / "enwik8.zip"
    raise PrepError("choose a source: --zip enwik8.zip [--download], --gensim, or --xml FILE")


def _settings(args, kind, path) -> dict:
    ident = GENSIM_SPEC if kind == "gensim" else str(path)
    if path is not None and path.exists():
        ident += f" ({path.stat().st_size} bytes)"
    return {"schema": SCHEMA_VERSION, "source": kind, "source_id": ident,
            "max_bytes": args.max_bytes, "fractions": [0.9, 0.05, 0.05],
            "newline_token": args.newline_token}


def _is_cached(out: Path, settings: dict, skip_binarize: bool) -> bool:
    return is_cached(out, settings, [out / f"{s}.txt" for s in SPLITS],
                     None if skip_binarize else [out / "bin" / "dict.txt"])


def prepare(args, out: Path, kind: str, path: Path | None, settings: dict) -> dict:
    t0 = time.time()
    timings = {}
    if kind == "zip":
        data = read_enwik8_zip(path, args.download)
        if len(data) != ENWIK8_SIZE:
            print(f"warning: enwik8 has {len(data)} bytes, expected {ENWIK8_SIZE}", file=sys.stderr)
        origin = str(path)
    elif kind == "gensim":
        data, wheel = read_gensim(Path(args.cache))
        origin = f"{wheel}:{GENSIM_MEMBER}"
    else:
        data = read_xml(path)
        origin = str(path)
    total = len(data)
    if args.max_bytes is not None:
        data = data[: args.max_bytes]
    timings["read"] = round(time.time() - t0, 2)

    t = time.time()
    out.mkdir(parents=True, exist_ok=True)
    parts = dict(zip(SPLITS, split_bytes(data)))
    lines = {name: write_split(out / f"{name}.txt", part, args.newline_token)
             for name, part in parts.items()}
    timings["write_text"] = round(time.time() - t, 2)

    stats = {
        "settings": settings,
        "origin": origin,
        "source_bytes": total,
        "bytes": {k: len(v) for k, v in parts.items()},
        "lines": lines,
        "distinct_bytes_train": len(set(parts["train"])),
        "binarized": False,
    }
    if not args.skip_binarize:
        binarize(stats, timings, out / "bin" / "dict.txt", out / "bin",
                 [out / f"{s}.txt" for s in SPLITS], args.workers, lead=["--only-source"])
    write_stats(out, stats, timings, t0)
    return stats


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    configure_progress(args)
    try:
        kind, path = _source(args)
    except PrepError as e:
        return fail(e)
    out = Path(args.out or ("data/enwik8" if kind == "zip" else "data/wiki-gensim"))
    settings = _settings(args, kind, path)
    return run_main(
        out, not args.force and _is_cached(out, settings, args.skip_binarize),
        lambda: prepare(args, out, kind, path, settings),
        lambda stats: "bytes " + ", ".join(f"{k} {stats['bytes'][k]}" for k in SPLITS)
        + f"; {stats['timings_s']['total']} s -> {out}")


if __name__ == "__main__":
    sys.exit(main())

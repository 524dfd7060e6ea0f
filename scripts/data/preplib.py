"""Plumbing shared by the data-preparation scripts (prepare_libreoffice.py, prepare_wmt14_en_de.py,
prepare_enwik8.py): one-line errors, the stats.json cache, downloads, SentencePiece, and
``fairseq_cli.preprocess`` run with the same interpreter. The progress bars live in
:mod:`fairseq_attnzoo.cli.progress` (shared with the console commands) and are re-exported here.

Run the scripts as modules from the repository root: ``python -m scripts.data.prepare_enwik8``.
"""
from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fairseq_attnzoo.cli.progress import (  # noqa: F401  (re-exported for the scripts)
    add_progress_flag, configure_progress, progress, progress_enabled, set_progress, ticking)


class PrepError(Exception):
    """A user-facing, one-line error."""


# --------------------------------------------------------------------------------------------
# CLI skeleton and the stats.json cache
# --------------------------------------------------------------------------------------------
def fail(e: PrepError) -> int:
    """Print ``e`` as one line on stderr; the exit code of a failed preparation."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def run_main(out: Path, cached: bool, prepare, summary, redo: str = "rebuild") -> int:
    """The scripts' ``main`` after argument parsing: "cached" and exit 0 when ``cached``; else
    ``stats = prepare()`` (a PrepError becomes one line on stderr and exit 2) and print
    ``summary(stats)``."""
    try:
        if cached:
            print(f"cached: {out} (use --force to {redo})")
            return 0
        stats = prepare()
    except PrepError as e:
        return fail(e)
    print(summary(stats))
    return 0


def is_cached(out: Path, settings: dict, needed, bin_needed=None) -> bool:
    """True when ``out/stats.json`` was written with these ``settings`` and the ``needed`` files
    exist; ``bin_needed`` (None when binarisation is skipped) also requires a binarised run and
    those files."""
    try:
        stats = json.loads((out / "stats.json").read_text())
    except (OSError, ValueError):
        return False
    if stats.get("settings") != settings:
        return False
    needed = list(needed)
    if bin_needed is not None:
        if not stats.get("binarized"):
            return False
        needed += bin_needed
    return all(p.exists() for p in needed)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def write_stats(out: Path, stats: dict, timings: dict, t0: float, size_dirs=()) -> None:
    """Add the total time (and the byte sizes of ``out/<size_dirs>``) and write ``out/stats.json``
    -- the last step, so that only a complete run counts as cached."""
    timings["total"] = round(time.time() - t0, 2)
    stats["timings_s"] = timings
    if size_dirs:
        stats["bytes"] = {d: dir_size(out / d) for d in size_dirs}
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Files and downloads
# --------------------------------------------------------------------------------------------
def write_lines(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


def count_lines(path: Path) -> int:
    """Lines of a text file (a last line without "\\n" counts), read in 1 MiB blocks."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def read_lines(path: Path):
    """Lines without their "\\n". Only "\\n" ends a line (never "\\r", U+2028, ... which
    ``str.splitlines`` and universal newlines would split on and so misalign a parallel corpus)."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line[:-1] if line.endswith("\n") else line


def fetch_url(url: str, dest: Path, hint: str) -> None:
    """Download ``url`` to ``dest`` (through ``dest.part``, removed on failure) with a progress
    bar. Any failure is a PrepError "download of URL failed (why); HINT"."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "fairseq-attnzoo-prepare/1"})
        with urllib.request.urlopen(req, timeout=60) as r, open(tmp, "wb") as f, \
                progress(total=int(r.headers.get("Content-Length") or 0), desc=dest.name,
                         nbytes=True) as bar:
            total = int(r.headers.get("Content-Length") or 0)
            done = 0
            for block in iter(lambda: r.read(1 << 20), b""):
                f.write(block)
                done += len(block)
                bar.update(len(block))
        if total and done != total:
            raise OSError(f"got {done} of {total} bytes")
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError is an OSError
        tmp.unlink(missing_ok=True)
        plain_url_error = isinstance(e, urllib.error.URLError) and not isinstance(
            e, urllib.error.HTTPError)
        why = " ".join(str(e.reason if plain_url_error else e).split()) or type(e).__name__
        raise PrepError(f"download of {url} failed ({why}); {hint}") from None
    tmp.rename(dest)


# --------------------------------------------------------------------------------------------
# SentencePiece and fairseq
# --------------------------------------------------------------------------------------------
def train_spm(files, prefix: Path, vocab_size: int, model_type: str, seed: int, threads: int,
              character_coverage: float = 1.0, input_sentence_size: int = 2_000_000,
              shuffle_input_sentence: bool = False, hard_vocab_limit: bool = True):
    """Train a SentencePiece model ``prefix.model``/``prefix.vocab`` on ``files``; returns its
    processor. The defaults (every character, at most 2M lines, no shuffling) mean no sampling on
    a small corpus: deterministic. With more than ``input_sentence_size`` lines and
    ``shuffle_input_sentence``, a seeded random sample is used. ``hard_vocab_limit=False``: at
    most ``vocab_size`` pieces, fewer where the text has no more (instead of an error)."""
    import sentencepiece as spm

    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(seed)
    with ticking(f"SentencePiece {model_type} {vocab_size}"):
        _train_spm(spm, files, prefix, vocab_size, model_type, threads, character_coverage,
                   input_sentence_size, shuffle_input_sentence, hard_vocab_limit)
    return spm.SentencePieceProcessor(model_file=str(prefix) + ".model")


def _train_spm(spm, files, prefix, vocab_size, model_type, threads, character_coverage,
               input_sentence_size, shuffle_input_sentence, hard_vocab_limit=True):
    spm.SentencePieceTrainer.train(
        input=",".join(str(f) for f in files),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=shuffle_input_sentence,
        num_threads=threads,
        hard_vocab_limit=hard_vocab_limit,
        minloglevel=2,
    )


def encode_file(sp, src: Path, dest: Path, threads: int, normalize=None,
                chunk: int = 100_000) -> int:
    """SentencePiece-encode ``src`` line by line (same line count; each line first passed through
    ``normalize`` if given) into ``dest`` as space-separated pieces. Returns the line count."""
    n = 0
    with open(dest, "w", encoding="utf-8", newline="\n") as f, \
            progress(total=count_lines(src) if progress_enabled() else None,
                     desc=f"encode {src.name}", unit="line") as bar:
        batch = []
        for line in read_lines(src):
            batch.append(normalize(line) if normalize else line)
            if len(batch) == chunk:
                n += _write_encoded(sp, batch, f, threads)
                bar.update(len(batch))
                batch = []
        n += _write_encoded(sp, batch, f, threads)
        bar.update(len(batch))
    return n


def _write_encoded(sp, lines, f, threads) -> int:
    if not lines:
        return 0
    for pieces in sp.encode(lines, out_type=str, num_threads=threads):
        f.write(" ".join(pieces) + "\n")
    return len(lines)


def run_preprocess(bin_dir: Path, prefixes, workers: int, lead=(),
                   joined_dictionary: bool = False) -> None:
    """``python -m fairseq_cli.preprocess LEAD --trainpref/--validpref/--testpref PREFIXES
    --destdir BIN_DIR [--joined-dictionary] --workers N`` with this interpreter, into a fresh
    ``bin_dir``; a failure shows fairseq's output tail and raises a PrepError."""
    shutil.rmtree(bin_dir, ignore_errors=True)
    train, valid, test = prefixes
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", *lead,
           "--trainpref", str(train), "--validpref", str(valid), "--testpref", str(test),
           "--destdir", str(bin_dir)]
    if joined_dictionary:
        cmd.append("--joined-dictionary")
    cmd += ["--workers", str(workers)]
    print("+ " + " ".join(cmd), flush=True)
    # fairseq-preprocess reports nothing while it works: show the bytes it has written
    with ticking("binarize", poll=lambda: dir_size(bin_dir), nbytes=True):
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise PrepError(f"fairseq-preprocess failed (exit {r.returncode}); is fairseq installed "
                        f"in {sys.executable}?")


def binarize(stats: dict, timings: dict, dict_file: Path, *args, **kwargs) -> None:
    """``run_preprocess(*args, **kwargs)``, timed as ``timings["binarize"]``; records the fairseq
    dictionary size (``dict_file`` + the 4 special symbols) and ``binarized`` in ``stats``."""
    t = time.time()
    run_preprocess(*args, **kwargs)
    timings["binarize"] = round(time.time() - t, 2)
    with open(dict_file, encoding="utf-8") as f:
        stats["fairseq_dict_size"] = sum(1 for _ in f) + 4  # + <s> <pad> </s> <unk>
    stats["binarized"] = True

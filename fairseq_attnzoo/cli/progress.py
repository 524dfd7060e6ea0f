"""Progress bars of every command and script: tqdm on stderr, shown only when stderr is a terminal
(``--no-progress`` switches them off)."""

import argparse
import contextlib
import sys
import threading

_SHOW_PROGRESS = None  # None: only when stderr is a terminal; set_progress() overrides


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-progress``: the one switch of every script's progress bars."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they are shown only when stderr is a terminal)")


def set_progress(enabled) -> None:
    """True/False force the bars on/off; None: on only when stderr is a terminal."""
    global _SHOW_PROGRESS
    _SHOW_PROGRESS = enabled


def configure_progress(args: argparse.Namespace) -> None:
    """Apply ``--no-progress`` (see :func:`add_progress_flag`)."""
    set_progress(False if getattr(args, "no_progress", False) else None)


def progress_enabled() -> bool:
    if _SHOW_PROGRESS is not None:
        return bool(_SHOW_PROGRESS)
    return sys.stderr.isatty()


def progress(iterable=None, total=None, desc: str = "", unit: str = "it", nbytes: bool = False,
             **kwargs):
    """A tqdm bar on stderr (count, total, rate, ETA), or a silent pass-through when progress is
    off. ``nbytes`` counts bytes (kB/MB/GB units). Use as an iterable wrapper or with
    ``.update(n)``; always ``close()`` it (or use ``with``)."""
    from tqdm import tqdm

    if nbytes:
        kwargs.update(unit="B", unit_scale=True, unit_divisor=1024)
    else:
        kwargs.setdefault("unit", unit)
    return tqdm(iterable, total=total or None, desc=desc, file=sys.stderr, leave=False,
                dynamic_ncols=True, mininterval=0.5, disable=not progress_enabled(), **kwargs)


@contextlib.contextmanager
def ticking(desc: str, poll=None, nbytes: bool = False):
    """A bar refreshed every 0.5 s while the body runs a step that reports nothing itself (a
    subprocess, a C++ trainer): ``poll()`` -> the amount done so far (e.g. bytes written), or
    without ``poll`` just the elapsed time."""
    if not progress_enabled():
        yield
        return
    stop = threading.Event()

    def tick():
        with progress(desc=desc, nbytes=nbytes, bar_format=None if poll else
                      "{desc}: {elapsed}") as bar:
            while not stop.wait(0.5):
                if poll is not None:
                    try:
                        bar.update(poll() - bar.n)
                    except OSError:  # a file vanished while we looked (temporary outputs)
                        pass
                else:
                    bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()

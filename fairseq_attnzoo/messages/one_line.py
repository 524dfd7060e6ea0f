"""The one line a console script ends with (compat entry ``fairseq_cli_hints`` installs the hook
that prints it, ``compat/console.py``) when an uncaught exception is:

- one of our own errors (:class:`~.errors.ZooConfigError`, or a ``ValueError`` raised by a
  ``raise`` statement in this package): its message, nothing else;
- a fairseq/torch error a rule of :mod:`.hints` recognises: the rule's line naming the flag and
  the fix;
- Ctrl-C in ``fairseq-train``: where the same command goes on;
- anything else: None (the usual traceback, unchanged).

``ATTNZOO_TRACEBACK=1`` prints the traceback in every case (the one line still follows it). This
module imports nothing else of ours but this package and the checkpoint readers."""

import linecache
import os
import sys
from typing import Optional

from ..checkpoints import cfg_get, load_stored, loading_checkpoints, stored_update
from .command import argv_value, frame_local, program
from .errors import ZooConfigError
from .hints import hint_for

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_package(filename: str) -> bool:
    path = os.path.abspath(filename or "")
    return path.startswith(PACKAGE_DIR + os.sep)


def _raising_frame(tb):
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def is_user_error(exc: BaseException) -> bool:
    """Our one-line validation errors: a ZooConfigError anywhere, or a ValueError raised by a
    ``raise`` statement of this package (so validation code written before ZooConfigError needs no
    edit; a ValueError from a library call inside our code is not one of them)."""
    if isinstance(exc, ZooConfigError):
        return True
    if not isinstance(exc, ValueError) or type(exc).__module__ != "builtins":
        return False
    tb = _raising_frame(exc.__traceback__)
    if tb is None:
        return False
    filename = tb.tb_frame.f_code.co_filename
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return _in_package(filename) and line.startswith("raise ")


# ---- Ctrl-C --------------------------------------------------------------------------------------

def interrupted_line(exc: BaseException) -> Optional[str]:
    """For Ctrl-C (``KeyboardInterrupt``) in fairseq-train: where the same command resumes (the
    last checkpoint in the save dir and its update), or that nothing was saved; None elsewhere."""
    if program() not in ("fairseq-train", "fairseq-hydra-train"):
        return None
    cfg = cfg_get(frame_local(exc, "main", "cfg"), "checkpoint")
    save_dir = cfg_get(cfg, "save_dir") or argv_value("--save-dir") or "checkpoints"
    restore = cfg_get(cfg, "restore_file") or argv_value("--restore-file") or "checkpoint_last.pt"
    no_save = cfg_get(cfg, "no_save") if cfg is not None else "--no-save" in sys.argv
    last = os.path.join(save_dir, "checkpoint_last.pt")
    if no_save:
        return interrupted_without_saving(last if restore == "checkpoint_last.pt" else restore)
    state = load_stored(last) if os.path.exists(last) else None
    if state is None and os.path.exists(last):  # the interrupt cut its copy short
        good = loading_checkpoints(save_dir, last)
        fix = (f"resume with --restore-file {os.path.join(save_dir, good[0].split()[0])} "
               f"({', '.join(good[:3])} load)" if good else "no checkpoint there loads")
        return f"interrupted while {last} was written, which does not load: {fix}"
    if state is None:
        start = (f"from --restore-file {restore}" if restore != "checkpoint_last.pt"
                 else "at update 0")
        return (f"interrupted before a checkpoint was saved in {save_dir}: the same command "
                f"starts again {start} (--save-interval-updates N saves every N updates)")
    held = f"{last} holds update {stored_update(state)}"
    if restore != "checkpoint_last.pt":  # fairseq loads --restore-file whenever it is given
        return (f"interrupted: {held}; the same command starts again from --restore-file "
                f"{restore}: drop --restore-file to resume from {last}")
    return f"interrupted: {held}; the same command resumes from it"


def interrupted_without_saving(loaded: str) -> str:
    """Ctrl-C in a --no-save run: fairseq still loads ``loaded`` (``SAVE_DIR/checkpoint_last.pt``,
    or ``--restore-file``) when it is there, and goes on from its update; nothing new was saved,
    so the same command starts from that update again."""
    state = load_stored(loaded) if os.path.exists(loaded) else None
    update = stored_update(state)
    if update is None:
        return ("interrupted: nothing was saved (--no-save); the same command starts again at "
                "update 0")
    return (f"interrupted: nothing new was saved (--no-save); this run had loaded update {update} "
            f"from {loaded} and went on from it, so the same command starts again from update "
            f"{update}")


def one_line(exc: BaseException):
    """The line the console hook prints for ``exc`` (without the prefix), or None."""
    if isinstance(exc, KeyboardInterrupt):
        return interrupted_line(exc)
    if not isinstance(exc, Exception):
        return None
    if is_user_error(exc):
        return " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    return hint_for(exc)

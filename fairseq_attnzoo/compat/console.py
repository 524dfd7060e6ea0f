"""How a console script answers a mistake, as the table's rows in :mod:`.fixes` install it: the
excepthook that prints the one line of :mod:`fairseq_attnzoo.messages.one_line` instead of a
traceback (``fairseq_cli_hints``, with ``HYDRA_FULL_ERROR`` for fairseq-hydra-train), the
unraisable error of a half-built dataset passed over (``fairseq_mmap_dataset_del``), a Ctrl-C
raised inside a callback raised again (``python_interrupt_in_callback``), fairseq's
parsers answering in one line (``fairseq_parser_one_line``, ``fairseq_train_parser_one_line``)
and the root logger's level (``fairseq_root_log_level``). What the lines say is
:mod:`fairseq_attnzoo.messages`; here is only where they are hooked in. Each installer changes
something only in a console script, and returns its undo or NOTHING_CHANGED."""

import _thread
import argparse
import inspect
import logging
import os
import sys
from typing import Optional

from ..messages.command import (PREFIX, in_any_console_script, in_console_script, program,
                                traceback_wanted)
from ..messages.one_line import one_line
from ..messages.parser_hints import arch_type, parser_hint
from .machinery import ENV, NOTHING_CHANGED, replace, together


# ---- the excepthook ------------------------------------------------------------------------------

def excepthook_one_line():
    """In a fairseq console script, ``sys.excepthook`` prints :func:`one_line` for the errors it
    knows (the traceback for the others, or for all with ``ATTNZOO_TRACEBACK=1``)."""
    if not in_console_script() or getattr(sys.excepthook, "_attnzoo", False):
        return NOTHING_CHANGED
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        line = one_line(exc)
        if line is None or traceback_wanted():
            previous(exc_type, exc, tb)
        if line is not None:
            print(PREFIX + line, file=sys.stderr)

    hook._attnzoo = True
    sys.excepthook = hook
    return lambda: setattr(sys, "excepthook", previous)


def hydra_full_error(value: Optional[str]) -> Optional[str]:
    """``HYDRA_FULL_ERROR`` beside the hook (``value``: the variable's, None when unset): hydra
    prints errors raised inside fairseq-hydra-train's job itself and exits 1, so no excepthook
    ever sees them; with HYDRA_FULL_ERROR=1 it re-raises them to the hook (read when it happens).
    A value the user set stays."""
    return "1" if value is None and program() == "fairseq-hydra-train" else value


def console_hints():
    """The row ``fairseq_cli_hints``: the one-line excepthook, and HYDRA_FULL_ERROR beside it for
    fairseq-hydra-train (a value the user set stays; undone with the hook)."""
    hook = excepthook_one_line()
    if hook is NOTHING_CHANGED:
        return NOTHING_CHANGED
    return together(hook, replace(ENV + "HYDRA_FULL_ERROR", hydra_full_error))


def unraisable_handled_first(handled):
    """In a console script, ``sys.unraisablehook`` hands each unraisable error to
    ``handled(unraisable)`` first and passes it on to the hook before when that returns False;
    the undo puts that hook back (the rows ``fairseq_mmap_dataset_del`` and
    ``python_interrupt_in_callback``)."""
    if not in_console_script():
        return NOTHING_CHANGED
    previous = sys.unraisablehook

    def hook(unraisable):
        if not handled(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    return lambda: setattr(sys, "unraisablehook", previous)


def ignore_half_built_mmap_dataset():
    """In a console script, ``sys.unraisablehook`` passes over the one error fairseq's
    MMapIndexedDataset raises again in ``__del__`` when its ``np.memmap`` failed (an empty split:
    "Exception ignored in ..." and a traceback after the hint's line); every other one is printed
    as before (row ``fairseq_mmap_dataset_del``)."""
    return unraisable_handled_first(
        lambda unraisable: isinstance(unraisable.exc_value, AttributeError)
        and "_bin_buffer_mmap" in str(unraisable.exc_value))


def interrupt_again_after_callback():
    """In a console script, a Ctrl-C that Python raised inside a callback (a weakref's, a
    ``__del__``, the garbage collector's), where it cannot propagate -- Python printed "Exception
    ignored in ..." and the command went on -- is raised again in the main thread: the command
    stops as on any other Ctrl-C (row ``python_interrupt_in_callback``). Every other unraisable
    error is passed on as before. A new thread calls ``_thread.interrupt_main``: called here, the
    interrupt would be raised at once, inside this hook, and be ignored again; the thread runs
    once the main thread gives up the interpreter (at most Python's switch interval later), and
    should that be inside a callback again, this hook sends it once more."""

    def interrupt_again(unraisable) -> bool:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return False
        _thread.start_new_thread(_thread.interrupt_main, ())
        return True

    return unraisable_handled_first(interrupt_again)


# ---- fairseq's parsers ---------------------------------------------------------------------------

def one_line_parser_errors(parser: argparse.ArgumentParser):
    """In a console script, ``parser.error`` prints ``fairseq-attnzoo: <argparse's message>`` (with
    what :func:`~fairseq_attnzoo.messages.parser_hints.parser_hint` adds) and exits 2, without the
    usage (thousands of flags in fairseq-train); ``--help`` still lists them."""
    if not in_console_script() or getattr(parser.error, "_attnzoo", False):
        return
    error = parser.error

    def one_line_error(message):
        if traceback_wanted():
            error(message)
        hint = parser_hint(message, parser)
        if hint:
            message, more = hint, ""
        else:
            more = "" if "did you mean" in message else f" ({program()} --help lists the flags)"
        print(f"{PREFIX}{message}{more}", file=sys.stderr)
        raise SystemExit(2)

    one_line_error._attnzoo = True
    parser.error = one_line_error


def arch_checked(add_model_args):
    """``fairseq.options.add_model_args`` whose --arch is checked by
    :func:`~fairseq_attnzoo.messages.parser_hints.arch_type` (row
    ``fairseq_train_parser_one_line``)."""

    def add_model_args_checked(parser):
        group = add_model_args(parser)
        for action in group._group_actions:
            if "--arch" in action.option_strings:
                action.type = arch_type
        return group

    return add_model_args_checked


def parsing_in_one_line(add_dataset_args):
    """``fairseq.options.add_dataset_args`` (every command's parser adds it) that makes the parser
    answer in one line (row ``fairseq_parser_one_line``)."""

    def add_dataset_args_one_line(parser, *args, **kwargs):
        one_line_parser_errors(parser)
        return add_dataset_args(parser, *args, **kwargs)

    return add_dataset_args_one_line


# ---- the root logger -----------------------------------------------------------------------------

def debug_root_logger() -> Optional[str]:
    """None when fairseq's wav2vec2_classification module sets the root logger to DEBUG at import
    (``logging.basicConfig(level=logging.DEBUG)``, fairseq-fixed 0.12.3)."""
    try:
        from fairseq.models.wav2vec import wav2vec2_classification as module
    except ImportError as e:
        return f"target not found ({e})"
    if "logging.basicConfig(level=logging.DEBUG)" in inspect.getsource(module):
        return None
    return "fairseq.models.wav2vec.wav2vec2_classification no longer sets the root logger to DEBUG"


def root_log_level():
    """In a console script, ours (``attnzoo-sample``) too, a root logger left at DEBUG goes back to
    ``$LOGLEVEL`` (INFO) (row ``fairseq_root_log_level``)."""
    root = logging.getLogger()
    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    if in_any_console_script() and root.level == logging.DEBUG and wanted != "DEBUG":
        root.setLevel(wanted)
        return lambda: root.setLevel(logging.DEBUG)
    return NOTHING_CHANGED

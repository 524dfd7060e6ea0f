"""What a message knows of the command this process runs: which console script it is, a flag's
value on its command line, whether the user asked for tracebacks, and the frames of the exception
it ends with. This module imports nothing else of ours."""

import os
import sys

#: ``ATTNZOO_TRACEBACK=1``: the console hook prints the traceback before its one line
ENV_TRACEBACK = "ATTNZOO_TRACEBACK"
#: what every one-line message of a console script starts with
PREFIX = "fairseq-attnzoo: "


def program() -> str:
    """The fairseq console script running (``fairseq-train``, ...; ``python -m fairseq_cli.train``
    counts as ``fairseq-train``), else the program's file name."""
    path = sys.argv[0] if sys.argv else ""
    name = os.path.basename(path)
    if os.path.basename(os.path.dirname(path)) == "fairseq_cli" and name.endswith(".py"):
        return "fairseq-" + name[:-3].replace("_", "-")
    return name


def in_console_script() -> bool:
    """Whether this process is one of fairseq's console scripts (``fairseq-*``)."""
    return program().startswith("fairseq-")


def in_any_console_script() -> bool:
    """Whether this process is one of fairseq's console scripts or ours (``attnzoo-*``)."""
    return in_console_script() or program().startswith("attnzoo-")


def traceback_wanted() -> bool:
    return os.environ.get(ENV_TRACEBACK, "").strip().lower() not in ("", "0", "false", "no")


def argv_value(*flags: str):
    """The value of the last of ``flags`` on the command line (``--flag V`` or ``--flag=V``)."""
    argv, value = sys.argv[1:], None
    for i, a in enumerate(argv):
        for flag in flags:
            if a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(flag + "="):
                value = a[len(flag) + 1:]
    return value


def frames(exc: BaseException):
    """The file of each frame of ``exc``'s traceback, outermost first."""
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def frame_local(exc: BaseException, function: str, name: str):
    """The local ``name`` of the innermost frame of ``exc``'s traceback running ``function``."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == function and name in frame.f_locals:
            found = frame.f_locals[name]
        tb = tb.tb_next
    return found

"""What a one-line parser error says besides argparse's message (compat entries
``fairseq_parser_one_line`` and ``fairseq_train_parser_one_line`` install it): the closest arch to
a misspelled ``--arch``, the flag closest to an unknown one, and the task that has the flags an
arch's run was given under another task. This module imports nothing else of ours but this
package."""

import argparse
import difflib
from typing import Optional

from .command import argv_value

UNRECOGNIZED = "unrecognized arguments: "


def zoo_task(arch):
    """The task our arch ``arch`` trains with (its model's ``zoo_task``), or None."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    return getattr(ARCH_MODEL_REGISTRY.get(arch), "zoo_task", None)


# ---- --arch --------------------------------------------------------------------------------------

def arch_suggestions(name: str, n: int = 3):
    """The registered arch names closest to ``name`` (ours and fairseq's), closest first."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    names = list(ARCH_MODEL_REGISTRY)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    if not close:  # e.g. a prefix: "synth_dense" -> transformer_synth_dense
        close = sorted((a for a in names if name and name in a), key=len)[:n]
    return close


def arch_error(name: str) -> str:
    close = arch_suggestions(name)
    hint = f"did you mean {' or '.join(close)}?" if close else "see the arch table in the README"
    return f"unknown arch {name!r}: {hint}"


def arch_type(value: str) -> str:
    """argparse ``type`` of --arch (compat entry ``fairseq_train_parser_one_line``): a known name is
    returned unchanged; an unknown one is an error naming the closest names (argparse checks the
    type before its list of ~200 choices)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    if value in ARCH_MODEL_REGISTRY:
        return value
    raise argparse.ArgumentTypeError(arch_error(value))


# ---- unknown flags -------------------------------------------------------------------------------

def task_hint(message: str, parser=None):
    """For argparse's "unrecognized arguments: ..." in a run of one of our archs under another
    task than the one it trains with: which task has those flags (an adaptive-span arch without
    --task attnzoo_stream_lm does not know --tokens-per-sample). None otherwise."""
    if not message.startswith(UNRECOGNIZED):
        return None
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    arch = argv_value("--arch", "-a")
    wanted = zoo_task(arch)
    task = argv_value("--task") or (parser.get_default("task") if parser else None)
    if not wanted or task == wanted or task is None or wanted not in TASK_DATACLASS_REGISTRY:
        return None
    fields = TASK_DATACLASS_REGISTRY[wanted].__dataclass_fields__
    flags = [a for a in message[len(UNRECOGNIZED):].split() if a.startswith("--")]
    known = [f for f in flags if f[2:].split("=")[0].replace("-", "_") in fields]
    if not known:
        return None
    return (f"{message}: --arch {arch} trains with --task {wanted}, which has "
            f"{', '.join(known)} (this run's task is {task}): add --task {wanted}")


def flag_hint(message: str, parser=None) -> Optional[str]:
    """For argparse's "unrecognized arguments: ...": the parser's flag closest to each unknown
    one (``--pkm-nkeys``: did you mean ``--pkm-n-keys``?), or None when none is close."""
    if not message.startswith(UNRECOGNIZED) or parser is None:
        return None
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in message[len(UNRECOGNIZED):].split():
        flag = word.split("=")[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8) if flag.startswith(
            "--") else []
        if close:
            hints.append((flag, close[0]))
    if not hints:
        return None
    if len(hints) == 1:
        return f"{message}: did you mean {hints[0][1]}?"
    return f"{message}: did you mean {', '.join(f'{c} for {f}' for f, c in hints)}?"


def parser_hint(message: str, parser=None) -> Optional[str]:
    """argparse's ``message`` with what one of the hints above adds, or None."""
    return task_hint(message, parser) or flag_hint(message, parser)

"""Warnings fairseq's commands printed that say nothing to act on, filtered where they arise
(installed by the table's rows in :mod:`.fixes`): torch's ``pin_memory`` without an accelerator
and fairseq's ``torch.cuda.amp.autocast`` (``torch_pin_memory_without_accelerator``,
``fairseq_cuda_amp_autocast``: each by its exact message and the module it is attributed to, in
fairseq's console scripts and ours only), and hydra's deprecation warnings about fairseq's use of
its API (``hydra_deprecation_warnings``: only inside the two calls that cause them)."""

import functools
import inspect
import warnings
from typing import Callable, Optional

from ..messages.command import in_any_console_script
from .machinery import NOTHING_CHANGED

#: torch's DataLoader iterator (torch >= 2.7): fairseq's iterators always pass pin_memory=True
PIN_MEMORY = r"'pin_memory' argument is set as true but no accelerator is found"
#: torch >= 2.4 on fairseq's ``FairseqTask.train_step``: ``torch.cuda.amp.autocast(enabled=...)``
#: is ``torch.amp.autocast("cuda", enabled=...)`` under an old name, the same context
CUDA_AUTOCAST = r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated"
#: what hydra 1.1-1.3 warns about fairseq 0.12's use of its API and config files (UserWarning)
HYDRA_DEPRECATIONS = (
    r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
    r"\s*The version_base parameter is not specified",
    r"In '[^']*': Usage of deprecated keyword in package header",
    r"\s*'[^']*' is validated against ConfigStore schema with the same name",
    r"\s*The strict flag in the compose API is deprecated",
)


# ---- torch's and fairseq's, in the console scripts -----------------------------------------------

def ignoring(message: str, category, module: str) -> Callable[[], object]:
    """A row's apply: in a console script, ignore warnings of ``category`` whose text starts with
    ``message`` (a regex) and that are attributed to ``module`` (a regex on the module's name);
    returns the undo, or NOTHING_CHANGED in any other program."""

    def apply():
        if not in_any_console_script():
            return NOTHING_CHANGED
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        entry = warnings.filters[0]

        def undo():
            if entry in warnings.filters:
                warnings.filters.remove(entry)
                # (what filterwarnings does after a change: the warning registries are reset)
                mutated = getattr(warnings, "_filters_mutated", None)
                if mutated is not None:
                    mutated()

        return undo

    return apply


def torch_warns_pin_memory() -> Optional[str]:
    """None when torch's DataLoader iterator warns about pin_memory without an accelerator (and
    then pins nothing: pinned memory serves only the copy to an accelerator)."""
    try:
        from torch.utils.data import dataloader
    except ImportError as e:  # pragma: no cover
        return f"target not found ({e})"
    if "no accelerator is found" in inspect.getsource(dataloader._BaseDataLoaderIter.__init__):
        return None
    return "torch's DataLoader does not warn about pin_memory without an accelerator"


def fairseq_calls_cuda_autocast() -> Optional[str]:
    """None when fairseq's ``FairseqTask.train_step`` enters ``torch.cuda.amp.autocast`` and
    torch warns that name is deprecated."""
    try:
        import torch
        from fairseq.tasks.fairseq_task import FairseqTask
    except ImportError as e:  # pragma: no cover
        return f"target not found ({e})"
    if "torch.cuda.amp.autocast(" not in inspect.getsource(FairseqTask.train_step):
        return "fairseq's FairseqTask.train_step no longer calls torch.cuda.amp.autocast"
    if "torch.cuda.amp.autocast(args...)` is deprecated" not in inspect.getsource(
            inspect.getmodule(torch.cuda.amp.autocast)):
        return "torch does not deprecate torch.cuda.amp.autocast (torch < 2.4)"
    return None


# ---- hydra's, in fairseq's config loading --------------------------------------------------------

def quiet_hydra_deprecations(fn, finds_caller: bool = False):
    """``fn`` (hydra's initialize or compose, as fairseq calls them) without hydra's deprecation
    warnings about fairseq's use of hydra: about 20 lines on stderr before every command's
    output, none of them actionable by a user. Only those messages, only while ``fn`` runs.
    ``finds_caller``: ``fn`` resolves a relative config path from its caller's file
    (``caller_stack_depth``): this wrapper's frame is skipped."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        if finds_caller:
            kwargs["caller_stack_depth"] = kwargs.get("caller_stack_depth", 1) + 1
        with warnings.catch_warnings():
            for message in HYDRA_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            return fn(*args, **kwargs)

    return quiet


def hydra_in_fairseq() -> Optional[str]:
    """None when fairseq's config loading calls hydra.experimental's initialize and compose."""
    try:
        import hydra.experimental as experimental
        from fairseq.dataclass import utils
    except ImportError as e:
        return f"target not found ({e})"
    if utils.initialize is experimental.initialize and utils.compose is experimental.compose:
        return None
    return ("fairseq.dataclass.utils does not call hydra.experimental's initialize/compose "
            "(another fairseq version)")

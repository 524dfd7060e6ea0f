"""Warnings every fairseq command printed that say nothing to act on (compat entries
``torch_pin_memory_without_accelerator`` and ``fairseq_cuda_amp_autocast``): each is filtered by
its exact message and the module it is attributed to, in fairseq's console scripts and ours only,
and only where it is known to be harmless. This module imports nothing else of ours."""

import inspect
import warnings
from typing import Callable, Optional

from .cli_hints import in_console_script, program

#: torch's DataLoader iterator (torch >= 2.7): fairseq's iterators always pass pin_memory=True
PIN_MEMORY = r"'pin_memory' argument is set as true but no accelerator is found"
#: torch >= 2.4 on fairseq's ``FairseqTask.train_step``: ``torch.cuda.amp.autocast(enabled=...)``
#: is ``torch.amp.autocast("cuda", enabled=...)`` under an old name, the same context
CUDA_AUTOCAST = r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated"


def _ours() -> bool:
    return in_console_script() or program().startswith("attnzoo-")


def ignoring(message: str, category, module: str) -> Callable[[], Optional[Callable[[], None]]]:
    """A compat entry's apply: in a console script, ignore warnings of ``category`` whose text
    starts with ``message`` (a regex) and that are attributed to ``module`` (a regex on the
    module's name); returns the undo (None: nothing installed)."""

    def apply():
        if not _ours():
            return None
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

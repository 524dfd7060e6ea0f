"""Every change this plugin makes to another library (fairseq, torch, numpy), in one table.

Each entry is a named :class:`Patch`: what it changes, why, and a check that the target is the
version it was written for. :func:`apply_all` (called once when the plugin is imported) applies
each entry whose check passes and logs one line per entry: ``applied``, ``skipped`` (the target
is not the version we know, so we leave it alone and say so) or ``disabled``.

Opt out with the environment variable ``ATTNZOO_COMPAT_DISABLE``: a comma-separated list of entry
names, or ``all``. :func:`status` says what happened to each entry; :func:`describe` prints
the table (``python -c "from fairseq_attnzoo import compat; print(compat.describe())"``).
Nothing else in the package patches another library at import time.

For fairseq functions, "the version we know" is the SHA-256 of the function's source (first 16 hex
digits) as shipped by ``fairseq-fixed==0.12.3.1``: a fairseq that changed the function gets no
patch and a warning, rather than a fix written for other code.
"""

import argparse
import hashlib
import inspect
import logging
import os
import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

logger = logging.getLogger(__name__)

ENV_DISABLE = "ATTNZOO_COMPAT_DISABLE"

APPLIED, SKIPPED, DISABLED = "applied", "skipped", "disabled"


@dataclass
class Patch:
    name: str
    target: str  # what is changed, "module:attribute"
    why: str  # one line
    #: None when the target is the version this patch knows; otherwise why it is not applied
    check: Callable[[], Optional[str]]
    apply: Callable[[], None]


PATCHES: List[Patch] = []
_STATUS: Dict[str, str] = {}


def patch(name: str, target: str, why: str, check: Callable[[], Optional[str]]):
    """Decorator: register ``fn`` as the ``apply`` of a table entry."""

    def deco(fn):
        if any(p.name == name for p in PATCHES):
            raise ValueError(f"compat patch {name!r} is defined twice")
        PATCHES.append(Patch(name, target, why, check, fn))
        return fn

    return deco


def source_digest(fn) -> Optional[str]:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def known_source(get: Callable[[], object], *digests: str) -> Callable[[], Optional[str]]:
    """A check that passes when the function returned by ``get()`` has one of these digests."""

    def check():
        try:
            fn = get()
        except (ImportError, AttributeError) as e:
            return f"target not found ({e})"
        digest = source_digest(fn)
        if digest in digests:
            return None
        return (f"{getattr(fn, '__qualname__', fn)} is not the version this patch was written for "
                f"(source digest {digest}, known {', '.join(digests)})")

    return check


def disabled_names() -> set:
    raw = os.environ.get(ENV_DISABLE, "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def apply_all() -> Dict[str, str]:
    """Apply every entry not yet handled in this process; returns :func:`status`."""
    off = disabled_names()
    unknown = sorted(off - {p.name for p in PATCHES} - {"all"})
    if unknown:
        logger.warning(f"{ENV_DISABLE}: no compat patch named {', '.join(unknown)}; the names are "
                       f"{', '.join(p.name for p in PATCHES)} (or all)")
    new = []
    for p in PATCHES:
        if p.name in _STATUS:
            continue
        if "all" in off or p.name in off:
            _STATUS[p.name] = DISABLED
            new.append(f"{p.name} (disabled)")
            continue
        reason = p.check()
        if reason is not None:
            _STATUS[p.name] = SKIPPED
            logger.warning(f"compat: {p.name} not applied: {reason}; {p.target} left unchanged "
                           f"({p.why})")
            continue
        p.apply()
        _STATUS[p.name] = APPLIED
        new.append(p.name)
    if new:  # one line per process
        logger.info(f"compat patches: {', '.join(new)} (fairseq_attnzoo/compat.py; opt out with "
                    f"{ENV_DISABLE}=NAME,... or =all)")
    return status()


def status() -> Dict[str, str]:
    return dict(_STATUS)


def describe() -> str:
    """A table of the entries, their targets, reasons and what happened to each."""
    rows = [f"{p.name:34s} {_STATUS.get(p.name, 'not run'):9s} {p.target}\n{'':45s}{p.why}"
            for p in PATCHES]
    return "\n".join(rows)


def _always() -> Optional[str]:
    return None


# ---- torch ---------------------------------------------------------------------------------------

def _has_safe_globals() -> Optional[str]:
    import torch

    ok = hasattr(getattr(torch, "serialization", None), "add_safe_globals")
    return None if ok else "torch has no serialization.add_safe_globals (torch < 2.4: not needed)"


@patch("torch_safe_globals_namespace", "torch.serialization (weights-only allow-list)",
       "fairseq checkpoints pickle an argparse.Namespace; torch>=2.6 loads with weights_only=True. "
       "Allow-list just that class instead of disabling the safe loader globally",
       _has_safe_globals)
def _allow_namespace():
    import torch

    torch.serialization.add_safe_globals([argparse.Namespace])


def _has_step_hooks() -> Optional[str]:
    from torch.optim import optimizer

    ok = hasattr(optimizer, "register_optimizer_step_post_hook")
    return None if ok else "torch.optim has no register_optimizer_step_post_hook"


@patch("torch_bounded_parameter_projection", "torch.optim (global step post-hook)",
       "BoundedParameter (e.g. adaptive spans) is projected into its bounds after every optimizer "
       "step, for any torch optimizer (fp32, --amp, --memory-efficient-*)", _has_step_hooks)
def _bounded_projection():
    from .modules.constrained import install_projection_hook

    install_projection_hook()


# ---- numpy ---------------------------------------------------------------------------------------

def _numpy_lacks_compat_long() -> Optional[str]:
    import numpy as np

    if hasattr(getattr(np, "compat", None), "long"):
        return "numpy still has np.compat.long (NumPy < 2): nothing to restore"
    return None


@patch("numpy_compat_long", "numpy.compat.long",
       "fairseq's TokenBlockDataset and bucketed translation data use np.compat.long, removed in "
       "NumPy 2; restore just that alias (int64)", _numpy_lacks_compat_long)
def _numpy_compat_long():
    import numpy as np

    if not hasattr(np, "compat"):
        np.compat = types.SimpleNamespace(long=np.int64)
    else:  # pragma: no cover
        np.compat.long = np.int64


# ---- fairseq optimizers --------------------------------------------------------------------------

def _amp_optimizer():
    from fairseq.optim.amp_optimizer import AMPOptimizer

    return AMPOptimizer.step


@patch("fairseq_amp_single_unscale", "fairseq.optim.amp_optimizer:AMPOptimizer.step",
       "fairseq unscales --amp gradients twice (clip_grad_norm unscales the torch optimizer, step "
       "hands the scaler its wrapper): every update divided by the loss scale once more. This "
       "changes --amp training of every arch, stock ones included, while the plugin is loaded",
       known_source(_amp_optimizer, "2b8a6f80fa6ca14b"))
def _amp_single_unscale():
    from fairseq.optim.amp_optimizer import AMPOptimizer

    from .optim.mixed_precision import amp_step

    AMPOptimizer.step = amp_step


def _fp16_sync():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    return _FP16OptimizerMixin._sync_fp32_params_to_fp16


@patch("fairseq_fp16_master_projection",
       "fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
       "under --fp16/--bf16 the optimizer steps fp32 master copies: bounded parameters are "
       "projected on the masters before fairseq copies them into the half model",
       known_source(_fp16_sync, "a53fdba609963e2d"))
def _fp16_master_projection():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    from .optim.mixed_precision import projecting_sync

    _FP16OptimizerMixin._sync_fp32_params_to_fp16 = projecting_sync(
        _FP16OptimizerMixin._sync_fp32_params_to_fp16)


# ---- fairseq logging -----------------------------------------------------------------------------

@patch("fairseq_meters_slot_usage", "fairseq.logging.meters (module globals)",
       "fairseq rebuilds checkpointed meters by class name from fairseq.logging.meters' globals; "
       "PKM's SlotUsageMeter must be resolvable there for --restore-file", _always)
def _register_meter():
    from fairseq.logging import meters

    from .models.pkm import SlotUsageMeter

    setattr(meters, SlotUsageMeter.__name__, SlotUsageMeter)


# ---- fairseq command-line tools ------------------------------------------------------------------

@patch("fairseq_cli_hints", "sys.excepthook (fairseq-* console scripts only)",
       "errors a user can cause end in one line naming the problem and the fix",
       _always)
def _cli_hints():
    from . import cli_hints

    cli_hints.install()

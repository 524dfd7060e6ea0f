"""Parameters with a box constraint, kept inside it by projected gradient descent.

A :class:`BoundedParameter` is clamped into [``low``, ``high``] after every optimizer step, by the
optimizer that trains it and no other:

* in a plain PyTorch loop, :func:`attach_projection` registers a step post-hook on *that*
  optimizer instance (``optimizer.register_step_post_hook``); or call :func:`project_bounded_`
  on the model after each step;
* under fairseq's trainer, the model projects its own parameters after every update
  (``fairseq_attnzoo/models/adaptive_span.py``), and under ``FP16Optimizer`` (``--fp16``/``--bf16``)
  the fp32 master copies are projected before fairseq copies them into the model
  (:mod:`fairseq_attnzoo.compat.mixed_precision`).

Imports torch only and changes nothing at import time (no global optimizer hook).
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor


def _rebuild_bounded(cls, data: Tensor, requires_grad: bool):
    return cls(data, requires_grad)


class BoundedParameter(nn.Parameter):
    """A parameter kept inside [``low``, ``high``]. Subclass it to set the bounds. Deep copies and
    pickles keep the class (so the projection goes on); state dicts hold plain tensors. Keep it in
    a :class:`~fairseq_attnzoo.modules.precision.Float32Module`: that keeps its float32 values and
    its class through ``half()``/``to()`` under torch's swap/overwrite conversion flags too."""

    low: float = -math.inf
    high: float = math.inf

    def __new__(cls, data: Optional[Tensor] = None, requires_grad: bool = True):
        return super().__new__(cls, data, requires_grad)

    def __reduce_ex__(self, protocol):
        # nn.Parameter pickles as a plain Parameter; rebuild this class instead
        return _rebuild_bounded, (type(self), self.detach(), self.requires_grad)

    @classmethod
    def project_tensor_(cls, t: Tensor) -> Tensor:
        """Clamp ``t`` (this parameter, or a master copy / slice of it) into the bounds, in place."""
        with torch.no_grad():
            return t.clamp_(cls.low, cls.high)

    def project_(self) -> "BoundedParameter":
        self.project_tensor_(self.data)
        return self


class UnitIntervalParameter(BoundedParameter):
    """A parameter kept in [0, 1] (e.g. an adaptive span as a fraction of the maximum span)."""

    low, high = 0.0, 1.0


#: attribute under which an optimizer caches (its parameters, the bounded ones among them)
_CACHE = "_attnzoo_bounded_params"


def bounded_params_of(optimizer) -> List[BoundedParameter]:
    """The bounded parameters an optimizer updates. Cached on the optimizer object (optimizers need
    not be hashable) and keyed by the identity of every parameter in its groups, so a group edited
    in place (a parameter swapped for another, a group added) is seen at the next step. The cache
    holds the parameters, not their ``id``s (an id is reused once its object is freed)."""
    params: Tuple[Tensor, ...] = tuple(p for g in optimizer.param_groups for p in g["params"])
    cached = getattr(optimizer, _CACHE, None)
    if (cached is not None and len(cached[0]) == len(params)
            and all(a is b for a, b in zip(cached[0], params))):
        return cached[1]
    bounded = [p for p in params if isinstance(p, BoundedParameter)]
    try:
        setattr(optimizer, _CACHE, (params, bounded))
    except AttributeError:  # pragma: no cover - an optimizer with __slots__: no cache
        pass
    return bounded


def project_after_step(optimizer, args=None, kwargs=None):
    """Step post-hook of one optimizer: project the bounded parameters it updates."""
    for p in bounded_params_of(optimizer):
        p.project_()


def attach_projection(optimizer):
    """Project the bounded parameters ``optimizer`` updates after each of its steps (a hook on this
    optimizer instance only, never a global one). Returns the hook's handle (``.remove()``)."""
    return optimizer.register_step_post_hook(project_after_step)


def project_bounded_(module: nn.Module) -> int:
    """Clamp every bounded parameter of ``module`` into its bounds, in place; returns how many."""
    n = 0
    for p in module.parameters():
        if isinstance(p, BoundedParameter):
            p.project_()
            n += 1
    return n

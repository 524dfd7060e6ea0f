"""Reduced precision (``--fp16``, ``--bf16``, ``--amp``), written once for every method.

Softmax normalisers in float32 (:func:`fp32_softmax`, as ``fairseq.utils.softmax``), a finite mask
value applied by ``masked_fill`` (never added twice, so an fp16 logit cannot overflow to -inf),
autocast switched off where a quantity needs float32 resolution (:func:`float32_region`), and
modules whose parameters/buffers stay float32 inside a half model (:class:`Float32Module`, like
fairseq's ``Fp32BatchNorm``). Imports torch only.
"""

import contextlib

import torch
import torch.nn as nn
from torch import Tensor

from .constrained import BoundedParameter

#: the reduced-precision floating types (model.half(), model.bfloat16(), autocast)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def mask_value(dtype: torch.dtype) -> float:
    """Finite "minus infinity" for masks: large enough to zero a softmax weight, small enough that
    a fully masked row stays finite (uniform) instead of NaN. Apply it with ``masked_fill`` (or add
    it once to finite logits): two of them added together overflow to -inf."""
    return torch.finfo(dtype).min


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype an op that autocast lowers (a matmul, SDPA) computes ``t`` in: autocast's dtype
    for a float32 tensor inside an autocast region of its device, ``t``'s own otherwise. A mask
    made for that op in float32 would be cast there, and float32's minimum overflows to -inf in
    float16 and bfloat16 (the masked row of :func:`mask_value` is no longer finite)."""
    if t.dtype == torch.float32 and torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def fp32_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """softmax computed in float32 and cast back to ``x``'s dtype (``fairseq.utils.softmax``): the
    normaliser of an fp16/bf16 row loses the small weights otherwise."""
    return torch.softmax(x, dim=dim, dtype=torch.float32).to(x.dtype)


def float32_region(device) -> contextlib.AbstractContextManager:
    """A region computed in float32 even under ``torch.autocast`` (``--amp``): autocast is switched
    off, so float32 inputs give float32 results (cast half inputs with ``.float()``)."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda", "xpu", "mps"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, enabled=False)


def _replaces_tensors() -> bool:
    """torch's opt-in conversion modes that put new tensor objects into the module."""
    future = torch.__future__
    return (future.get_swap_module_params_on_conversion()
            or future.get_overwrite_module_params_on_conversion())


class Float32Module(nn.Module):
    """A module whose parameters and buffers stay float32 when the model is cast to fp16/bf16
    (``model.half()``, ``model.to(torch.bfloat16)``: what fairseq's ``--fp16``/``--bf16`` do), as
    fairseq's ``Fp32BatchNorm``/``Fp32LayerNorm``. For quantities whose resolution matters more than
    their memory: learned spans (a bfloat16 span near 5,000 rounds to a multiple of 32 positions),
    batch-norm statistics. A subclass computes in float32 (inputs ``.float()``, outputs cast back).
    Device moves apply as usual; the float32 values are never rounded through half.

    Works under torch's ``set_swap_module_params_on_conversion(True)`` and
    ``set_overwrite_module_params_on_conversion(True)``: a kept tensor is then handed back as a
    copy (those modes need a new tensor), and a :class:`BoundedParameter` keeps its class (torch
    rebuilds parameters as plain ``nn.Parameter`` there, which would end its projection)."""

    def _apply(self, fn, recurse=True):
        copy = _replaces_tensors()

        def keep_float32(t: Tensor) -> Tensor:
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype in HALF_DTYPES:
                # from the original: no round trip through half
                return t.detach().to(device=out.device, copy=copy)
            if copy and out is t:
                # a no-op (e.g. .to("cpu") on CPU): torch wraps the result in nn.Parameter, which
                # refuses a Parameter subclass; hand it a plain view (class restored below)
                return t.detach()
            return out

        bounded = {k: type(p) for k, p in self._parameters.items()
                   if isinstance(p, BoundedParameter)}
        super()._apply(keep_float32, recurse)
        for key, cls in bounded.items():
            p = self._parameters[key]
            if p is not None and type(p) is not cls:
                p.__class__ = cls  # same object (swap mode) or torch's new one (overwrite mode)
        return self

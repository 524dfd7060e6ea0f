"""``adagrad_clip``: Adagrad with per-tensor gradient clipping (adaptive-span reference optimizer).

For every parameter tensor p with gradient g (Duchi et al. 2011, plus the reference's clipping):

    G_p  += g * g                                     (accumulated squared gradients)
    c_p   = min(1, clip / ||g||)                       (per-tensor clip, --grad-clip-per-tensor)
    p    -= lr * c_p * g / (sqrt(G_p) + eps)

The clip scales the step of each tensor separately (not the global norm, which fairseq's
``--clip-norm`` does) and, as in the reference, the accumulator sees the unclipped gradient.
The paper trains with lr 0.07, clip 0.03 and a linear warmup (``--lr-scheduler fixed
--warmup-updates 32000``). Per-tensor statistics need unflattened parameters: with ``--fp16`` add
``--fp16-no-flatten-grads``.
"""

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import List

import torch
from omegaconf import II

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer

from .. import compat


@dataclass
class AdagradClipConfig(FairseqDataclass):
    grad_clip_per_tensor: float = field(
        default=0.03, metadata={"help": "clip each parameter tensor's gradient norm to this "
                                "value by scaling its step (reference --grad-clip; default 0.03; "
                                "0 = off)"})
    adagrad_eps: float = field(default=1e-10, metadata={"help": "epsilon in the denominator"})
    weight_decay: float = field(default=0.0, metadata={"help": "L2 weight decay (default 0)"})
    lr: List[float] = II("optimization.lr")


class AdagradClip(torch.optim.Optimizer):
    """torch optimizer implementing the update in the module docstring."""

    def __init__(self, params, lr: float = 0.07, grad_clip: float = 0.0, eps: float = 1e-10,
                 weight_decay: float = 0.0):
        if lr < 0 or grad_clip < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, grad_clip, eps and weight_decay must be >= 0")
        super().__init__(params, dict(lr=lr, grad_clip=grad_clip, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, sums = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("adagrad_clip does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                sums.append(state["sum"])
            if params:
                self._update(params, grads, sums, **{k: group[k] for k in
                                                    ("lr", "grad_clip", "eps", "weight_decay")})
        return loss

    @staticmethod
    def _update(params, grads, sums, lr, grad_clip, eps, weight_decay):
        """All tensors of a group at once (torch's ``_foreach`` kernels: a handful of launches
        instead of ~10 per tensor), the same arithmetic as one tensor at a time."""
        if weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        torch._foreach_addcmul_(sums, grads, grads)  # G_p += g * g
        denom = torch._foreach_sqrt(sums)
        torch._foreach_add_(denom, eps)
        updates = torch._foreach_div(grads, denom)  # g / (sqrt(G_p) + eps)
        if grad_clip > 0:  # c_p = min(1, clip / ||g||), one host read for the whole group
            scale = torch.stack(torch._foreach_norm(grads)).add_(1e-10).reciprocal_()
            torch._foreach_mul_(updates, scale.mul_(grad_clip).clamp_(max=1.0).tolist())
        torch._foreach_add_(params, updates, alpha=-lr)


@register_optimizer("adagrad_clip", dataclass=AdagradClipConfig)
class FairseqAdagradClip(FairseqOptimizer):
    @compat.built_by_fairseq
    def __init__(self, cfg: AdagradClipConfig, params):
        super().__init__(cfg)
        self._optimizer = AdagradClip(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        return {"lr": lr, "grad_clip": self.cfg.grad_clip_per_tensor, "eps": self.cfg.adagrad_eps,
                "weight_decay": self.cfg.weight_decay}

    @property
    def supports_flat_params(self):
        return False  # the clip is per tensor

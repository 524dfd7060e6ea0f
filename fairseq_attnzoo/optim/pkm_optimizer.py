"""``--optimizer pkm_adam``: Adam for the model, Adam with its own learning rate for product-key
memory values, sparse row updates when the value gradients are sparse.

XLM trains the memory values with an optimiser of their own, by default Adam at lr 1e-3
(``--mem_values_optimizer adam,lr=0.001`` in ``xlm/model/memory/memory.py``), SparseAdam with
``--mem_sparse true``. fairseq has one optimizer and one learning rate, so this optimizer keeps
two parameter groups:

* everything else: Adam with decoupled weight decay, exactly fairseq's ``adam`` (AdamW update);
* the value tables (parameters tagged ``param_group = "pkm_values"`` by the memory): Adam at
  ``--pkm-values-lr``, with its own weight decay (``--pkm-values-weight-decay``), betas
  (``--pkm-values-betas``) and gradient clip (``--pkm-values-clip-norm``). The lr either follows
  the scheduler, scaled by ``--pkm-values-lr / --lr`` (``--pkm-values-lr-schedule follow``: the
  values warm up and decay with the model and peak at ``--pkm-values-lr``), or stays at
  ``--pkm-values-lr`` (``constant``). ``--pkm-values-lr-ratio R`` gives the peak as R × ``--lr``
  instead, the form that carries over to another ``--lr``. A sparse gradient updates only the rows it touches (moments
  and parameters, SparseAdam-style); a dense one is a normal Adam step.

The two published recipes (read in their code; docs/pkm.md cites the lines):

* XLM (Lample et al.): ``--mem_values_optimizer adam,lr=0.001`` is a second Adam over the values
  alone, at a constant lr (XLM's plain ``adam`` has no schedule), betas (0.9, 0.999), no weight
  decay; ``--mem_sparse true`` turns it into ``SparseAdam``; each optimizer's parameters are
  clipped separately to ``--clip_grad_norm``. Here: ``--pkm-values-lr-schedule constant
  --pkm-values-betas "(0.9, 0.999)" --pkm-values-weight-decay 0`` (+ ``--pkm-sparse``).
* facebookresearch/memory (Memory+): one AdamW (betas (0.9, 0.95), weight decay 0.1, for the values
  too) whose value group starts from ``value_fixed_lr`` 1e-3; its LambdaLR scales every group by
  the same schedule factor, so that lr follows the warmup/decay; values are clipped separately
  from the rest to the same ``clip``. Here: ``--pkm-values-lr-schedule follow
  --pkm-values-weight-decay 0.1`` with ``--adam-betas "(0.9, 0.95)" --weight-decay 0.1``; its
  pkplus_373m_1024k.yaml sets the values' 1e-3 against ``optim.lr`` 1e-4, a ratio of 10:
  ``--pkm-values-lr-ratio 10``.

Clipping: with ``--pkm-values-clip-norm`` -1 (default) the value gradients are clipped
separately to ``--clip-norm`` (both references clip the two parameter sets separately); a
positive value gives them their own threshold, 0 leaves them unclipped. The norm fairseq logs as
``gnorm`` (and checks for inf/NaN) stays the norm over all gradients; the values' own norm is logged
as ``pkm_values_gnorm``.

Multi-process training with sparse values: the DDP wrappers leave the sparse value tables alone
(fairseq's legacy DDP skips parameters tagged ``expert``; PyTorch DDP ignores the names the zoo
model lists in ``_ddp_params_and_buffers_to_ignore``), and :meth:`PKMAdam.all_reduce_grads` --
which fairseq's trainer calls after the last backward pass of an update (all ``--update-freq``
micro-batches accumulated) and before ``multiply_grads`` -- exchanges their rows instead
(:func:`~fairseq_attnzoo.modules.pkm_shard.all_reduce_sparse_rows`): every rank ends with the same
coalesced gradient over the union of the rows read on any rank, divided by the world size exactly
as the DDP wrappers divide dense gradients (the trainer then multiplies everything by world size /
sample size), and runs the same lazy Adam step on the same rows, so the tables stay identical and
the update is the one a single process with ``--update-freq W`` makes. ``--pkm-exchange``:
all-gather the (row, gradient) lists (cheap when few rows are read), or all-reduce a dense
[|K|, d + 1] buffer (rows + a "read" count; what a dense all-reduce costs), or ``auto``: the
cheaper of the two, per update. The bytes each rank receives are logged as ``pkm_xchg_mb``.

Gradient scaling, clipping and the gradient norm fairseq logs are done here too, because fairseq's
versions do not handle sparse gradients: ``multiply_grads`` (the division by the number of tokens)
runs ``p.grad.data.mul_(c)``, which silently leaves a sparse gradient unscaled, and
``clip_grad_norm_`` calls ``torch.norm(..., dtype=float32)``, which sparse tensors do not support;
an uncoalesced sparse gradient (duplicate rows) must also be coalesced before its norm means
anything.
"""

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from .. import compat
from ..modules.pkm import VALUES_GROUP
from ..modules.pkm_shard import (EXCHANGES, all_reduce_sparse_rows, clip_grads_, coalesced,
                                 grad_norm, is_split)

logger = logging.getLogger(__name__)


VALUE_SCHEDULES = ("follow", "constant")


def _parse_betas(value, flag: str):
    """'(0.9, 0.999)' or a sequence -> a tuple of two floats, or one line naming the flag."""
    try:
        betas = tuple(float(b) for b in (value.strip("()[] ").split(",")
                                          if isinstance(value, str) else value))
    except (TypeError, ValueError):
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"{flag} must be two numbers in [0, 1) like '(0.9, 0.999)', got {value!r}")
    return betas


#: the values' rate when neither --pkm-values-lr nor --pkm-values-lr-ratio is given (XLM's value
#: Adam and facebookresearch/memory's value_fixed_lr: 1e-3)
DEFAULT_VALUES_LR = 1e-3


def values_lr(cfg, lr: float) -> float:
    """The values' peak rate under pkm_adam's flags ``cfg`` (its config, or fairseq's args) and
    the model's peak ``lr``: --pkm-values-lr-ratio × lr when a ratio is given, else
    --pkm-values-lr (default :data:`DEFAULT_VALUES_LR`)."""
    ratio = getattr(cfg, "pkm_values_lr_ratio", 0) or 0
    absolute = getattr(cfg, "pkm_values_lr", None)
    if ratio > 0 and absolute is not None:
        raise ValueError(f"--pkm-values-lr {absolute} and --pkm-values-lr-ratio {ratio} both set "
                         "the values' rate: give one (the ratio carries over to another --lr)")
    return ratio * lr if ratio > 0 else (DEFAULT_VALUES_LR if absolute is None else absolute)


@dataclass
class PKMAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam"})
    weight_decay: float = field(
        default=0.0, metadata={"help": "decoupled weight decay (not applied to memory values)"})
    pkm_exchange: str = field(
        default="auto",
        metadata={"help": "multi-process sparse values: how the rows read are exchanged -- "
                  "'gather' (all-gather rows + gradients), 'all_reduce' (dense [|K|, d+1] "
                  "all-reduce), 'auto' = whichever moves fewer bytes this update (default auto)"})
    pkm_values_lr: Optional[float] = field(
        default=None,
        metadata={"help": "learning rate of the product-key memory values (XLM and "
                  "facebookresearch/memory: 1e-3); see --pkm-values-lr-schedule; not with "
                  "--pkm-values-lr-ratio (default 1e-3)"})
    pkm_values_lr_ratio: float = field(
        default=0.0,
        metadata={"help": "the values' learning rate as a multiple of --lr (the peak), instead of "
                  "--pkm-values-lr: a ratio carries over to another --lr, an absolute rate does "
                  "not (facebookresearch/memory's pkplus_373m_1024k.yaml: value_fixed_lr 0.001 "
                  "at optim.lr 1e-4, one LambdaLR scaling both: 10); not with --pkm-values-lr; "
                  "0 = use --pkm-values-lr (default 0)"})
    pkm_values_lr_schedule: str = field(
        default="follow",
        metadata={"help": "values lr: 'follow' = the --lr-scheduler shape scaled by "
                  "pkm_values_lr / lr (facebookresearch/memory: its LambdaLR scales the value "
                  "group's 1e-3 too), 'constant' = pkm_values_lr throughout (XLM: a separate "
                  "Adam with no schedule); default follow"})
    pkm_values_weight_decay: float = field(
        default=0.0,
        metadata={"help": "decoupled weight decay of the memory values (XLM: 0; "
                  "facebookresearch/memory: 0.1, its AdamW's decay covers the values); sparse "
                  "values decay only the rows read; default 0"})
    pkm_values_betas: Optional[str] = field(
        default=None,
        metadata={"help": "Adam betas of the memory values, e.g. '(0.9, 0.999)' (XLM's value "
                  "Adam); default: --adam-betas (facebookresearch/memory: one AdamW, (0.9, 0.95))"})
    pkm_values_clip_norm: float = field(
        default=-1.0,
        metadata={"help": "clip the value gradients separately, to this norm (XLM and "
                  "facebookresearch/memory clip values and the rest separately); -1 = "
                  "--clip-norm's threshold, 0 = no clipping of values; default -1"})
    lr: List[float] = II("optimization.lr")


class SparseDenseAdam(torch.optim.Optimizer):
    """Adam (decoupled weight decay) that also takes sparse gradients, updating only their rows.

    Each group carries ``lr_scale`` (its lr relative to the schedule's) besides the usual
    ``lr``, ``betas``, ``eps``, ``weight_decay``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      lr_scale=1.0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                step_size = group["lr"] * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if p.grad.is_sparse:
                    grad = coalesced(p.grad)
                    rows, g = grad.indices()[0], grad.values().float()
                    # lazy Adam: moments and parameters of the rows read in this batch only;
                    # in place on the gathered rows to keep temporaries at 2 × rows × d
                    m_rows = m[rows].mul_(beta1).add_(g, alpha=1 - beta1)
                    v_rows = v[rows].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    m.index_copy_(0, rows, m_rows)
                    v.index_copy_(0, rows, v_rows)
                    delta = m_rows.div_(v_rows.sqrt_().add_(group["eps"])).mul_(-step_size)
                    del v_rows
                    if group["weight_decay"]:
                        delta.add_(p[rows].float(), alpha=-group["weight_decay"] * group["lr"])
                    p.index_add_(0, rows, delta.to(p.dtype))
                else:
                    g = p.grad.float()
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    p32 = p if p.dtype == torch.float32 else p.float()
                    if group["weight_decay"]:
                        p32.mul_(1 - group["weight_decay"] * group["lr"])
                    p32.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)
                    if p32 is not p:
                        p.copy_(p32)
        return loss


@register_optimizer("pkm_adam", dataclass=PKMAdamConfig)
class PKMAdam(FairseqOptimizer):
    """fairseq optimizer: Adam, plus a separate (and possibly sparse) Adam for PKM values."""

    @compat.built_by_fairseq
    def __init__(self, cfg: PKMAdamConfig, params):
        super().__init__(cfg)
        params = list(params)
        if params and isinstance(params[0], dict):  # FP16Optimizer's flat {device: buffer}
            raise ValueError("pkm_adam needs the memory values as separate parameters but --fp16 "
                             "flattens all parameters into one buffer: add --fp16-no-flatten-grads")
        if cfg.pkm_exchange not in EXCHANGES:
            raise ValueError(f"--pkm-exchange must be one of {', '.join(EXCHANGES)}, got "
                             f"{cfg.pkm_exchange!r}")
        if cfg.pkm_values_lr is not None and cfg.pkm_values_lr <= 0:
            raise ValueError(f"--pkm-values-lr must be positive, got {cfg.pkm_values_lr}")
        if cfg.pkm_values_lr_ratio < 0:
            raise ValueError(f"--pkm-values-lr-ratio must be positive (or 0: use "
                             f"--pkm-values-lr), got {cfg.pkm_values_lr_ratio}")
        values_lr(cfg, 1.0)  # (refuses both rates given)
        if cfg.pkm_values_lr_schedule not in VALUE_SCHEDULES:
            raise ValueError(f"--pkm-values-lr-schedule must be one of "
                             f"{', '.join(VALUE_SCHEDULES)}, got {cfg.pkm_values_lr_schedule!r}")
        if cfg.pkm_values_weight_decay < 0:
            raise ValueError(f"--pkm-values-weight-decay must be >= 0, got "
                             f"{cfg.pkm_values_weight_decay}")
        if cfg.pkm_values_clip_norm < 0 and cfg.pkm_values_clip_norm != -1:
            raise ValueError(f"--pkm-values-clip-norm must be -1 (= --clip-norm), 0 (off) or "
                             f"positive, got {cfg.pkm_values_clip_norm}")
        values = [p for p in params if getattr(p, "param_group", None) == VALUES_GROUP]
        others = [p for p in params if getattr(p, "param_group", None) != VALUES_GROUP]
        #: said at the first step, not here: fairseq also builds optimizers it never steps (the
        #: --bf16 wrapper's probe of whether flat parameters are taken, on one dummy parameter)
        self._no_values_notice = not values
        groups = [{"params": others}]
        if values:
            groups.append(dict(self._values_group_settings(), params=values,
                               lr=self.values_lr))
        self._optimizer = SparseDenseAdam(groups, **self.optimizer_config)

    @property
    def optimizer_config(self):
        return {
            "lr": self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr,
            "betas": eval(self.cfg.adam_betas) if isinstance(self.cfg.adam_betas, str)
            else tuple(OmegaConf.to_container(self.cfg.adam_betas)
                       if not isinstance(self.cfg.adam_betas, (tuple, list)) else self.cfg.adam_betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }

    @property
    def values_lr(self) -> float:
        return values_lr(self.cfg, self.optimizer_config["lr"])

    def _values_group_settings(self):
        """The value group's settings (set at build and again after loading a checkpoint)."""
        cfg = self.cfg
        betas = (_parse_betas(cfg.pkm_values_betas, "--pkm-values-betas")
                 if cfg.pkm_values_betas else self.optimizer_config["betas"])
        constant = cfg.pkm_values_lr_schedule == "constant"
        return {"weight_decay": float(cfg.pkm_values_weight_decay), "betas": betas,
                "lr_scale": self.values_lr / self.optimizer_config["lr"],
                "lr_constant": self.values_lr if constant else None, VALUES_GROUP: True}

    def set_lr(self, lr):
        for group in self.param_groups:
            fixed = group.get("lr_constant")
            group["lr"] = fixed if fixed is not None else lr * group.get("lr_scale", 1.0)

    def get_lr(self):
        return self.param_groups[0]["lr"]

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        super().load_state_dict(state_dict, optimizer_overrides)
        for group in self.param_groups:  # overrides apply to the model's group only
            if group.get(VALUES_GROUP):
                group.update(self._values_group_settings())
                if group["lr_constant"] is not None:
                    group["lr"] = group["lr_constant"]

    def step(self, closure=None, scale=1.0, groups=None):
        if self._no_values_notice:
            self._no_values_notice = False
            logger.warning("pkm_adam: no product-key memory values among the parameters; "
                           "every parameter uses --lr (plain Adam)")
        super().step(closure, scale, groups)

    def all_reduce_grads(self, module):
        """fairseq's gradient all-reduce (the DDP wrapper's, for the dense gradients), then the
        sparse value tables' row exchange: each rank ends with the mean gradient over ranks."""
        super().all_reduce_grads(module)
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = distributed_utils.get_data_parallel_group()
        world = distributed_utils.get_data_parallel_world_size()
        if world <= 1:
            return
        received = 0
        for p in module.parameters():
            if (getattr(p, "pkm_sparse", False) and getattr(p, "param_group", None) == VALUES_GROUP
                    and not is_split(p)):  # a split table: fairseq_sharded_value_grads did it
                grad = p.grad if p.grad is not None else torch.sparse_coo_tensor(
                    torch.zeros(1, 0, dtype=torch.long, device=p.device),
                    p.new_zeros(0, p.size(1)), p.shape, check_invariants=False)
                p.grad, nbytes = all_reduce_sparse_rows(grad, group, world,
                                                        self.cfg.pkm_exchange)
                received += nbytes
        if received:
            metrics.log_scalar("pkm_xchg_mb", received / 2 ** 20, round=2)

    def multiply_grads(self, c):
        """Multiply gradients by c (fairseq divides by the sample size here). fairseq's version
        does ``p.grad.data.mul_(c)``, which leaves a sparse ``p.grad`` unchanged (``.data`` of a
        sparse tensor is not an alias of its values): scale the values instead."""
        dense = []
        for p in self.params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                p.grad._values().mul_(c.to(p.grad.device) if torch.is_tensor(c) else c)
            else:
                dense.append(p.grad)
        for g in dense:
            g.mul_(c.to(g.device) if torch.is_tensor(c) else c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """L2 norms over dense and (coalesced) sparse gradients; clip in place: the value tables
        separately (to --pkm-values-clip-norm, -1 = max_norm), the rest to max_norm. Returns the
        norm over all gradients (fairseq's logged ``gnorm`` and inf/NaN check). A table split
        over processes counts as the whole table (``grad_norm``: its columns summed over the
        ranks that hold them)."""
        model, values = [], []
        for p in self.params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                p.grad = coalesced(p.grad)
            (values if getattr(p, "param_group", None) == VALUES_GROUP else model).append(p)
        if not model and not values:
            return torch.tensor(0.0)
        value_max = self.cfg.pkm_values_clip_norm
        value_max = max_norm if value_max == -1 else value_max
        norms = []
        for params, limit in ((model, max_norm), (values, value_max)):
            norm = grad_norm(params, aggregate_norm_fn)
            norms.append(norm)
            if params and limit > 0:
                clip_grads_(params, norm, limit)
        if values:
            metrics.log_scalar("pkm_values_gnorm", norms[1], round=3)
        device = (model or values)[0].grad.device
        return torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]))

    @property
    def supports_flat_params(self):
        return False  # the value tables must stay separate parameters

    @property
    def supports_memory_efficient_fp16(self):
        """--memory-efficient-fp16/-bf16 step the half parameters themselves: Adam's moments are
        float32 and each update is computed in float32 and rounded once (sparse rows too)."""
        return True

"""``--pkm-shard-values``: the memory value tables split by columns over fairseq's data-parallel
ranks (:mod:`fairseq_attnzoo.modules.pkm_shard`, where all of the distributed code lives), and the
places fairseq's training loop must know about them (compat entries, registered here by their
owner; each hands the work to that module):

* ``fairseq_sharded_value_grads`` -- ``FairseqOptimizer.all_reduce_grads`` (called once an update,
  after the last backward, by every optimizer and precision wrapper): the split tables'
  gradients, which the DDP wrappers skip (tagged ``expert``), become the mean over ranks
  (:func:`~fairseq_attnzoo.modules.pkm_shard.finish_gradients`).
* ``fairseq_sharded_value_norm`` -- ``fairseq.utils.clip_grad_norm_``: fairseq leaves ``expert``
  gradients out of the norm; a split table counts with its slices' squares summed over the shard
  group (:func:`~fairseq_attnzoo.modules.pkm_shard.grad_norm`), so every rank gets the
  one-process norm, fairseq's check that ranks agree passes, and a loss scaler's overflow is seen
  on every rank; and ``AMPOptimizer.clip_grad_norm``: torch's GradScaler skips a step where THIS
  rank's gradients hold an inf, so an overflow in one rank's slice marks every rank's scaler.
* ``fairseq_sharded_value_masters`` -- ``FP16Optimizer.__init__`` (``--fp16``, ``--bf16``): its
  fp32 master copies (per parameter or flat) learn where the split tables lie in them
  (:func:`~fairseq_attnzoo.modules.pkm_shard.describe_masters`).
* ``fairseq_sharded_value_checkpoints`` -- ``Trainer.always_call_state_dict_during_save_checkpoint``
  true when a model has split tables (every rank calls ``state_dict``: the columns are gathered to
  rank 0), and ``FairseqOptimizer.state_dict`` / ``load_state_dict``: the optimizer state of a
  split table (or of a master holding one) is saved as the whole table's, into a copy (the running
  optimizer keeps its columns), and split again on loading, so a checkpoint resumes at any world
  size.
"""

import logging
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from fairseq.distributed import utils as distributed_utils

from .. import compat
from ..modules.pkm_shard import (ShardedValueTable, ShardLayout, clip_grads_, describe_masters,
                                 finish_gradients, grad_norm, is_split, local_state, whole_state)
from .registry import building_from_checkpoint

logger = logging.getLogger(__name__)

_LAYOUTS: Dict[Tuple, ShardLayout] = {}


def shard_layout(group_size: int) -> Optional[ShardLayout]:
    """This rank's :class:`ShardLayout` for --pkm-shard-group-size ``group_size`` (0 = every
    data-parallel rank); None with one process (the tables stay whole). Every rank must call it
    (subgroups are created collectively, once per process)."""
    if group_size < 0:
        raise ValueError(f"--pkm-shard-group-size must be >= 0 (0 = all processes), got "
                         f"{group_size}")
    world = (distributed_utils.get_data_parallel_world_size()
             if dist.is_available() and dist.is_initialized() else 1)
    if world == 1:  # (also a split run's checkpoint evaluated by one process)
        return None
    size = group_size or world
    if world % size:
        raise ValueError(f"--pkm-shard-group-size {size} does not divide the number of "
                         f"processes ({world}): use a divisor of {world} (or 0 = all)")
    rank = distributed_utils.get_data_parallel_rank()
    key = (world, size)
    if key not in _LAYOUTS:
        dp = distributed_utils.get_data_parallel_group()
        if size == world:
            _LAYOUTS[key] = ShardLayout(dp, size, rank, world)
        else:
            if dist.get_world_size() != world:
                raise ValueError("--pkm-shard-group-size below the number of processes needs "
                                 "data parallelism over every process (no model parallelism)")
            groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
            replicas = [dist.new_group(list(range(c, world, size))) for c in range(size)]
            _LAYOUTS[key] = ShardLayout(groups[rank // size], size, rank % size, world,
                                        replicas[rank % size], saves=rank < size)
    return _LAYOUTS[key]


def shard_values(spec, options, memory):
    """--pkm-shard-values: replace the table ``memory`` owns by its column slice (a shared pool
    is split once, by its owner, before the other memories are built); refuses, in one line, a
    setup whose gradient path would bypass the split tables' hooks."""
    if not options.pkm_shard_values:
        return
    refuse_unsupported(spec.args)
    if not memory.owns_values:
        return
    layout = shard_layout(int(options.pkm_shard_group_size))
    if layout is None:
        # (a checkpoint's stored flag, evaluated by one process, is not the user's to change)
        if not spec.shared.get("pkm_shard_notice") and not building_from_checkpoint():
            spec.shared["pkm_shard_notice"] = True
            logger.warning("--pkm-shard-values with one process: the PKM value tables are not "
                           "split (they are whole on this process); it splits them over the "
                           "ranks of distributed training")
        return
    memory.values = ShardedValueTable(memory.values, layout)


def refuse_unsupported(args):
    """One line for a setup whose gradient path would bypass the split tables' hooks."""
    backend = str(getattr(args, "ddp_backend", ""))
    bmuf = getattr(args, "use_bmuf", False)
    if backend in ("fully_sharded", "slowmo") or bmuf:
        what = "--use-bmuf" if bmuf else f"--ddp-backend {backend}"
        raise ValueError(f"--pkm-shard-values does not work with {what} (it shards or averages "
                         "the parameters itself): use --ddp-backend legacy_ddp, no_c10d, "
                         "pytorch_ddp or c10d")


# ---- the compat entries ---------------------------------------------------------------------

def reducing(all_reduce_grads):
    def all_reduce_grads_and_split_tables(self, module):
        all_reduce_grads(self, module)
        finish_gradients(module.parameters())

    return all_reduce_grads_and_split_tables


def norm_with_split_tables(clip_grad_norm_):
    def clip_grad_norm_with_split_tables(params, max_norm, aggregate_norm_fn=None):
        params = [params] if torch.is_tensor(params) else list(params)
        if not any(is_split(p) for p in params):
            return clip_grad_norm_(params, max_norm, aggregate_norm_fn)
        total = grad_norm(params, aggregate_norm_fn)
        if max_norm > 0:
            clip_grads_(params, total, max_norm)
        return total

    return clip_grad_norm_with_split_tables


def overflow_on_every_rank(clip_grad_norm):
    """``AMPOptimizer.clip_grad_norm`` that, with split tables, marks this rank's GradScaler as
    overflowed when the norm is not finite: torch's scaler skips a step where THIS rank's
    gradients hold an inf or NaN, and a split slice's are this rank's alone, while the norm (the
    whole tables') is the same everywhere -- so every rank skips the step and lowers its scale."""

    def clip_grad_norm_overflowing_everywhere(self, max_norm, aggregate_norm_fn=None):
        norm = clip_grad_norm(self, max_norm, aggregate_norm_fn)
        if not torch.isfinite(norm).all() and any(is_split(p) for p in self.fp32_optimizer.params):
            state = self.scaler._per_optimizer_states[id(self.optimizer)]
            for found in state.get("found_inf_per_device", {}).values():
                found.fill_(1.0)
        return norm

    return clip_grad_norm_overflowing_everywhere


def describing_masters(init):
    def fp16_optimizer_init(self, cfg, params, fp32_optimizer, fp32_params, **kwargs):
        init(self, cfg, params, fp32_optimizer, fp32_params, **kwargs)
        describe_masters(self.fp16_params, self.fp32_params)

    return fp16_optimizer_init


def _optimizer_params(optimizer):
    """Parameters of a torch optimizer in its state-dict numbering."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def gathering_state(state_dict):
    def state_dict_with_full_tables(self):
        out = state_dict(self)
        for i, p in enumerate(_optimizer_params(self.optimizer)):
            if is_split(p) and i in out.get("state", {}):
                # torch's state_dict hands out the optimizer's own per-parameter dicts: the
                # whole tables go into a copy, the running optimizer keeps its columns
                out["state"][i] = {name: whole_state(p, value)  # one tensor at a time
                                   for name, value in out["state"][i].items()}
        return out

    return state_dict_with_full_tables


def splitting_state(load_state_dict):
    def load_state_dict_of_full_tables(self, state_dict, optimizer_overrides=None):
        load_state_dict(self, state_dict, optimizer_overrides)
        for p in _optimizer_params(self.optimizer):
            if is_split(p) and p in self.optimizer.state:
                state = self.optimizer.state[p]
                for name, value in list(state.items()):
                    state[name] = local_state(p, value)

    return load_state_dict_of_full_tables


def _always_call_state_dict(prop):
    def fget(self):
        return prop.fget(self) or any(is_split(p) for p in self.model.parameters())

    return property(fget, doc=prop.__doc__)


OPT = "fairseq.optim.fairseq_optimizer:FairseqOptimizer"
STATE_CALL = "fairseq.trainer:Trainer.always_call_state_dict_during_save_checkpoint"

compat.fix("fairseq_sharded_value_grads", f"{OPT}.all_reduce_grads",
           "--pkm-shard-values: the DDP wrappers skip the split value tables; after the "
           "all-reduce their gradients become the mean over ranks (sum over the column slice's "
           "replicas / world size)", reducing, "00c45eb68f370fcb", version="fairseq 0.12.3")
compat.fix("fairseq_sharded_value_norm", {
    "fairseq.utils:clip_grad_norm_": norm_with_split_tables,
    "fairseq.optim.amp_optimizer:AMPOptimizer.clip_grad_norm": overflow_on_every_rank},
    "--pkm-shard-values: fairseq leaves expert-tagged gradients out of the norm; a split "
    "table counts with its squares summed over the shard group (the one-process norm), and "
    "under --amp a non-finite norm makes every rank's GradScaler skip the step (its inf check "
    "sees only this rank's slice)", None, "0e9a45d266e19456", "8b4f889d171babc0",
    version="fairseq 0.12.3")
compat.fix("fairseq_sharded_value_masters", "fairseq.optim.fp16_optimizer:FP16Optimizer.__init__",
           "--pkm-shard-values with --fp16/--bf16: the fp32 master copies (per parameter, or one "
           "flat buffer) record where the split tables' columns lie in them, so the norm sums "
           "those columns over the shard group and checkpoints hold their state whole",
           describing_masters, "c7ac9b724be2cb2b", version="fairseq 0.12.3")
compat.fix("fairseq_sharded_value_checkpoints", {
    STATE_CALL: _always_call_state_dict, f"{OPT}.state_dict": gathering_state,
    f"{OPT}.load_state_dict": splitting_state},
    "--pkm-shard-values: checkpoints hold whole value tables and their optimizer state "
    "(gathered to rank 0 while every rank calls state_dict; split again on loading), so they "
    "load at any world size", None, "3c7d32776378e123", "fc8e18f8d0c260e7", "c898c7b2f01de389",
    version="fairseq 0.12.3")

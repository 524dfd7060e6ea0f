"""Product-key memory values split by columns over processes (memory parallelism).

A value table V [|K|, d] is split column-wise over the G ranks of a process group (DTensor's
``Shard(1)`` placement; the column-wise embedding bag of facebookresearch/memory): rank r keeps
every row and the columns ``[r·d/G, (r+1)·d/G)``. A read of the tokens of every rank::

    forward   indices, weights of all G ranks' tokens   all-gather (ints; weights with autograd)
              m_r = Σ_j w_j V[i_j, cols_r]               this rank's columns, every token (a bag)
              out[my tokens] = concat_r m_r[my tokens]   all-to-all, back to each token's rank
    backward  ∂out[my tokens, cols_r] -> rank r          all-to-all (its autograd rule)
              ∂V[:, cols_r] = Σ_tokens w ∂m_r            local: never crosses the network
              ∂w = Σ_r ⟨∂m_r, V[i, cols_r]⟩              partial dots, reduce-scattered (the
                                                          all-gather's autograd rule)

Only indices, weights and d-wide activations move; the table's gradient and its optimizer state
stay on the rank that owns the columns. The collectives are torch's own autograd-aware
functional collectives (``torch.distributed._functional_collectives``; they run under gloo and
NCCL); the per-rank bag is :class:`~.pkm.ValueTable`'s read (sparse or dense gradients, the Triton
kernels on CUDA) on the local column slice.

Gradient convention (data parallelism averages over ranks): the local gradient is the sum over
the tokens of the shard group; :func:`finish_gradients` sums it over the replicas of this column
slice (when the shard group is smaller than the data-parallel world) and divides by the
data-parallel world size, as a DDP wrapper does for every other parameter.

State dicts hold the full table (``weight`` [|K|, d]) so that a checkpoint loads at any world
size: saving gathers the columns to the group's first rank, one table at a time (every rank of
the group must call ``state_dict``); loading keeps this rank's columns of a full table.

Plain PyTorch (``torch.distributed``), usable without fairseq.
"""

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn
from torch import Tensor

from .pkm_values import VALUES_GROUP, ValueTable, mark_sparse

#: the attribute that marks a split value table's parameter (its :class:`ShardLayout`)
SHARD_TAG = "pkm_shard"

# torch >= 2.12 names the gather along a dim ``all_gather_single_autograd``; 2.3-2.11 only
# ``all_gather_tensor_autograd`` (same op, deprecated since)
_all_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


@dataclass(frozen=True)
class ShardLayout:
    """Where a table's columns live: ``group`` (its G ranks hold one column slice each, in
    group-rank order), ``replicas`` (the ranks holding this rank's slice in the other groups;
    None when G = the data-parallel world) and the data-parallel world size the gradients are
    averaged over."""

    group: object
    size: int
    rank: int
    world: int
    replicas: object = None
    #: whether this group holds data-parallel rank 0 (the rank that writes checkpoints)
    saves: bool = True


def split_columns(full: Tensor, layout: ShardLayout) -> Tensor:
    """This rank's column slice of a full [rows, d] tensor (a copy)."""
    width = full.size(1) // layout.size
    return full[:, layout.rank * width:(layout.rank + 1) * width].clone()


def gather_columns(local: Tensor, layout: ShardLayout) -> Optional[Tensor]:
    """The full [rows, d] tensor on the group's first rank (None on the others); every rank of
    the group must call it."""
    if layout.rank != 0:
        dist.gather(local.contiguous(), None, dst=dist.get_global_rank(layout.group, 0),
                    group=layout.group)
        return None
    parts = [torch.empty_like(local) for _ in range(layout.size)]
    dist.gather(local.contiguous(), parts, dst=dist.get_global_rank(layout.group, 0),
                group=layout.group)
    return torch.cat(parts, 1)


class ShardedValueTable(nn.Module):
    """A :class:`~.pkm.ValueTable` whose columns are split over ``layout.group``: ``weight`` is
    this rank's [|K|, d/G] slice; :meth:`read` takes this rank's tokens and returns them
    full-width. Built from the full (initialised) table, so every rank starts from the columns of
    the same table as one process would."""

    def __init__(self, table: nn.EmbeddingBag, layout: ShardLayout):
        super().__init__()
        d = table.embedding_dim
        if d % layout.size:
            raise ValueError(f"the PKM value dim {d} is not divisible by the shard group size "
                             f"{layout.size}: choose a value dim or --pkm-shard-group-size so "
                             "that it is")
        self.num_embeddings, self.embedding_dim = table.num_embeddings, d
        self.layout = layout
        self.weight = nn.Parameter(split_columns(table.weight.detach(), layout))
        self.weight.param_group = VALUES_GROUP
        setattr(self.weight, SHARD_TAG, layout)
        # out of the DDP wrappers' buckets whether sparse or not (``expert``: fairseq's tag;
        # PyTorch DDP: the zoo model's ignore list); sparse: pkm_adam's lazy updates
        self.split = True
        mark_sparse(self, bool(getattr(table, "sparse", False)))

    def read(self, indices: Tensor, weights: Tensor, fused: bool,
             keep: Optional[Tensor] = None) -> Tensor:
        """``out[n] = Σ_j weights[n, j] · V[indices[n, j]]`` for this rank's N tokens -> [N, d];
        a collective: every rank of the group reads once per call. ``keep`` [N] (bool): the
        real tokens (masked padding), whose reads alone a sparse gradient holds."""
        g, group = self.layout.size, self.layout.group
        n = indices.size(0)
        weights = weights.to(self.weight.dtype)
        # token counts differ between ranks (padding removed): gather them, pad to the longest
        counts = torch.tensor([n], dtype=torch.int64, device=indices.device)
        counts = _all_gather(counts, 0, group).tolist()
        longest = max(counts)
        if longest == 0:
            return weights.new_zeros(0, self.embedding_dim)

        def gathered(t: Tensor) -> Tensor:
            """The rows of ``t`` of every rank, in rank order, without the rows that padded each
            rank's to ``longest`` (they would read, and in a sparse gradient touch, row 0)."""
            every = _all_gather(_pad(t, longest), 0, group).view(g, longest, *t.shape[1:])
            return torch.cat([every[r, :c] for r, c in enumerate(counts)])

        all_idx, all_w = gathered(indices), gathered(weights)
        if keep is not None:  # (uint8 on the wire: gloo gathers no bool)
            keep = gathered(keep.to(torch.uint8)).bool()
        local = ValueTable.read(self, all_idx, all_w, fused, keep)  # [Σ counts, d/G]
        # rank r's tokens go back to rank r; this rank receives its n tokens from every rank
        back = fc.all_to_all_single_autograd(local, [n] * g, counts, group)
        back = fc.wait_tensor(back) if isinstance(back, fc.AsyncCollectiveTensor) else back
        return back.view(g, n, -1).transpose(0, 1).reshape(n, self.embedding_dim)

    # ---- checkpoints hold the full table -------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.layout.saves:  # the checkpoint is written by another group's first rank
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        full = gather_columns(self.weight.detach(), self.layout)
        destination[prefix + "weight"] = (full.cpu() if full is not None
                                          else self.weight.detach())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        full = state_dict.get(key)
        if full is not None and tuple(full.shape) == (self.num_embeddings, self.embedding_dim):
            state_dict[key] = split_columns(full, self.layout)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} split over {self.layout.size} "
                f"ranks (this rank: columns {self.layout.rank}/{self.layout.size})")


def _pad(t: Tensor, rows: int) -> Tensor:
    if t.size(0) == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.size(0),) + t.shape[1:])])


def sharded_params(params: Iterable[Tensor]) -> List[Tensor]:
    return [p for p in params if hasattr(p, SHARD_TAG)]


def finish_gradients(params: Iterable[Tensor],
                     sparse_mean: Optional[Callable[[Tensor, object, int], Tensor]] = None):
    """After the last backward of an update: each split table's gradient (the sum over its shard
    group's tokens) summed over the replicas of its columns and divided by the data-parallel
    world size -- the mean over ranks a DDP wrapper makes of every other gradient.
    ``sparse_mean(grad, group, size)``: the mean of a sparse gradient over a group (needed only
    when there are replicas)."""
    for p in sharded_params(params):
        if p.grad is None:
            continue
        layout = getattr(p, SHARD_TAG)
        replicas = layout.world // layout.size
        if layout.replicas is not None and replicas > 1:
            if p.grad.is_sparse:
                p.grad = sparse_mean(p.grad, layout.replicas, replicas)
                scale = 1.0 / layout.size
            else:
                dist.all_reduce(p.grad, group=layout.replicas)
                scale = 1.0 / layout.world
        else:
            scale = 1.0 / layout.world
        if p.grad.is_sparse:
            p.grad = torch.sparse_coo_tensor(p.grad._indices(), p.grad._values() * scale,
                                             p.grad.shape, is_coalesced=p.grad.is_coalesced())
        else:
            p.grad.mul_(scale)


def squared_norm(grads: List[Tensor], layout: ShardLayout) -> Tensor:
    """Σ of the squared entries of the FULL tables whose column slices' gradients are ``grads``
    (sparse or dense): the local squares summed over the shard group (float32)."""
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:
        v = g.coalesce()._values() if g.is_sparse else g
        local = local + v.float().square().sum()
    dist.all_reduce(local, group=layout.group)
    return local


def sharded_state(full: Tensor, param: Tensor) -> bool:
    """Whether an optimizer-state tensor is the full-table form of split parameter ``param``."""
    layout = getattr(param, SHARD_TAG)
    return (torch.is_tensor(full) and full.dim() == 2 and full.size(0) == param.size(0)
            and full.size(1) == param.size(1) * layout.size)

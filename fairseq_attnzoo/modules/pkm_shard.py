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
NCCL); the per-rank bag is :class:`~.pkm_values.ValueTable`'s read (sparse or dense gradients, the Triton
kernels on CUDA) on the local column slice.

Gradient convention (data parallelism averages over ranks): the local gradient is the sum over
the tokens of the shard group; :func:`finish_gradients` sums it over the replicas of this column
slice (when the shard group is smaller than the data-parallel world; a sparse gradient through
:func:`all_reduce_sparse_rows`) and divides by the data-parallel world size, as a DDP wrapper does
for every other parameter. :func:`grad_norm` is the norm of the whole tables (a slice's squares
summed over its group), the same on every rank: clipping, and a loss scaler's overflow check,
decide alike everywhere.

Mixed precision: a trainer that steps fp32 master copies of a half model (fairseq's
``FP16Optimizer``: one copy per parameter, or one flat buffer) learns where the split tables lie
in them from :func:`describe_masters`; the norm and the optimizer state then treat those parts as
the slices they copy.

State dicts hold the full table (``weight`` [|K|, d]) so that a checkpoint loads at any world
size: saving gathers the columns to the group's first rank, one table at a time (every rank of
the group must call ``state_dict``); loading keeps this rank's columns of a full table. The
optimizer state of a split table (or of a master holding one) goes the same way:
:func:`whole_state` gathers it, :func:`local_state` keeps this rank's part.

The sparse-row exchange of the tables that are NOT split (:func:`all_reduce_sparse_rows`: every
rank holds the whole table and sends the rows its tokens read) lives here too: the replicas of a
split slice use it.

Plain PyTorch (``torch.distributed``), usable without fairseq.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn
from torch import Tensor

from .pkm_values import VALUES_GROUP, ValueTable, mark_sparse

#: the attribute that marks a split value table's parameter (its :class:`ShardLayout`) and, on an
#: fp32 master copy, the split parts it holds (:func:`describe_masters`)
_LAYOUT, _PARTS = "_pkm_shard_layout", "_pkm_shard_parts"

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
    """A :class:`~.pkm_values.ValueTable` whose columns are split over ``layout.group``: ``weight`` is
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
        setattr(self.weight, _LAYOUT, layout)
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


# ---- where the split tables lie: in the model, and in fp32 master copies of it -------------------

@dataclass(frozen=True)
class _Part:
    """A column slice [rows, cols] of a table split by ``layout``, stored as the elements
    [start, start + rows·cols) of a parameter's flattened data."""

    start: int
    rows: int
    cols: int
    layout: ShardLayout

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.cols


def _parts(p) -> List[_Part]:
    layout = getattr(p, _LAYOUT, None)
    if layout is not None:  # a split table's own parameter: one part, all of it
        return [_Part(0, p.size(0), p.size(1), layout)]
    return getattr(p, _PARTS, [])


def is_split(p) -> bool:
    """Whether ``p`` is a column slice of a split table, or an fp32 master copy holding some."""
    return bool(_parts(p))


def describe_masters(params: List[Tensor], masters) -> None:
    """Record on ``masters`` -- fp32 copies of the parameters ``params`` that a mixed-precision
    trainer steps: one per parameter (a list in the same order), or ``{device index: flat
    buffer}`` holding the parameters of that device that require gradients, one after another
    (the two layouts of fairseq's ``FP16Optimizer``) -- where the split tables' slices lie."""
    if isinstance(masters, dict):
        offsets = dict.fromkeys(masters, 0)
        parts: Dict[object, List[_Part]] = {device: [] for device in masters}
        for p in params:
            device = p.device.index
            if not p.requires_grad or device not in masters:
                continue
            parts[device] += [_Part(offsets[device] + q.start, q.rows, q.cols, q.layout)
                              for q in _parts(p)]
            offsets[device] += p.numel()
        for device, flat in masters.items():
            if parts[device]:
                setattr(flat, _PARTS, parts[device])
    else:  # a master of a split table is a split table's parameter, as the table's is
        for p, master in zip(params, masters):
            if getattr(p, _LAYOUT, None) is not None:
                setattr(master, _LAYOUT, getattr(p, _LAYOUT))


def _pieces(t: Tensor, parts: List[_Part]) -> List[Tuple[Tensor, Optional[_Part]]]:
    """``t`` (a parameter's data, gradient or optimizer state) flattened and cut at ``parts``:
    [(piece, its part, or None for the elements between parts)], in order; a part's piece as its
    [rows, cols] view."""
    flat, out, at = t.reshape(-1), [], 0
    for q in parts:
        if q.start > at:
            out.append((flat[at:q.start], None))
        out.append((flat[q.start:q.stop].view(q.rows, q.cols), q))
        at = q.stop
    if at < flat.numel():
        out.append((flat[at:], None))
    return out


# ---- gradients: the mean over ranks, and the norm of the whole tables -------------------------

def finish_gradients(params: Iterable[Tensor]):
    """After the last backward of an update: each split table's gradient (the sum over its shard
    group's tokens) summed over the replicas of its columns and divided by the data-parallel
    world size -- the mean over ranks a DDP wrapper makes of every other gradient."""
    for p in params:
        layout = getattr(p, _LAYOUT, None)
        if layout is None or p.grad is None:
            continue
        replicas = layout.world // layout.size
        scale = 1.0 / layout.world
        if layout.replicas is not None and replicas > 1:
            if p.grad.is_sparse:  # (the exchange returns the mean over the replicas)
                p.grad = all_reduce_sparse_rows(p.grad, layout.replicas, replicas, "gather")[0]
                scale = 1.0 / layout.size
            else:
                dist.all_reduce(p.grad, group=layout.replicas)
        if p.grad.is_sparse:
            p.grad = torch.sparse_coo_tensor(p.grad._indices(), p.grad._values() * scale,
                                             p.grad.shape, is_coalesced=p.grad.is_coalesced(),
                                             check_invariants=False)  # (the gradient's own)
        else:
            p.grad.mul_(scale)


def _norm(tensors: List[Tensor], device) -> Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]))


def grad_norm(params: Iterable[Tensor], aggregate=None) -> Tensor:
    """The L2 norm (float32) of the gradients of ``params`` that one process would compute over
    the whole tables: a split slice's squares summed over its shard group (a collective: every
    rank of the groups calls it with the same parameters), the rest local (identical on every
    rank once the data-parallel all-reduce ran; ``aggregate``, if given, maps that part's norm,
    e.g. fairseq's reduction over model-parallel ranks). Sparse gradients count their coalesced
    values. So the norm, the clipping and a loss scaler's overflow check (an inf or NaN in any
    rank's slice) are the same on every rank."""
    local: List[Tensor] = []
    split: Dict[int, Tuple[ShardLayout, List[Tensor]]] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        device, parts = g.device, _parts(p)
        if g.is_sparse:  # (only a split table's own parameter has a sparse gradient)
            pieces = [(coalesced(g)._values(), parts[0] if parts else None)]
        else:
            pieces = _pieces(g, parts)
        for piece, part in pieces:
            if part is None:
                local.append(piece)
            else:
                split.setdefault(id(part.layout.group), (part.layout, []))[1].append(piece)
    if device is None:
        return torch.zeros((), dtype=torch.float32)
    rest = _norm(local, device)
    if aggregate is not None and local:
        rest = aggregate(rest)
    total = rest.float() ** 2
    for layout, pieces in split.values():
        squares = _norm(pieces, device) ** 2
        dist.all_reduce(squares, group=layout.group)
        total = total + squares.to(total.device)
    return total.sqrt()


def clip_grads_(params: Iterable[Tensor], norm: Tensor, max_norm: float):
    """Scale the gradients of ``params`` (whose norm, :func:`grad_norm`, is ``norm``) to at
    most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does; a sparse gradient's values."""
    coef = (float(max_norm) / (norm + 1e-6)).clamp_(max=1)
    for p in params:
        if p.grad is not None:
            g = p.grad._values() if p.grad.is_sparse else p.grad
            g.mul_(coef.to(g.dtype))


# ---- optimizer state in the whole tables' form -------------------------------------------------

def whole_state(p: Tensor, value):
    """Optimizer state ``value`` of ``p`` (a tensor shaped like ``p``) in the form it has for the
    whole tables: a split table's [rows, cols] state gathered to [rows, cols·G], a master's flat
    state with each part gathered -- on the rank that saves (the first rank of the shard group
    holding data-parallel rank 0), on the CPU; ``value`` itself elsewhere and for anything else.
    A collective of the shard group (one part at a time)."""
    parts = _parts(p)
    if not parts or not (torch.is_tensor(value) and value.shape == p.shape) or \
            not parts[0].layout.saves:
        return value
    pieces = [piece if part is None else gather_columns(piece, part.layout)  # (every part)
              for piece, part in _pieces(value, parts)]
    if any(piece is None for piece in pieces):  # not the group's first rank
        return value
    if getattr(p, _LAYOUT, None) is not None:
        return pieces[0].cpu()
    return torch.cat([t.reshape(-1) for t in pieces]).cpu()


def local_state(p: Tensor, value):
    """This rank's part of optimizer state ``value`` of ``p`` given in the whole tables' form
    (:func:`whole_state`'s, saved at any world size); ``value`` itself when it is not in that
    form (this run's own, or not a tensor)."""
    parts = _parts(p)
    if not parts or not torch.is_tensor(value):
        return value
    if getattr(p, _LAYOUT, None) is not None:
        layout = parts[0].layout
        whole = (value.dim() == 2 and value.size(0) == p.size(0)
                 and value.size(1) == p.size(1) * layout.size and layout.size > 1)
        return split_columns(value, layout) if whole else value
    grown = sum(q.rows * q.cols * (q.layout.size - 1) for q in parts)
    if value.dim() != 1 or not grown or value.numel() != p.numel() + grown:
        return value
    out, at = [], 0  # (at: the position in the whole form)
    for piece, part in _pieces(torch.empty(p.numel(), device="meta"), parts):
        if part is None:
            out.append(value[at:at + piece.numel()])
            at += piece.numel()
        else:
            size = part.rows * part.cols * part.layout.size
            out.append(split_columns(value[at:at + size].view(part.rows, -1),
                                     part.layout).reshape(-1))
            at += size
    return torch.cat(out)


# ---- the rows a sparse gradient read, exchanged between ranks ---------------------------------

#: how :func:`all_reduce_sparse_rows` exchanges the rows (``auto``: the one that moves fewer bytes)
EXCHANGES = ("auto", "gather", "all_reduce")


def coalesced(grad: Tensor) -> Tensor:
    """A coalesced view of a sparse gradient (duplicate rows summed). PKM's gradients already
    have sorted distinct rows but autograd drops the flag; checking is O(nnz) where coalescing
    sorts and copies the values. Accumulated gradients (--update-freq > 1) are really coalesced."""
    if grad.is_coalesced():
        return grad
    rows = grad._indices()[0]
    if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
        return torch.sparse_coo_tensor(grad._indices(), grad._values(), grad.shape,
                                       is_coalesced=True, check_invariants=False)
    return grad.coalesce()


def _rows_of(grad: Tensor):
    """(rows, values) of a value-table gradient: sparse, or dense (a table that no read touched
    on this rank gets a dense zero gradient from fairseq's legacy DDP)."""
    if grad.is_sparse:
        grad = coalesced(grad)
        return grad._indices()[0], grad._values()
    rows = grad.abs().sum(-1).nonzero().squeeze(1)
    return rows, grad.index_select(0, rows)


def all_reduce_sparse_rows(grad: Tensor, group=None, world_size: Optional[int] = None,
                           method: str = "auto"):
    """Average a row-sparse gradient [R, d] over the ranks of ``group``; returns (the coalesced
    sparse mean over the union of the rows read on any rank, the bytes this rank received).

    Two exchanges, same result (both NCCL- and gloo-safe, no object collectives):

    * ``gather``: rows and gradients all-gathered (padded to the longest list) and summed in rank
      order into the sorted union of rows, one ``index_add_`` over distinct rows per rank, so every
      rank gets the same bits. Receives (W-1)·U_max·(8 + 4d) bytes.
    * ``all_reduce``: the rows scattered into a dense [|K|, d + 1] buffer whose last column counts
      the ranks that read the row, then one all-reduce: ≈ 2(W-1)/W·|K|·(d + 1)·4 bytes, the dense
      all-reduce's cost, paid when many rows are read.

    ``auto`` takes the one that receives fewer bytes (every rank decides from the same all-gathered
    row counts)."""
    if method not in EXCHANGES:
        raise ValueError(f"--pkm-exchange must be one of {', '.join(EXCHANGES)}, got {method!r}")
    world = world_size or dist.get_world_size(group)
    rows, vals = _rows_of(grad)
    device = vals.device
    size, d = grad.shape
    count = torch.tensor([rows.numel()], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    longest = max(counts)
    received = (world - 1) * 8
    gather_bytes = (world - 1) * longest * (8 + d * vals.element_size())
    reduce_bytes = int(2 * (world - 1) / world * size * (d + 1) * vals.element_size())
    if method == "auto":
        method = "gather" if gather_bytes <= reduce_bytes else "all_reduce"
    if longest == 0:  # no rank read anything
        union, total = rows.new_zeros(0), vals.new_zeros(0, d)
    elif method == "gather":
        received += gather_bytes
        padded_rows = rows.new_zeros(longest)
        padded_rows[: rows.numel()] = rows
        padded_vals = vals.new_zeros(longest, d)
        padded_vals[: rows.numel()] = vals
        all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
        all_vals = [torch.empty_like(padded_vals) for _ in range(world)]
        dist.all_gather(all_rows, padded_rows, group=group)
        dist.all_gather(all_vals, padded_vals, group=group)
        all_rows = [r[:n] for r, n in zip(all_rows, counts)]
        union = torch.unique(torch.cat(all_rows))  # sorted
        total = vals.new_zeros(union.numel(), d)
        for r, v, n in zip(all_rows, all_vals, counts):
            total.index_add_(0, torch.searchsorted(union, r), v[:n])
    else:
        received += reduce_bytes
        buf = vals.new_zeros(size, d + 1)
        buf[rows, :d] = vals
        buf[rows, d] = 1  # "read on this rank": a read row with a zero gradient still counts
        dist.all_reduce(buf, group=group)
        union = buf[:, d].nonzero().squeeze(1)
        total = buf[union, :d]
    total.div_(world)
    out = torch.sparse_coo_tensor(union.unsqueeze(0), total, grad.shape, is_coalesced=True,
                                  check_invariants=False)
    return out, received

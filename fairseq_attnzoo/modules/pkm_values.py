"""The value read of the memory layer (:class:`.pkm.ProductKeyMemory`): m(x) = Σ_{i ∈ I} w_i v_i
over the slots I the search chose.

The value table V is an ``nn.EmbeddingBag(n_keys², v_dim, mode="sum")`` (:class:`ValueTable`)
read with per-sample weights (:class:`_WeightedRowSum`: the bag's forward, a backward that
returns one gradient row per distinct slot read), so only the k·heads selected rows get a
gradient; ``sparse=True`` makes that gradient a sparse tensor (needs an optimizer that takes
sparse gradients: ``--optimizer pkm_adam``). On CUDA the read and both of its gradients run as
fused Triton kernels (:mod:`.pkm_triton`; ``kernel=`` switches), with this PyTorch path as their
reference and as the CPU path; a table split over processes is :mod:`.pkm_shard`'s.

:class:`ValueRead` is the layer's part that holds the table (its own, or a pool another memory
owns), its init, dense or sparse gradients, and reads it through the kernels or the reference.

Imports torch only.
"""

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import pkm_triton

#: ``param_group`` tag of the value tables (fairseq's convention for per-group optimizer
#: settings; FP16Optimizer copies it onto its fp32 parameters). ``pkm_adam`` looks for it.
VALUES_GROUP = "pkm_values"


class _WeightedRowSum(torch.autograd.Function):
    """``out[n] = Σ_j w[n, j] · table[idx[n, j]]`` (an embedding bag) with a backward that visits
    the reads sorted by table row.

    ``nn.EmbeddingBag``'s own backward materialises one d-vector per read -- N·heads·knn rows,
    uncoalesced (1 GB at 4096 tokens, d = 512) -- and reads the table rows for the weight gradient
    in token order, i.e. at random. Here the reads are sorted by row once (one ``sort``), and
    both gradients are embedding-bag kernels over that order:

    * ∂/∂w[n, j] = ⟨grad[n], table[idx[n, j]]⟩ walks the table rows in increasing order (each read
      row streamed once, repeats adjacent) instead of at random;
    * the table gradient Σ_{idx[n,j] = r} w[n, j] · grad[n] is itself a bag over ``grad`` per
      row r: one bag per distinct row read (sparse: U × d, coalesced) or, for a dense gradient,
      one bag per table row, empty bags giving the zero rows -- the dense |K| × d gradient is
      written once, with no zero-fill and no scatter of a compact copy.

    ``keep`` [N] (bool, optional): the tokens whose reads count. With a sparse gradient the reads
    of the other tokens (pads, whose output the caller masks to 0) are not among its rows; a dense
    gradient needs nothing (their output gradient is 0). The sparse gradient holds the rows of the
    reads kept, found by ONE op sized by the data (``nonzero``: a host sync on CUDA; no ``bool()``
    of a loss that fairseq multiplied by 0: such a gradient drops every read the same way)."""

    @staticmethod
    def forward(ctx, table: Tensor, indices: Tensor, weights: Tensor, sparse: bool,
                fused: bool = False, keep: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(table, indices, weights, keep)
        ctx.sparse, ctx.fused = sparse, fused
        if fused:  # the Triton kernels (pkm_triton); this class is their reference
            return pkm_triton.read(table, indices, weights)
        return F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        table, indices, weights, keep = ctx.saved_tensors
        grad = grad.contiguous()
        n, m = indices.shape
        size = table.size(0)
        # a batch whose loss fairseq multiplied by 0 (the dummy batch a DDP rank runs when it
        # has fewer batches than the others, an OOM skip) reads no rows of a sparse gradient:
        # the lazy optimizer must not decay their moments, as one process would not. Per token:
        # a table split over processes reads the tokens of every rank at once, a dummy batch's
        # among them (a real token's output gradient is never exactly 0)
        sparse = ctx.sparse and ctx.needs_input_grad[0]
        dead = None
        if sparse:  # reads that count nowhere (sorted after every row, keyed row + |K|)
            dead = ~grad.any(-1)
            if keep is not None:
                dead = dead | ~keep
        if ctx.fused:  # the Triton kernels (the same rows, the same one sync)
            grad_table, grad_weights = pkm_triton.backward(
                grad, table, indices, weights, ctx.sparse, ctx.needs_input_grad[0],
                ctx.needs_input_grad[2], dead=dead)
            return grad_table, None, grad_weights, None, None, None
        keys, order = torch.sort(pkm_triton.dead_last(indices, dead, size, indices.dtype))
        # (keys: the table row of each read, ascending; dead reads last, keyed row + |K|)
        rows_read = keys.remainder(size) if sparse else keys
        token = order // m  # the bag (token) of each sorted read
        grad_table = grad_weights = None
        if ctx.needs_input_grad[2]:  # ∂/∂w[n, j] = ⟨grad[n], table[idx[n, j]]⟩, in row order
            sorted_grad = read_dots(grad, table, rows_read, token, n, m)
            grad_weights = torch.empty_like(sorted_grad).index_copy_(0, order, sorted_grad)
            grad_weights = grad_weights.view(n, m)
        if ctx.needs_input_grad[0]:
            w = weights.reshape(-1).index_select(0, order)
            if ctx.sparse:  # one bag per distinct row among the reads kept (keys < |K|)
                starts, offsets = pkm_triton.live_runs(keys, size)
                rows_grad = F.embedding_bag(token, grad, offsets, mode="sum",
                                            per_sample_weights=w, include_last_offset=True)
                grad_table = torch.sparse_coo_tensor(
                    keys.index_select(0, starts).long().unsqueeze(0), rows_grad, table.shape,
                    is_coalesced=True, check_invariants=False)
            else:  # bag r = the reads of row r (empty for unread rows -> zero row)
                starts = pkm_triton.row_ranges(rows_read, table.size(0))[0]
                grad_table = F.embedding_bag(token, grad, starts, mode="sum",
                                             per_sample_weights=w)
        return grad_table, None, grad_weights, None, None, None


def read_dots(grad: Tensor, table: Tensor, rows: Tensor, token: Tensor, n: int, m: int,
              kernel: Optional[bool] = None) -> Tensor:
    """⟨grad[token_i], table[rows_i]⟩ for each of the n·m reads i (in the given order).

    ATen's embedding-bag weight-gradient kernel, except where it does not exist -- bfloat16 on
    CUDA (``_embedding_bag_per_sample_weights_backward_cuda not implemented for 'BFloat16'``) --
    where the rows are gathered in chunks of ~16M elements and the dots taken in float32.
    ``kernel`` forces one path (tests)."""
    if kernel is None:
        kernel = not (table.is_cuda and table.dtype == torch.bfloat16)
    if kernel:
        offsets = torch.arange(0, n * m, m, device=grad.device)  # unused by mode "sum"
        return torch.ops.aten._embedding_bag_per_sample_weights_backward(
            grad, table, rows, offsets, token, 0, -1)
    out = torch.empty(rows.numel(), dtype=grad.dtype, device=grad.device)
    step = max(1, (1 << 24) // max(1, table.size(1)))
    for s in range(0, rows.numel(), step):
        r, t = rows[s: s + step], token[s: s + step]
        out[s: s + step] = (table[r].float() * grad[t].float()).sum(-1).to(out.dtype)
    return out


class ValueTable(nn.EmbeddingBag):
    """The value table V [|K|, v_dim] (an ``nn.EmbeddingBag``, same state-dict key ``weight``)
    with the weighted read the memory calls: :meth:`read`. A table split over processes
    (:class:`.pkm_shard.ShardedValueTable`) replaces it with the same ``read``."""

    def read(self, indices: Tensor, weights: Tensor, fused: bool,
             keep: Optional[Tensor] = None) -> Tensor:
        """``out[n] = Σ_j weights[n, j] · V[indices[n, j]]`` -> [N, v_dim]; ``keep`` [N] (bool):
        the real tokens, whose reads alone a sparse gradient holds."""
        return _WeightedRowSum.apply(self.weight, indices, weights.to(self.weight.dtype),
                                     self.sparse, fused, keep)


def value_table(size: int, v_dim: int, sparse: bool = False) -> nn.EmbeddingBag:
    """The value table V [|K|, v_dim] of one memory, or of a pool shared by several memories."""
    table = ValueTable(size, v_dim, mode="sum")
    table.weight.param_group = VALUES_GROUP
    mark_sparse(table, sparse)
    return table


def mark_sparse(table: nn.EmbeddingBag, sparse: bool):
    """Switch a value table between dense and sparse (row) gradients.

    Sparse tables are tagged ``pkm_sparse`` (``pkm_adam`` exchanges their rows across processes
    and updates them lazily) and ``expert``: fairseq's tag for parameters that its legacy DDP
    wrapper must not all-reduce (the zoo models also hand these names to PyTorch DDP to ignore),
    as is a table split over processes (``split``, :mod:`.pkm_shard`) either way."""
    table.sparse = bool(sparse)
    table.weight.pkm_sparse = bool(sparse)
    if sparse or getattr(table, "split", False):  # a table split over processes: always
        table.weight.expert = True
    elif hasattr(table.weight, "expert"):
        del table.weight.expert


class ValueRead:
    """The value read of :class:`.pkm.ProductKeyMemory` (a part of it, read on its own): the
    table V [|K|, v_dim] (:meth:`_init_values`: its own, or a pool that another memory owns,
    ``owns_values``; :meth:`reset_values` initialises its own), dense or sparse gradients
    (:attr:`sparse`), and the weighted read of the slots the search chose (:meth:`read_slots`,
    the Triton kernels or the reference as ``kernel`` says; in eval mode it reports the reads to
    ``usage_callback``). It reads the module's ``size``, ``v_dim`` and ``kernel``."""

    def _init_values(self, values: Optional[nn.EmbeddingBag], sparse: bool):
        #: False when ``values`` is another memory's table (shared pool): not registered here, so
        #: it appears once among the model's parameters and once in its state dict
        self.owns_values = values is None
        if values is None:
            self.values = value_table(self.size, self.v_dim, sparse)
        else:
            shape = (values.num_embeddings, values.embedding_dim)  # of a split table too
            if shape != (self.size, self.v_dim):
                raise ValueError(f"a shared PKM value table must be [n_keys² = {self.size}, "
                                 f"v_dim = {self.v_dim}], got {list(shape)}")
            object.__setattr__(self, "values", values)  # a reference, not a submodule
        #: called as ``fn(indices [N, heads·knn], weights [N, heads·knn])`` after every read in
        #: eval mode (usage diagnostics); None = off
        self.usage_callback: Optional[Callable[[Tensor, Tensor], None]] = None
        self.sparse = sparse

    @property
    def sparse(self) -> bool:
        return self.values.sparse

    @sparse.setter
    def sparse(self, value: bool):
        mark_sparse(self.values, value)

    def reset_values(self):
        if self.owns_values:  # a shared table is initialised once, by its owner
            nn.init.normal_(self.values.weight, 0.0, self.v_dim ** -0.5)

    def read_slots(self, indices: Tensor, weights: Tensor, keep: Optional[Tensor] = None
                   ) -> Tensor:
        """Σ_j weights[n, j] · V[indices[n, j]] -> [N, v_dim] for the search's (weights,
        indices) [N, H·knn], in the table's dtype; ``keep`` [N] (bool): the real tokens (the
        others' rows are garbage, which the caller masks)."""
        out = self.values.read(indices, weights,
                               pkm_triton.use_value_kernel(self.kernel, self.values.weight), keep)
        if not self.training and self.usage_callback is not None:
            weights = weights if keep is None else torch.where(keep.unsqueeze(1), weights, 0.0)
            self.usage_callback(indices.detach(), weights.detach())
        return out

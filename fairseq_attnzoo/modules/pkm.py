"""Product-key memory (PKM; Lample et al., 2019, "Large Memory Layers with Product Keys").

A sparse key-value memory with |K| = n_keys² slots that replaces a position-wise FFN. For every
token and head, the query q(x) (a linear map, optionally batch-normalised) is split in two halves
q¹, q²; each half is scored against its own set of n_keys sub-keys. The product key (a, b) has
score ⟨q¹, c_a⟩ + ⟨q², c'_b⟩, so the top-k product keys are among the k × k pairs of the two
per-half top-k lists -- an exact search over n_keys² keys at the cost of 2·n_keys dot products::

    I_1 = top_k(q¹ C), I_2 = top_k(q² C'),  I = top_k{ ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ : a ∈ I_1, b ∈ I_2 }
    w = softmax over I of the scores,        m(x) = Σ_{i ∈ I} w_i v_i      (summed over heads)

The value table is an ``nn.EmbeddingBag(n_keys², v_dim, mode="sum")`` read with per-sample weights
(:class:`_WeightedRowSum`: the bag's forward, a backward that returns one gradient row per distinct
slot read), so only the k·heads selected rows get a gradient; ``sparse=True`` makes that gradient a
sparse tensor (needs an optimizer that takes sparse gradients: ``--optimizer pkm_adam``). On CUDA
the read and both of its gradients run as fused Triton kernels (:mod:`.pkm_triton`; ``kernel=``
switches), with this PyTorch path as their reference and as the CPU path.

Choices (XLM's ``pq_fast`` memory is the reference; this is an independent implementation):

* keys: per head two learned sets [n_keys, k_dim/2], uniform(±1/√(k_dim/2)) like ``nn.Linear``;
  values: N(0, v_dim^-½); query network: ``Linear(d, heads·k_dim)`` (+ BatchNorm1d).
* padding: padded positions are masked (no op sized by the data: no host sync on CUDA, one graph
  under ``torch.compile``), or on the CPU removed (:data:`SKIP_PADS_ON`): either way they do not
  enter the batch-norm statistics, add nothing to any gradient (no row of a sparse value
  gradient), and output zeros. (XLM's batch norm counts pads, which is why it only supports
  unpadded stream batches.)
* position-wise: in eval mode (running batch-norm statistics) a token's output depends on that
  token only, so incremental decoding needs no cache.

Memory+ options (Berges et al., 2024, "Memory Layers at Scale"; independent implementation):

* ``values=<another memory's table>``: several memories read ONE value table (the memory code's
  ``mem_share_values``, on in ``apps/main/configs/pkplus_373m_1024k.yaml``), each with its own
  query network and sub-keys. The first memory owns (registers, initialises, checkpoints) the
  table; the others hold a plain reference.
* ``swilu="reference"``: the SiLU-gated ("swilu") output of facebookresearch/memory,
  ``out = Drop_v(W₂(m(x̃) ⊙ SiLU(W₁ x̃)))`` with x̃ = Drop_in(x) the input after input dropout, W₁:
  d -> v_dim and W₂: v_dim -> d_out both with biases, weights N(0, d_out^-½).
  ``swilu="legacy"`` (``gated=True``): this project's form before issue 23, kept so that its
  checkpoints rebuild the same function: no biases, nn.Linear's init, gate on the undropped input,
  value dropout on m(x) before W₂.
* ``init="memplus"``: the reference code's other inits -- sub-keys uniform(±1/√k_dim), query
  weight Xavier-uniform (``init="xlm"``: uniform(±1/√(k_dim/2)) and nn.Linear's init).
* ``qk_norm=True`` (ours: the reference code has none, and what the paper says about qk-norm was
  not verified here): each half-query RMS-normalised with a learned gain g (init 1), each sub-key
  scaled to unit L2 norm, so a half score is ``⟨g ⊙ q/rms(q), c/‖c‖⟩`` (computed in fp32).
"""

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import pkm_search_triton, pkm_triton
from .constants import cached_constant
from .feedforward import ZooFeedForward
from .precision import Float32Module, compute_dtype, float32_region

#: ``param_group`` tag of the value tables (fairseq's convention for per-group optimizer
#: settings; FP16Optimizer copies it onto its fp32 parameters). ``pkm_adam`` looks for it.
VALUES_GROUP = "pkm_values"

#: output forms: plain m(x); the reference's SiLU-gated "swilu" output; this project's pre-issue-23
#: gated output (kept for its checkpoints)
SWILU_FORMS = ("off", "reference", "legacy")
#: initialisations: XLM's (Lample et al.) or facebookresearch/memory's (Memory+)
INITS = ("xlm", "memplus")


def product_topk(q1: Tensor, q2: Tensor, keys1: Tensor, keys2: Tensor, knn: int
                 ) -> Tuple[Tensor, Tensor]:
    """Exact top-k over the n_keys² product keys, per head.

    q1, q2 ``[H, N, k_dim/2]``; keys1, keys2 ``[H, n_keys, k_dim/2]`` -> scores, indices
    ``[H, N, knn]`` (sorted, largest first; index = a·n_keys + b, int32). Scores are
    differentiable with respect to queries and keys (:class:`_ProductTopk`, which takes both
    halves joined and answers token-major: :meth:`ProductKeyMemory.lookup` calls it directly)."""
    scores, indices = _ProductTopk.apply(torch.cat([q1, q2], -1), torch.stack([keys1, keys2], 1),
                                         knn)
    return scores.transpose(0, 1), indices.transpose(0, 1)


class _ProductTopk(torch.autograd.Function):
    """``(query [H, N, k_dim], keys [H, 2, n_keys, k_dim/2], knn) -> scores, indices [N, H, knn]``:
    half-query i of ``query`` is scored against ``keys[:, i]``; the answer is token-major, the
    layout of the value read (no transposed copies of either). Indices are int32 from the
    per-half top-k on (slot ids < 2³¹; half the bytes of every gather, stack and saved tensor
    after it); only ``scatter_add_``, which takes int64 indices alone, gets an int64 copy.

    Forward: the search runs without autograd, in chunks of tokens whose [H, chunk, n_keys] scores
    stay cache-resident between their GEMM and their top-k (on CUDA one chunk, so no per-chunk
    launches and no copies into preallocated outputs). Backward: straight to the knn chosen
    sub-key pairs. Score (a, b) = ⟨q¹, c_a⟩ + ⟨q², c'_b⟩, so with g = ∂L/∂score:

        ∂L/∂q¹ = Σ_j g_j c_{a_j}    (an embedding bag over the sub-keys: knn reads a token)
        ∂L/∂C  = Gᵀ q¹              (G [N, n_keys] = g scattered to the chosen a_j; a GEMM)

    and the same for the second half. Both half-query gradients are one embedding bag whose bags
    are ordered (token, head, half), so its output is the query gradient already in the query
    net's [N, H·k_dim] layout (no slice/transpose copies to join them). The sub-key gradient
    scatters g into one [H, N, n_keys] buffer per half, re-zeroed for the second (the size of
    the forward's score block for one half, so the backward needs no more scratch than the
    forward did), and multiplies it with the half-queries in one batched GEMM per half. Stock
    autograd instead back-propagates through the candidate gather, the second top-k and the
    first top-k (three zero-fills and scatters, one of them [H, N, n_keys]) and then runs both
    bmm backward products on that dense gradient."""

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, knn: int):
        h, n, _ = query.shape
        n_keys, half = keys.size(2), keys.size(3)
        a, b = _candidate_pairs(knn, query.device)
        keys_t = keys.transpose(2, 3)  # [H, 2, half, n_keys]
        # CPU: cache-sized chunks; GPU: one chunk (no per-chunk kernel launches)
        chunk = n if query.is_cuda else max(1, _SCORE_CHUNK // (h * n_keys))
        parts = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            # per half: [H, c, n_keys] scores -> sorted top-knn values and (int32) sub-key ids,
            # read token-major [c, H, knn] from here on
            (s1, i1), (s2, i2) = (
                (top.values.transpose(0, 1), top.indices.transpose(0, 1).to(torch.int32))
                for top in (torch.bmm(query[:, s:e, i * half:(i + 1) * half], keys_t[:, i])
                            .topk(knn, dim=-1) for i in range(2)))
            # the overall top-k is among the pairs (a, b) of the two sorted lists; pair (a, b)
            # is beaten by every (a' <= a, b' <= b), so only pairs with (a+1)(b+1) <= knn can
            # make it (~k·ln k of the k² pairs: 119 of 1024 for k = 32)
            # (gather with an expanded index / index_select: faster than advanced indexing)
            cand = (s1.gather(-1, a.expand(e - s, h, -1))
                    + s2.gather(-1, b.expand(e - s, h, -1)))  # ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩
            best_s, best = cand.topk(knn, dim=-1)
            best_flat = best.view(-1)
            sub1 = i1.gather(-1, a.index_select(0, best_flat).view_as(best))  # chosen sub-keys
            sub2 = i2.gather(-1, b.index_select(0, best_flat).view_as(best))
            parts.append((best_s, torch.add(sub2, sub1, alpha=n_keys),  # slot a·n_keys + b
                          torch.stack([sub1, sub2], 2)))
        scores, indices, sub = (parts[0] if len(parts) == 1 else
                                [torch.cat(p) for p in zip(*parts)])
        ctx.save_for_backward(query, keys, sub)  # sub [N, H, 2, knn]: the chosen a, b
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)  # (no zero gradient of the indices is made)
        return scores, indices

    @staticmethod
    def backward(ctx, grad: Optional[Tensor], _):
        if grad is None:
            return None, None, None
        query, keys, sub = ctx.saved_tensors
        n, h, _, k = sub.shape
        n_keys, half = keys.size(2), keys.size(3)
        g = grad.to(keys.dtype)  # [N, H, knn]
        grad_query = grad_keys = None
        if ctx.needs_input_grad[0]:  # Σ_j g_j c_{sub_j}; bag (n, h, i) reads keys[h, i]
            rows = sub + _set_offsets(h, n_keys, sub.device)
            weights = g.unsqueeze(2).expand(n, h, 2, k)
            grad_query = F.embedding_bag(rows.view(-1, k), keys.reshape(-1, half), mode="sum",
                                         per_sample_weights=weights.reshape(-1, k))
            grad_query = grad_query.view(n, h, 2 * half).transpose(0, 1)
        if ctx.needs_input_grad[1]:  # Gᵀ q per half, all heads at once (a sub-key chosen
            dense = g.new_empty(h, n, n_keys)  # twice gets both g)
            grad_keys = []
            for i in range(2):  # (scatter_add_ takes int64 indices only)
                dense.zero_().scatter_add_(-1, sub[:, :, i].transpose(0, 1).long(),
                                           g.transpose(0, 1))
                grad_keys.append(torch.bmm(dense.transpose(1, 2),
                                           query[:, :, i * half:(i + 1) * half].to(keys.dtype)))
            grad_keys = torch.stack(grad_keys, 1)
        return grad_query, grad_keys, None


#: devices where :meth:`ProductKeyMemory.forward` removes the pads (a ``nonzero``, no sync on
#: the host's own device; the pads' query, search and read are skipped: measured faster on the
#: CPU) instead of masking them (everywhere else, and under torch.compile)
SKIP_PADS_ON = ("cpu",)

#: elements of one CPU chunk of search scores [H, chunk, n_keys] (4 MB in float32; 512 tokens
#: at H = 4, n_keys = 512: chunks of 128-1024 tokens time alike, ahead of one [H, N, n_keys] block)
_SCORE_CHUNK = 1 << 20


def candidate_pairs(knn: int) -> Tuple[list, list]:
    """The pairs (a, b) of places in the two sorted per-half top-knn lists that can hold one of
    the knn best product keys, (a+1)(b+1) <= knn, as two lists of ints (row-major: a, then b).
    Their number is known from knn alone (Σ_a ⌊knn/(a+1)⌋), so no op sizes anything by data."""
    pairs = [(a, b) for a in range(knn) for b in range(knn // (a + 1))]
    return [a for a, _ in pairs], [b for _, b in pairs]


@cached_constant
def _candidate_pairs(knn: int, device) -> Tuple[Tensor, Tensor]:
    """:func:`candidate_pairs` as two int64 tensors on ``device`` (``gather`` takes int64
    indices only), made once: a constant, no ``nonzero`` (a host sync on CUDA, a graph break
    under ``torch.compile``)."""
    a, b = candidate_pairs(knn)
    return (torch.tensor(a, dtype=torch.int64, device=device),
            torch.tensor(b, dtype=torch.int64, device=device))


@cached_constant
def _set_offsets(heads: int, n_keys: int, device) -> Tensor:
    """[1, H, 2, 1] int32: the first row of sub-key set (head, half) in the flattened sub-keys
    (an arange kernel per layer and backward otherwise)."""
    return torch.arange(0, heads * 2 * n_keys, n_keys, dtype=torch.int32,
                        device=device).view(1, heads, 2, 1)


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
        # the lazy optimizer must not decay their moments, as one process would not
        sparse = ctx.sparse and ctx.needs_input_grad[0]
        dead = None
        if sparse:  # reads that count nowhere (sorted after every row, keyed row + |K|)
            dead = ~grad.any().expand(n)
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


def slot_counts(indices: Tensor, weights: Tensor, size: int) -> Tensor:
    """Z_i = Σ_x w(x)_i: total softmax weight each slot received (float64, length ``size``)."""
    return torch.bincount(indices.reshape(-1), weights=weights.reshape(-1).double(), minlength=size)


def usage_stats(counts: Tensor) -> Tuple[float, float]:
    """XLM's diagnostics (``eval_memory_usage`` in ``xlm/evaluation/evaluator.py``: ``mem_used``,
    ``mem_kl_w``) from slot weights Z: memory usage (fraction of slots with Z_i > 0) and
    KL(z ‖ uniform) with z = Z / ΣZ (0 = perfectly uniform; log N = a single slot)."""
    counts = counts.double()
    n = counts.numel()
    total = counts.sum()
    if total <= 0:
        return 0.0, 0.0
    z = counts[counts > 0] / total
    return float((counts > 0).sum()) / n, float((z * (z * n).log()).sum())


class Float32BatchNorm1d(Float32Module, nn.BatchNorm1d):
    """BatchNorm1d whose statistics, parameters and running averages stay float32 inside an
    fp16/bf16 model (as fairseq's ``Fp32BatchNorm``); input and output keep the caller's dtype.
    Same state-dict keys as ``nn.BatchNorm1d``; ``keep_float32``: the float32 output as it is."""

    def forward(self, x: Tensor, keep_float32: bool = False) -> Tensor:
        with float32_region(x.device):
            out = super().forward(x.float())
        return out if keep_float32 else out.to(x.dtype)

    def masked(self, x: Tensor, keep: Tensor) -> Tensor:
        """Training-mode batch norm of x [N, C] over the rows that ``keep`` [N] (bool) marks, in
        float32 (the output is float32): the statistics, their gradient and the running averages
        are those of the kept rows alone, as if the others were not there, with no op sized by
        the data. Fewer than two kept rows: the running statistics, which stay as they are (the
        unpadded path does the same with a batch of one token)."""
        with float32_region(x.device):
            rows = keep.unsqueeze(1)
            x = torch.where(rows, x.float(), 0.0)
            count = keep.sum()
            n = count.clamp(min=1).to(x.dtype)
            mean = x.sum(0) / n
            var = torch.where(rows, x - mean, 0.0).square().sum(0) / n
            enough = count >= 2
            if self.track_running_stats and self.running_mean is not None:
                with torch.no_grad():
                    self.num_batches_tracked.add_(enough.to(self.num_batches_tracked.dtype))
                    factor = (self.momentum if self.momentum is not None
                              else 1.0 / self.num_batches_tracked.clamp(min=1).to(x.dtype))
                    factor = torch.where(enough, factor, 0.0)
                    unbiased = var * n / (n - 1).clamp(min=1)
                    self.running_mean.lerp_(mean.detach(), factor)
                    self.running_var.lerp_(unbiased.detach(), factor)
                    use_batch = enough
            else:
                use_batch = torch.ones_like(enough)
            if self.running_mean is not None:
                mean = torch.where(use_batch, mean, self.running_mean)
                var = torch.where(use_batch, var, self.running_var)
            out = (x - mean) * torch.rsqrt(var + self.eps)
            return out * self.weight + self.bias if self.affine else out


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


class ProductKeyMemory(ZooFeedForward):
    """Product-key memory layer: ``forward(x [T, B, d], padding_mask [B, T]) -> [T, B, d_out]``."""

    def __init__(self, input_dim: int, output_dim: Optional[int] = None, n_keys: int = 512,
                 heads: int = 4, knn: int = 32, k_dim: int = 256, v_dim: Optional[int] = None,
                 query_batchnorm: bool = True, input_dropout: float = 0.0,
                 query_dropout: float = 0.0, value_dropout: float = 0.0, sparse: bool = False,
                 values: Optional[nn.EmbeddingBag] = None, gated: bool = False,
                 qk_norm: bool = False, swilu: str = "off", init: str = "xlm",
                 kernel: str = "auto", residual_dropout: bool = False,
                 search_kernel: str = "torch"):
        super().__init__()
        #: whether a host layer applies its residual dropout to this layer's output (read by
        #: the fairseq layers); off, as in both references: XLM adds the memory's output to the
        #: residual undropped (``xlm/model/transformer.py``, where only the FFN's output is
        #: dropped), the memory code's Llama block has no dropout (``lingua/transformer.py``)
        self.residual_dropout = bool(residual_dropout)
        #: value read and its gradients: "auto" = the Triton kernels (pkm_triton) on CUDA when
        #: Triton is importable, else the PyTorch reference; "triton" / "torch" force one
        self.kernel = pkm_triton.check_kernel(kernel)
        #: the product-key search and its backward: "auto" = the fused Triton kernel
        #: (pkm_search_triton) on CUDA when it can run, else :class:`_ProductTopk`; "triton" /
        #: "torch" force one
        self.search_kernel = pkm_triton.check_kernel(search_kernel)
        if gated:  # the pre-issue-23 name of the legacy gated output
            swilu = "legacy" if swilu == "off" else swilu
        if swilu not in SWILU_FORMS:
            raise ValueError(f"PKM swilu must be one of {', '.join(SWILU_FORMS)}, got {swilu!r}")
        if init not in INITS:
            raise ValueError(f"PKM init must be one of {', '.join(INITS)}, got {init!r}")
        self.swilu, self.init = swilu, init
        output_dim = output_dim or input_dim
        v_dim = v_dim or output_dim
        if n_keys < 1 or heads < 1 or knn < 1 or v_dim < 1:
            raise ValueError("PKM n_keys, heads, knn and v_dim must be positive")
        if k_dim < 2 or k_dim % 2:
            raise ValueError(f"PKM k_dim must be even and >= 2 (two half-queries), got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"PKM knn ({knn}) cannot exceed n_keys ({n_keys})")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.n_keys, self.heads, self.knn, self.k_dim, self.v_dim = n_keys, heads, knn, k_dim, v_dim
        self.size = n_keys ** 2  # |K|
        self.input_dropout, self.query_dropout, self.value_dropout = (
            input_dropout, query_dropout, value_dropout)

        self.query_proj = nn.Linear(input_dim, heads * k_dim)  # q(x)
        self.query_bn = Float32BatchNorm1d(heads * k_dim) if query_batchnorm else None
        # qk-norm: the learned gain g of the RMS-normalised half-queries
        self.query_gain = nn.Parameter(torch.ones(heads * k_dim)) if qk_norm else None
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, k_dim // 2))  # C, C' per head
        #: False when ``values`` is another memory's table (shared pool): not registered here, so
        #: it appears once among the model's parameters and once in its state dict
        self.owns_values = values is None
        if values is None:
            self.values = value_table(self.size, v_dim, sparse)
        else:
            shape = (values.num_embeddings, values.embedding_dim)  # of a split table too
            if shape != (self.size, v_dim):
                raise ValueError(f"a shared PKM value table must be [n_keys² = {self.size}, "
                                 f"v_dim = {v_dim}], got {list(shape)}")
            object.__setattr__(self, "values", values)  # a reference, not a submodule
        if swilu != "off":  # Memory+: out = W₂(m(x̃) ⊙ SiLU(W₁ x̃)); biases in the reference
            bias = swilu == "reference"
            self.gate_proj = nn.Linear(input_dim, v_dim, bias=bias)  # W₁
            self.out_proj = None
            self.gate_out = nn.Linear(v_dim, output_dim, bias=bias)  # W₂
        else:
            self.gate_proj = self.gate_out = None
            self.out_proj = (nn.Linear(v_dim, output_dim, bias=False) if v_dim != output_dim
                             else None)
        #: called as ``fn(indices [N, heads·knn], weights [N, heads·knn])`` after every read in
        #: eval mode (usage diagnostics); None = off
        self.usage_callback: Optional[Callable[[Tensor, Tensor], None]] = None
        self.sparse = sparse
        self.reset_parameters()

    @property
    def sparse(self) -> bool:
        return self.values.sparse

    @sparse.setter
    def sparse(self, value: bool):
        mark_sparse(self.values, value)

    @property
    def gated(self) -> bool:
        return self.gate_proj is not None

    @property
    def qk_norm(self) -> bool:
        return self.query_gain is not None

    def reset_parameters(self):
        # XLM: uniform(±1/√(k_dim/2)), nn.Linear's rule for a sub-key; memory: ±1/√k_dim
        bound = 1 / math.sqrt(self.k_dim if self.init == "memplus" else self.k_dim // 2)
        nn.init.uniform_(self.keys, -bound, bound)
        if self.owns_values:  # a shared table is initialised once, by its owner
            nn.init.normal_(self.values.weight, 0.0, self.v_dim ** -0.5)
        self.query_proj.reset_parameters()
        if self.init == "memplus":  # facebookresearch/memory: Xavier-uniform query weight
            nn.init.xavier_uniform_(self.query_proj.weight)
        if self.query_bn is not None:
            self.query_bn.reset_parameters()
        if self.query_gain is not None:
            nn.init.ones_(self.query_gain)
        for lin in (self.gate_proj, self.gate_out):
            if lin is not None:
                lin.reset_parameters()  # legacy: nn.Linear's init; reference: biases keep it
                if self.swilu == "reference":  # W₁, W₂ ~ N(0, d_out^-½) as in the reference
                    nn.init.normal_(lin.weight, 0.0, self.output_dim ** -0.5)

    # ---- the memory read ---------------------------------------------------------------------
    def query(self, x: Tensor, dropped: bool = False, keep: Optional[Tensor] = None) -> Tensor:
        """[N, d] -> per-head queries [H, N, k_dim] in float32, the search's precision: the batch
        norm's float32 output goes on as it is, not rounded through the model's dtype and cast
        back (two copies each way in half precision). ``dropped``: input dropout already done.
        ``keep`` [N] (bool): the real tokens; the others (pads) stay out of the batch
        statistics."""
        if not dropped:
            x = F.dropout(x, self.input_dropout, self.training)
        q = self.query_proj(x)
        if self.query_bn is not None:
            if keep is not None and self.training:
                q = self.query_bn.masked(q, keep)
            elif self.training and q.size(0) < 2:  # batch statistics need two tokens
                bn = self.query_bn
                with float32_region(q.device):
                    q = F.batch_norm(q.float(), bn.running_mean, bn.running_var, bn.weight,
                                     bn.bias, False, 0.0, bn.eps)
            else:
                q = self.query_bn(q, keep_float32=True)
        q = q.float()
        if self.query_gain is not None:
            q = self._normalize_query(q)
        q = F.dropout(q, self.query_dropout, self.training)
        return q.view(-1, self.heads, self.k_dim).transpose(0, 1)

    def _normalize_query(self, q: Tensor) -> Tensor:
        """qk-norm, query side: each half-query [N, H·k_dim] -> g ⊙ q / rms(q), in fp32."""
        half = q.float().view(q.size(0), -1, self.k_dim // 2)
        half = half * torch.rsqrt(half.square().mean(-1, keepdim=True) + 1e-6)
        return (half.view_as(q) * self.query_gain.float()).to(q.dtype)

    def sub_keys(self) -> Tensor:
        """The two sub-key sets C, C' ``[H, 2, n_keys, k_dim/2]`` searched by :meth:`lookup`, in
        float32 (the scores are); with qk-norm each sub-key is scaled to unit L2 norm."""
        keys = self.keys.float()
        if self.query_gain is not None:
            keys = F.normalize(keys, dim=-1, eps=1e-6)
        return keys

    def lookup(self, query: Tensor) -> Tuple[Tensor, Tensor]:
        """Per-head queries [H, N, k_dim] -> (softmax weights, slot indices), each [N, H·knn]."""
        n = query.size(1)  # token-major already: [N, H, knn] -> [N, H·knn] are views
        # scores and the top-k in float32: in fp16/bf16 near-equal scores tie or swap ranks
        if pkm_search_triton.use_kernel(self.search_kernel, query, self.keys, self.knn):
            weights, indices = pkm_search_triton.search(query.float(), self.sub_keys(), self.knn)
            return weights.view(n, self.heads * self.knn), indices.view(n, self.heads * self.knn)
        with float32_region(query.device):
            scores, indices = _ProductTopk.apply(query.float(), self.sub_keys(), self.knn)
            weights = torch.softmax(scores, dim=-1)  # over each head's k, float32
        return weights.view(n, self.heads * self.knn), indices.view(n, self.heads * self.knn)

    def values_read(self, x: Tensor, dropped: bool = False, keep: Optional[Tensor] = None
                    ) -> Tensor:
        """Σ_i w_i v_i for tokens x [N, d] -> [N, v_dim] (no value dropout); ``keep`` [N]
        (bool): the real tokens (the others' rows are garbage, which the caller masks)."""
        weights, indices = self.lookup(self.query(x, dropped, keep))
        out = self.values.read(indices, weights,
                               pkm_triton.use_kernel(self.kernel, self.values.weight), keep)
        if not self.training and self.usage_callback is not None:
            weights = weights if keep is None else torch.where(keep.unsqueeze(1), weights, 0.0)
            self.usage_callback(indices.detach(), weights.detach())
        # the dtype the layer computes in: autocast's for a float32 x inside autocast
        return out.to(compute_dtype(x))

    def read(self, x: Tensor, keep: Optional[Tensor] = None) -> Tensor:
        """m(x) for tokens x [N, d] -> [N, d_out] (plain output; with swilu the [N, v_dim] read
        that the gate multiplies), value dropout on the read as in XLM. ``keep``: as in
        :meth:`values_read`."""
        out = F.dropout(self.values_read(x, keep=keep), self.value_dropout, self.training)
        return out if self.out_proj is None else self.out_proj(out)

    def transform(self, x: Tensor, keep: Optional[Tensor] = None) -> Tensor:
        """The layer's output for tokens x [N, d] -> [N, d_out]; ``keep`` [N] (bool): the real
        tokens (the rows of the others are garbage: :meth:`forward` masks them)."""
        if self.swilu == "reference":  # Drop_v(W₂(m(x̃) ⊙ SiLU(W₁ x̃))), x̃ = Drop_in(x)
            x = F.dropout(x, self.input_dropout, self.training)
            out = self.gate_out(self.values_read(x, dropped=True, keep=keep)
                                * F.silu(self.gate_proj(x)))
            return F.dropout(out, self.value_dropout, self.training)
        out = self.read(x, keep)
        if self.swilu == "legacy":  # W₂(Drop_v(m(x)) ⊙ SiLU(W₁ x)), no biases
            out = self.gate_out(out * F.silu(self.gate_proj(x)))
        return out

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        padding_mask = self.padding(x, padding_mask)  # (checks x [T, B, C] first)
        t, b, c = x.shape
        flat = x.reshape(t * b, c)
        keep = None
        if padding_mask is not None:
            # the real tokens, time-major like ``flat``: pads are masked, not removed (removing
            # them is a ``nonzero``, a host sync on CUDA and a graph break under torch.compile),
            # except on the CPU (SKIP_PADS_ON)
            keep = ~padding_mask.transpose(0, 1).reshape(-1)
        if flat.size(0) == 0:
            return x.new_zeros(t, b, self.output_dim, dtype=compute_dtype(x))
        if keep is not None:
            if x.device.type in SKIP_PADS_ON and not torch.compiler.is_compiling():
                return self._without_pads(flat, keep).view(t, b, self.output_dim)
            # a pad's row computes from 0, whatever it holds (even inf: 0 · inf in a gradient)
            flat = torch.where(keep.unsqueeze(1), flat, 0.0)
        out = self.transform(flat, keep)
        if keep is not None:  # pads output 0, so their gradients are 0 too
            out = torch.where(keep.unsqueeze(1), out, 0.0)
        return out.view(t, b, self.output_dim)

    def _without_pads(self, flat: Tensor, keep: Tensor) -> Tensor:
        """The layer on the real tokens alone, the pads' rows 0: what masking computes, without
        the pads' work (:data:`SKIP_PADS_ON`)."""
        kept = keep.nonzero().squeeze(1)
        if kept.numel() == flat.size(0):
            return self.transform(flat)
        if kept.numel() == 0:
            return flat.new_zeros(flat.size(0), self.output_dim, dtype=compute_dtype(flat))
        out = self.transform(flat.index_select(0, kept))
        return out.new_zeros(flat.size(0), self.output_dim).index_copy(0, kept, out)

    def extra_repr(self) -> str:
        return (f"|K|={self.size} (n_keys={self.n_keys}²), heads={self.heads}, knn={self.knn}, "
                f"k_dim={self.k_dim}, v_dim={self.v_dim}, sparse={self.sparse}"
                + ("" if self.owns_values else ", values=shared (owned by another memory)")
                + (f", swilu={self.swilu}" if self.gated else "")
                + (f", init={self.init}" if self.init != "xlm" else "")
                + (", qk_norm" if self.qk_norm else "")
                + (f", kernel={self.kernel}" if self.kernel != "auto" else "")
                + (f", search_kernel={self.search_kernel}" if self.search_kernel != "torch" else "")
                + (", residual_dropout" if self.residual_dropout else ""))

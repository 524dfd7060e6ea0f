"""The product-key search of the memory layer (:class:`.pkm.ProductKeyMemory`): its sub-keys and
the exact top-k over the n_keys² product keys, with the softmax of the chosen scores::

    I_1 = top_k(q¹ C), I_2 = top_k(q² C'),  I = top_k{ ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ : a ∈ I_1, b ∈ I_2 }
    w = softmax over I of the scores

:class:`ProductKeySearch` is the layer's part that holds the sub-keys C, C' (their init, qk-norm's
key side), picks the dtype the search runs in (:data:`SEARCH_DTYPES`) and runs it: the fused
Triton kernel (:mod:`.pkm_search_triton`) or :class:`_ProductTopk`, the plain PyTorch reference
and CPU path (the candidate pairs of the two sorted lists: :func:`candidate_pairs`). Scores,
top-k, candidate sums and softmax are float32 whatever the inputs' dtype (docs/precision.md).

Imports torch only.
"""

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import pkm_search_triton
from .constants import cached_constant
from .precision import HALF_DTYPES, compute_dtype, float32_region

#: the dtype queries and sub-keys enter the search in: "model" = the layer's compute dtype
#: (:func:`~.precision.compute_dtype` of its input: the parameters' dtype under --fp16/--bf16,
#: autocast's under --amp, float32 in fp32 training); "float32" = float32 whatever the model's
#: (the search before issue 62). Scores, top-k, candidate sums and softmax are float32 in both
SEARCH_DTYPES = ("model", "float32")


def product_topk(q1: Tensor, q2: Tensor, keys1: Tensor, keys2: Tensor, knn: int
                 ) -> Tuple[Tensor, Tensor]:
    """Exact top-k over the n_keys² product keys, per head.

    q1, q2 ``[H, N, k_dim/2]``; keys1, keys2 ``[H, n_keys, k_dim/2]`` -> scores, indices
    ``[H, N, knn]`` (sorted, largest first; index = a·n_keys + b, int32). Scores are float32
    whatever the inputs' dtype (half inputs: float32 products and sums), and
    differentiable with respect to queries and keys (:class:`_ProductTopk`, which takes both
    halves joined and answers token-major: :meth:`ProductKeySearch.lookup` calls it directly)."""
    scores, indices = _ProductTopk.apply(torch.cat([q1, q2], -1), torch.stack([keys1, keys2], 1),
                                         knn)
    return scores.transpose(0, 1), indices.transpose(0, 1)


class _ProductTopk(torch.autograd.Function):
    """``(query [H, N, k_dim], keys [H, 2, n_keys, k_dim/2], knn) -> scores, indices [N, H, knn]``:
    half-query i of ``query`` is scored against ``keys[:, i]``; the answer is token-major, the
    layout of the value read (no transposed copies of either). Indices are int32 from the
    per-half top-k on (slot ids < 2³¹; half the bytes of every gather, stack and saved tensor
    after it); only ``scatter_add_``, which takes int64 indices alone, gets an int64 copy.

    The search runs in the keys' dtype, float32 or half (float16 / bfloat16: the search of a
    half-precision layer, :data:`SEARCH_DTYPES`): the query is rounded to it here (a float32
    query from the batch norm: its gradient comes back float32, with no cast either way), and
    the scores are float32 whatever it is (:func:`_half_scores`: the half inputs' products
    summed in float32), as are the top-k, the candidate sums and everything the backward
    computes (the gradients are cast to the inputs' dtypes at the end).

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
        ctx.query_dtype = query.dtype
        query = query.to(keys.dtype)  # (the search's inputs; a no-op in float32)
        h, n, _ = query.shape
        n_keys, half = keys.size(2), keys.size(3)
        a, b = _candidate_pairs(knn, query.device)
        scores_of = _half_scores(keys)
        # CPU: cache-sized chunks; GPU: one chunk (no per-chunk kernel launches)
        chunk = n if query.is_cuda else max(1, _SCORE_CHUNK // (h * n_keys))
        parts = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            # per half: [H, c, n_keys] float32 scores -> sorted top-knn values and (int32)
            # sub-key ids, read token-major [c, H, knn] from here on
            (s1, i1), (s2, i2) = (
                (top.values.transpose(0, 1), top.indices.transpose(0, 1).to(torch.int32))
                for top in (scores_of(query[:, s:e, i * half:(i + 1) * half], i)
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
        acc = torch.promote_types(keys.dtype, torch.float32)  # float32 (float64 stays)
        g = grad.to(acc)  # [N, H, knn]; everything below in acc (no-ops in fp32)
        grad_query = grad_keys = None
        if ctx.needs_input_grad[0]:  # Σ_j g_j c_{sub_j}; bag (n, h, i) reads keys[h, i]
            rows = sub + _set_offsets(h, n_keys, sub.device)
            weights = g.unsqueeze(2).expand(n, h, 2, k)
            grad_query = F.embedding_bag(rows.view(-1, k), keys.to(acc).reshape(-1, half),
                                         mode="sum", per_sample_weights=weights.reshape(-1, k))
            grad_query = grad_query.view(n, h, 2 * half).transpose(0, 1).to(ctx.query_dtype)
        if ctx.needs_input_grad[1]:  # Gᵀ q per half, all heads at once (a sub-key chosen
            dense = g.new_empty(h, n, n_keys)  # twice gets both g)
            grad_keys = []
            for i in range(2):  # (scatter_add_ takes int64 indices only)
                dense.zero_().scatter_add_(-1, sub[:, :, i].transpose(0, 1).long(),
                                           g.transpose(0, 1))
                grad_keys.append(torch.bmm(dense.transpose(1, 2),
                                           query[:, :, i * half:(i + 1) * half].to(acc)))
            grad_keys = torch.stack(grad_keys, 1).to(keys.dtype)
        return grad_query, grad_keys, None


#: devices whose half-precision score GEMM writes float32 itself (``torch.bmm(..., out_dtype=
#: torch.float32)``: cuBLAS's half GEMM, float32 accumulation and output; torch 2.13 has it on
#: CUDA only); elsewhere the half inputs are widened to float32 first: the same products (a
#: product of two bf16 or fp16 numbers is exact in float32) in a float32 GEMM
HALF_GEMM_ON = ("cuda",)


def _half_scores(keys: Tensor) -> Callable[[Tensor, int], Tensor]:
    """``scores(q, i)``: the scores [H, c, n_keys] of half-queries q [H, c, k_dim/2] (in the
    keys' dtype) against sub-key set i of ``keys`` [H, 2, n_keys, k_dim/2], float32 for half
    inputs: multiplied as they are and summed in float32 (never rounded to half: near-equal
    scores would tie or swap ranks; the Memory+ reference's bfloat16 scores change a slot in
    several times as many rows as bfloat16 inputs with float32 sums, tests/test_pkm_half.py)."""
    keys_t = keys.transpose(2, 3)  # [H, 2, half, n_keys]
    if keys.dtype not in HALF_DTYPES:  # float32 (or float64) as it is
        return lambda q, i: torch.bmm(q, keys_t[:, i])
    if keys.device.type in HALF_GEMM_ON:
        return lambda q, i: torch.bmm(q, keys_t[:, i], out_dtype=torch.float32)
    keys_t = keys_t.float()  # (once, not per chunk)
    return lambda q, i: torch.bmm(q.float(), keys_t[:, i])


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


class ProductKeySearch:
    """The search of :class:`.pkm.ProductKeyMemory` (a part of it, read on its own): the sub-keys
    C, C' ``keys [H, 2, n_keys, k_dim/2]`` (:meth:`_init_search` makes them, :meth:`reset_keys`
    initialises them), the dtype the search runs in (:meth:`search_dtype_for`) and the search
    with its softmax (:meth:`lookup`: the fused kernel or :class:`_ProductTopk`). It reads the
    module's ``heads``, ``n_keys``, ``k_dim``, ``knn``, ``init``, ``search_kernel``,
    ``search_dtype`` and ``qk_norm``."""

    def _init_search(self):
        self.keys = nn.Parameter(torch.empty(self.heads, 2, self.n_keys, self.k_dim // 2))  # C, C'

    def reset_keys(self):
        # XLM: uniform(±1/√(k_dim/2)), nn.Linear's rule for a sub-key; memory: ±1/√k_dim
        bound = 1 / math.sqrt(self.k_dim if self.init == "memplus" else self.k_dim // 2)
        nn.init.uniform_(self.keys, -bound, bound)

    def search_dtype_for(self, x: Tensor) -> torch.dtype:
        """The dtype the queries and sub-keys of input ``x`` enter the search in: the layer's
        compute dtype (``x``'s, or autocast's for a float32 ``x`` in an autocast region) when it
        is float16 or bfloat16 and ``search_dtype`` is "model"; float32 otherwise."""
        dtype = compute_dtype(x)
        return dtype if self.search_dtype == "model" and dtype in HALF_DTYPES else torch.float32

    def sub_keys(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The two sub-key sets C, C' ``[H, 2, n_keys, k_dim/2]`` searched by :meth:`lookup`, in
        ``dtype`` (the queries'); with qk-norm each sub-key is scaled to unit L2 norm (in
        float32, then rounded once)."""
        keys = self.keys
        if self.qk_norm:
            keys = F.normalize(keys.float(), dim=-1, eps=1e-6)
        return keys.to(dtype)

    def lookup(self, query: Tensor, dtype: Optional[torch.dtype] = None
               ) -> Tuple[Tensor, Tensor]:
        """Per-head queries [H, N, k_dim] -> (softmax weights, slot indices), each [N, H·knn],
        searched in ``dtype`` (:meth:`search_dtype_for`; default: the query's): queries and
        sub-keys rounded to it once; scores, top-k and softmax in float32 (in fp16/bf16
        near-equal scores would tie or swap ranks)."""
        n = query.size(1)  # token-major already: [N, H, knn] -> [N, H·knn] are views
        keys = self.sub_keys(dtype or query.dtype)
        if pkm_search_triton.use_search_kernel(self.search_kernel, query, keys, self.knn):
            weights, indices = pkm_search_triton.search(query.to(keys.dtype), keys, self.knn)
            return weights.view(n, self.heads * self.knn), indices.view(n, self.heads * self.knn)
        with float32_region(query.device):
            scores, indices = _ProductTopk.apply(query, keys, self.knn)
            weights = torch.softmax(scores, dim=-1)  # over each head's k, float32
        return weights.view(n, self.heads * self.knn), indices.view(n, self.heads * self.knn)

"""Fused Triton kernels for the product-key search: a top-k that filters before it sorts, and a
sort-free backward.

The reference is :class:`~fairseq_attnzoo.modules.pkm_search._ProductTopk` (and the softmax
of :meth:`~fairseq_attnzoo.modules.pkm_search.ProductKeySearch.lookup`) in plain PyTorch, which
stays the CPU path. Queries and sub-keys come in bfloat16, float16 or float32; every score is
accumulated in float32.

**Forward**, two kernels. ``_halves_kernel``: per block of :data:`BLOCK_N` (64) tokens and one head
(4 warps of 16 rows: a row's reductions stay within a warp), for each half i:

1. the scores ``q^i · C_i`` by ``tl.dot`` (the half-queries loaded once), and the maximum of each
   of ``GROUPS`` = 4·knn groups of them (group c: sub-keys c, c + GROUPS, c + 2·GROUPS, ...);
2. **a threshold** τ that at least knn group maxima reach, by bisection (:data:`BISECT` steps from
   the smallest to the largest maximum): knn distinct scores are >= τ, so every score of the
   top-knn is;
3. **the filter**: the scores again, :data:`SCORE_BLOCK` sub-keys a step; those >= τ (about
   1.1·knn of them on random rows whatever n_keys: 35 of 512 at knn 32, 45 at most in 20,480
   rows) packed with their ids into a ``TILE`` = 2·knn wide row of a scratch tile, in sub-key
   order (a prefix sum gives each its place);
4. their top-knn: a ``tl.topk`` of that tile, not of n_keys scores;
5. **the exact fallback**: a block of tokens with a row that kept more than ``TILE`` (ties at τ:
   equal scores, many within a few ulps) takes the top-knn of all its scores instead, 32 sub-keys
   at a time merged into a running top-knn (scores recomputed): the same answer, slower (``_search``
   counts how often, for the tests and the benchmark).

``_pairs_kernel``: the candidate pairs (a, b) of the two sorted lists that can win, (a+1)(b+1) <=
knn (the reference's set, 119 of 1024 at knn 32), scored ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ in float32 (the
reference's arithmetic), their top-knn and its softmax (float32). Only the answer reaches global
memory: the softmax weights ``[N, H, knn]`` (float32), the slots a·n_keys + b (int32) and the
chosen sub-key ids ``[N, H, 2, knn]`` (int32); the lists and the tiles are scratch.

A top-k carries its indices in one integer per element: the score's float32 bits mapped to an
integer of the same order (negative floats' magnitude bits flipped; -0 counted as +0) in the high
32 bits, and ``MAX - index`` in the low 31 bits, so the packed int64 keys of a row are distinct and
ordered by score with **ties going to the lower index** (the sub-key id within a half; the slot
among the candidate pairs) -- the tie rule of these kernels; ``tl.topk`` (a bitonic network) sorts
them. On random inputs the slots equal the reference's but for near-ties that the two summation
orders round apart (11-25 of 65,536 rows at the paper shape on an H200 with the previous kernel,
each within 5e-8 of the top score); the reference's own ties go wherever ``torch.topk`` puts them
(undocumented). A token's scores are summed in an order that does not depend on the other tokens:
a token searched alone and inside a batch gets the same slots and bit-equal weights.

**Backward** (``g`` = ∂L/∂score = w ⊙ (∂L/∂w − Σ w ∂L/∂w), the softmax's backward, in float32), with
no sort, no atomics and no ``[H, N, n_keys]`` buffer, deterministic:

* ``_grad_query_kernel``, per block of :data:`GRAD_BLOCK_N` (32) tokens and one head: g; for each
  half, the block's (token, pair) reads written in key-block order (a counting pass over the
  blocks of :data:`KEY_BLOCK` sub-keys, pair order within one) with where each key block's reads
  start, and ∂L/∂q^i = [tokens × pairs] of g · [pairs × k_dim/2] of the chosen sub-keys, a
  ``tl.dot`` (g rounded to the inputs' dtype first, as the reference does; float32 accumulation);
* ``_grad_keys_kernel``, per head, half, block of KEY_BLOCK sub-keys and chunk of
  :data:`CHUNK_TOKENS` tokens: for each token block, dSᵀ [sub-keys × tokens] built on chip from
  the block's reads of these sub-keys (a ``tl.dot`` of [sub-keys × reads] of g with [reads ×
  tokens] of ones), then ∂L/∂C_i += dSᵀ · q^i (``tl.dot``); the chunks' partial sums are added in
  chunk order (``torch.sum``, the chunks a function of the shape only): a run repeats bit for bit.

The custom ops ``attnzoo::pkm_search`` / ``attnzoo::pkm_search_backward`` (fake implementations and
an autograd rule, so ``torch.compile`` traces a layer through them without a graph break) are
registered on first use, not at import. Triton is imported on first use; ``TRITON_INTERPRET=1``
runs the kernels on CPU tensors in Triton's interpreter (the tests). The expected time of every
kernel: ``python -m scripts.costmodel search`` (docs/performance.md).
"""

import logging
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import pkm_triton
from .pkm_triton import KernelUnavailable, _pow2

logger = logging.getLogger(__name__)

#: the search kernel choices (``ProductKeyMemory(search_kernel=...)``, ``--pkm-search-kernel``)
SEARCH_KERNELS = ("auto", "triton", "torch")
#: the widest half-query the kernels take
MAX_HALF = 512
#: the largest knn (the candidate top-k holds [PAIRS_BLOCK_N, pairs] packed keys; 512 at 128)
MAX_KNN = 128
#: the most sub-keys a half (slot ids a·n_keys + b must fit the packed key's low 31 bits)
MAX_KEYS = 1 << 15
#: tokens a search program takes: 4 warps of 16 rows (a row's reductions stay within a warp)
BLOCK_N = 64
#: sub-keys a step of the filter scores (tl.dot takes 16 at least)
SCORE_BLOCK = 32
#: the widest half-query loaded once a program (wider: DOT_MAX dims a tl.dot step)
DOT_MAX = 128
#: bisection steps of τ (within 2^-10 of the group maxima's range of the knn-th largest)
BISECT = 10
#: backward: sub-keys of a key-gradient program (a key block), tokens of its chunk (the chunks'
#: partial sums are added in chunk order: a function of the shape only, so of no device)
KEY_BLOCK = 64
CHUNK_TOKENS = 1024
#: tokens a program of the candidate pairs' top-knn takes, and its warps
PAIRS_BLOCK_N = 16
PAIRS_WARPS = 2
#: pairs (a token's sub-key and score gradient) a tl.dot step of the key gradient takes, and
#: of the query gradient (the most the registers allow without spilling, at the paper shape)
READS = 64
QUERY_READS = 128
#: tokens a query-gradient program takes, and its warps
GRAD_BLOCK_N = 32
GRAD_WARPS = 4
#: float32 queries: the tl.dot precision ``auto`` would run the fused kernels in; None: ``auto``
#: keeps float32 queries on the PyTorch path, because with 3xTF32 ("tf32x3") the float32
#: specialisations spill (sm_90: the forward 184 B a thread, 120 B still at 8 warps; the key and
#: query gradients 840 B and 8.7 KB); ``search_kernel="triton"`` still runs them, in IEEE float32
FP32_PRECISION: Optional[str] = None

_SEARCH_KERNELS = []
triton = tl = None  # set by _define_search()
_pack = _unpack_score = _cols_ok = _load_queries = _scores = _merge = _kept_topk = None
_exact_topk = _half_topk = _dot_in = None


def _search_kernels():
    if not _SEARCH_KERNELS:
        _SEARCH_KERNELS.extend(_define_search())
    return _SEARCH_KERNELS


def _define_search():
    global triton, tl, _pack, _unpack_score, _cols_ok, _load_queries, _scores, _merge, _kept_topk
    global _exact_topk, _half_topk, _dot_in
    import triton
    import triton.language as tl

    @triton.jit
    def _pack(score, low):
        """A float32 score and a low part in [0, 2^31) -> one int64 ordered by (score, low)."""
        bits = (score + 0.0).to(tl.int32, bitcast=True)  # (+0.0: -0 becomes +0)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # same order as the float, as a signed int
        return (key.to(tl.int64) << 32) | low.to(tl.int64)

    @triton.jit
    def _unpack_score(packed):
        key = (packed >> 32).to(tl.int32)
        return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _cols_ok(d, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
        """d < HALF, as a constant where HALF is BLOCK_D (a load masked by it stays a vector
        load: the mask is constant along d)."""
        if HALF == BLOCK_D:
            return tl.full(d.shape, 1, tl.int1)
        return d < HALF

    @triton.jit
    def _load_queries(q_rows, row_ok, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
        d = tl.arange(0, BLOCK_D)
        return tl.load(q_rows + d[None, :], mask=row_ok[:, None] & _cols_ok(d, HALF, BLOCK_D)[None, :],
                       other=0)

    @triton.jit
    def _scores(qt, q_rows, row_ok, base, s, n_keys, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_D: tl.constexpr, KB: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
        """[BLOCK_N, KB] float32 scores of sub-keys s .. s+KB (-inf past n_keys): one tl.dot of
        the preloaded half-queries ``qt`` (DOT_D == BLOCK_D), else DOT_D dims a step."""
        kb = tl.arange(0, KB)
        k_ok = s + kb < n_keys
        if DOT_D == BLOCK_D:
            d = tl.arange(0, BLOCK_D)
            kt = tl.load(base + (s + kb)[None, :] * HALF + d[:, None],
                         mask=k_ok[None, :] & _cols_ok(d, HALF, BLOCK_D)[:, None], other=0)
            if UPCAST:  # the interpreter's bf16 tl.dot reads the bits wrong (Triton 3.9)
                acc = tl.dot(qt.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
            else:  # float32 accumulation
                acc = tl.dot(qt, kt, input_precision=PRECISION)
        else:
            acc = tl.zeros([row_ok.shape[0], KB], dtype=tl.float32)
            for c in tl.static_range(0, BLOCK_D, DOT_D):
                d = c + tl.arange(0, DOT_D)
                d_ok = _cols_ok(d, HALF, BLOCK_D)
                qi = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0)
                kt = tl.load(base + (s + kb)[None, :] * HALF + d[:, None],
                             mask=k_ok[None, :] & d_ok[:, None], other=0)
                if UPCAST:
                    acc = tl.dot(qi.to(tl.float32), kt.to(tl.float32), acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(qi, kt, acc, input_precision=PRECISION)
        return tl.where(k_ok[None, :], acc, float("-inf"))

    @triton.jit
    def _merge(top, block, KNN: tl.constexpr):
        """The KNN largest of two [BLOCK_N, KNN] sets of packed keys, largest first."""
        both = tl.reshape(tl.join(top, block), [top.shape[0], 2 * KNN])
        return tl.topk(both, KNN)

    @triton.jit
    def _kept_topk(tile, local, count, KNN: tl.constexpr, TILE: tl.constexpr,
                   EMPTY: tl.constexpr):
        """The top-KNN of the entries a row kept in the tile, largest first."""
        col = tl.arange(0, TILE)[None, :]
        return tl.topk(tl.load(tile + local * TILE + col, mask=col < count[:, None], other=EMPTY),
                       KNN)

    @triton.jit
    def _exact_topk(qt, q_rows, row_ok, base, n_keys, HALF: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_D: tl.constexpr, FB: tl.constexpr,
                    KNN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    EMPTY: tl.constexpr):
        """The top-KNN of all the scores, FB sub-keys at a time merged into a running top-knn
        (exact, and slower: the fallback)."""
        fb = tl.arange(0, FB)
        top = tl.full([row_ok.shape[0], KNN], EMPTY, tl.int64)
        for s in range(0, n_keys, FB):
            block = _pack(_scores(qt, q_rows, row_ok, base, s, n_keys, HALF, BLOCK_D, DOT_D, FB,
                                  PRECISION, UPCAST), 0x7FFFFFFF - (s + fb)[None, :])
            block = tl.where((s + fb < n_keys)[None, :], block, EMPTY)
            if FB > KNN:
                block = tl.topk(block, KNN)
            top = _merge(top, block, KNN)
        return top

    @triton.jit
    def _half_topk(q_rows, row_ok, base, tile, out, flag, n_keys, knn, HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_D: tl.constexpr, GROUPS: tl.constexpr,
                   KB: tl.constexpr, TILE: tl.constexpr, FB: tl.constexpr, KNN: tl.constexpr,
                   BISECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   FALLBACK: tl.constexpr, EMPTY: tl.constexpr):
        """One half: the top-KNN sub-keys of each token, packed (score, 2^31-1 - id), largest
        first, to ``out`` [BLOCK_N, KNN]; ``tile``: the program's [BLOCK_N, TILE] scratch;
        ``flag``: 1 where the exact fallback ran, else 0."""
        n_rows: tl.constexpr = row_ok.shape[0]
        local = tl.arange(0, n_rows)[:, None]
        kb = tl.arange(0, KB)
        qt = _load_queries(q_rows, row_ok, HALF, BLOCK_D) if DOT_D == BLOCK_D else None
        # 1. group maxima: group c holds the sub-keys c, c + GROUPS, c + 2·GROUPS, ...
        gmax = tl.full([n_rows, GROUPS], float("-inf"), tl.float32)
        for s in range(0, n_keys, GROUPS):
            gmax = tl.maximum(gmax, _scores(qt, q_rows, row_ok, base, s, n_keys, HALF, BLOCK_D,
                                            DOT_D, GROUPS, PRECISION, UPCAST))
        # 2. τ <= the knn-th largest group maximum, by bisection: knn maxima stay >= τ, so knn
        # scores are >= τ, so every score of the top-knn is
        lo = tl.min(tl.where(gmax > float("-inf"), gmax, float("inf")), 1)
        hi = tl.max(gmax, 1)
        for _ in tl.static_range(BISECT):
            mid = lo + (hi - lo) * 0.5
            enough = tl.sum((gmax >= mid[:, None]).to(tl.int32), 1) >= knn
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        # 3. the scores >= τ, packed, to the tile in sub-key order (past TILE: counted only)
        count = tl.zeros([n_rows], dtype=tl.int32)
        for s in range(0, n_keys, KB):
            scores = _scores(qt, q_rows, row_ok, base, s, n_keys, HALF, BLOCK_D, DOT_D, KB,
                             PRECISION, UPCAST)
            keep = scores >= lo[:, None]
            at = count[:, None] + tl.cumsum(keep.to(tl.int32), 1) - 1
            tl.store(tile + local * TILE + at, _pack(scores, 0x7FFFFFFF - (s + kb)[None, :]),
                     mask=keep & (at < TILE))
            count += tl.sum(keep.to(tl.int32), 1)
        tl.debug_barrier()
        # 4. their top-knn; 5. a row that kept more than TILE (ties at τ): the exact top-knn
        # of all its scores
        if FALLBACK:
            over = tl.max(tl.where(row_ok, count, 0), 0) > TILE
            tl.store(flag, over.to(tl.int32))
            if not over:
                tl.store(out, _kept_topk(tile, local, count, KNN, TILE, EMPTY),
                         mask=row_ok[:, None])
            else:
                tl.store(out, _exact_topk(qt, q_rows, row_ok, base, n_keys, HALF, BLOCK_D, DOT_D,
                                          FB, KNN, PRECISION, UPCAST, EMPTY),
                         mask=row_ok[:, None])
        else:
            tl.store(out, _kept_topk(tile, local, count, KNN, TILE, EMPTY), mask=row_ok[:, None])
        tl.debug_barrier()  # (the tile serves the next half)

    def _halves_kernel(q, keys, tiles, lists, flags, n, heads, n_keys, knn, stride_qh, stride_qn,
                       HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_D: tl.constexpr, GROUPS: tl.constexpr, KB: tl.constexpr,
                       TILE: tl.constexpr, FB: tl.constexpr, KNN: tl.constexpr,
                       BISECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       FALLBACK: tl.constexpr = True):
        """Per half: the top-KNN sub-keys of BLOCK_N tokens to ``lists`` [N, H, 2, KNN]
        (entries past knn: the next ones), and to ``flags`` [programs, 2] whether a half took the
        exact fallback. FALLBACK=False leaves the fallback out (the cost model's count of the
        common path; never launched so)."""
        EMPTY: tl.constexpr = -9223372036854775807 - 1  # below every packed key
        h = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        tile = tiles + (tl.program_id(0) * heads + h).to(tl.int64) * (BLOCK_N * TILE)
        out = lists + ((rows.to(tl.int64) * heads + h) * 2)[:, None] * KNN + tl.arange(0, KNN)
        q_rows = q + h.to(tl.int64) * stride_qh + rows.to(tl.int64)[:, None] * stride_qn
        for i in tl.static_range(2):
            _half_topk(q_rows + i * HALF, row_ok, keys + (h * 2 + i).to(tl.int64) * n_keys * HALF,
                       tile, out + i * KNN, flags + (tl.program_id(0) * heads + h) * 2 + i, n_keys,
                       knn, HALF, BLOCK_D, DOT_D, GROUPS, KB, TILE,
                       FB, KNN, BISECT, PRECISION, UPCAST, FALLBACK, EMPTY)

    def _pairs_kernel(lists, w_out, slot_out, sub_out, n, heads, n_keys, knn,
                      BLOCK_N: tl.constexpr, KNN: tl.constexpr, PAIRS: tl.constexpr):
        """The candidate pairs of the two halves' lists, their top-knn and its softmax."""
        EMPTY: tl.constexpr = -9223372036854775807 - 1
        h = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        nh = rows.to(tl.int64)[:, None] * heads + h
        pos = tl.arange(0, KNN)
        keep = pos < knn
        # candidate pair j: (a, b) of the two sorted lists with (a+1)(b+1) <= knn, row-major
        # (row a holds knn // (a+1) pairs), as the reference scores them
        j = tl.arange(0, PAIRS)
        a = tl.zeros([PAIRS], dtype=tl.int32)
        start = tl.zeros([PAIRS], dtype=tl.int32)
        end = tl.full([], 0, tl.int32)
        for r in range(0, knn):
            end += knn // (r + 1)
            past = j >= end
            a += past.to(tl.int32)
            start = tl.where(past, end, start)
        ok = row_ok[:, None] & (j < end)[None, :]
        p1 = tl.load(lists + nh * 2 * KNN + a[None, :], mask=ok, other=EMPTY)
        p2 = tl.load(lists + (nh * 2 + 1) * KNN + (j - start)[None, :], mask=ok, other=EMPTY)
        id1 = 0x7FFFFFFF - (p1 & 0x7FFFFFFF).to(tl.int32)
        id2 = 0x7FFFFFFF - (p2 & 0x7FFFFFFF).to(tl.int32)
        max_slot = n_keys * n_keys - 1
        # ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ in float32, as the reference adds them; ties: the lower slot
        cand = tl.where(ok, _pack(_unpack_score(p1) + _unpack_score(p2),
                                  max_slot - (id1 * n_keys + id2)), EMPTY)
        final = tl.topk(cand, KNN)
        slot = max_slot - (final & 0x7FFFFFFF).to(tl.int32)
        ok = row_ok[:, None] & keep[None, :]
        score = tl.where(ok, _unpack_score(final), float("-inf"))
        e = tl.exp(score - tl.where(row_ok, tl.max(score, 1), 0.0)[:, None])  # (the first)
        w = e / tl.where(row_ok, tl.sum(e, 1), 1.0)[:, None]
        tl.store(w_out + nh * knn + pos[None, :], w, mask=ok)
        tl.store(slot_out + nh * knn + pos[None, :], slot, mask=ok)
        tl.store(sub_out + nh * 2 * knn + pos[None, :], slot // n_keys, mask=ok)
        tl.store(sub_out + nh * 2 * knn + knn + pos[None, :], slot % n_keys, mask=ok)

    @triton.jit
    def _dot_in(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a·b, a (float32) rounded to b's dtype first (tensor cores; the reference rounds
        the score gradient to the keys' dtype too); UPCAST: both in float32 (interpreter)."""
        if UPCAST:
            return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)

    def _grad_query_kernel(grad_w, w, sub, keys, grad_q, grad_s, read_id, read_g, read_tok,
                           bucket, n, heads, n_keys, knn, buckets, HALF: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KNN: tl.constexpr,
                           KEY_BLOCK: tl.constexpr, READS: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        pos = tl.arange(0, KNN)
        nh = rows.to(tl.int64) * heads + h
        ok = row_ok[:, None] & (pos < knn)[None, :]
        at_w = nh[:, None] * knn + pos[None, :]
        wt = tl.load(w + at_w, mask=ok, other=0).to(tl.float32)
        gw = tl.load(grad_w + at_w, mask=ok, other=0).to(tl.float32)
        g = wt * (gw - tl.sum(wt * gw, 1)[:, None])  # ∂L/∂score: the softmax's backward
        tl.store(grad_s + at_w, g, mask=ok)
        d = tl.arange(0, BLOCK_D)
        d_ok = _cols_ok(d, HALF, BLOCK_D)
        p = tl.arange(0, READS)
        local = tl.arange(0, BLOCK_N)
        for i in tl.static_range(2):
            # the block's reads (token, pair) in key-block order (a counting pass over the key
            # blocks, pair order within one): the key-gradient programs take their block's
            ids = tl.load(sub + ((nh * 2 + i) * knn)[:, None] + pos[None, :], mask=ok, other=0)
            kb = tl.where(ok, ids // KEY_BLOCK, buckets)
            block = ((pid * heads + h) * 2 + i).to(tl.int64)
            reads = block * BLOCK_N * KNN
            start = tl.full([], 0, tl.int32)
            for v in range(0, buckets):
                mine = kb == v
                count = tl.sum(mine.to(tl.int32), 1)
                at = start + (tl.cumsum(count, 0) - count)[:, None] \
                    + tl.cumsum(mine.to(tl.int32), 1) - 1
                tl.store(read_id + reads + at, ids, mask=mine)
                tl.store(read_g + reads + at, g, mask=mine)
                tl.store(read_tok + reads + at, local[:, None] + 0 * pos[None, :], mask=mine)
                tl.store(bucket + block * (buckets + 1) + v, start)
                start += tl.sum(count, 0)
            tl.store(bucket + block * (buckets + 1) + buckets, start)
            # ∂L/∂q^i = Σ_j g_j C_i[id_j]: [tokens, pairs] of g times the pairs' sub-keys
            base = keys + (h * 2 + i).to(tl.int64) * n_keys * HALF
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for p0 in range(0, BLOCK_N * KNN, READS):
                t_p = (p0 + p) // KNN
                j_p = (p0 + p) % KNN
                on = (t_p < BLOCK_N) & (pid * BLOCK_N + t_p < n) & (j_p < knn)
                nh_p = (pid * BLOCK_N + t_p).to(tl.int64) * heads + h
                r_p = tl.load(sub + (nh_p * 2 + i) * knn + j_p, mask=on, other=0)
                g_p = tl.load(grad_s + nh_p * knn + j_p, mask=on, other=0)
                rows_c = tl.load(base + r_p.to(tl.int64)[:, None] * HALF + d[None, :],
                                 mask=on[:, None] & d_ok[None, :], other=0)
                acc = _dot_in(tl.where(local[:, None] == t_p[None, :], g_p[None, :], 0.0),
                              rows_c, acc, PRECISION, UPCAST)
            tl.store(grad_q + (nh * 2 * HALF + i * HALF)[:, None] + d[None, :],
                     acc.to(grad_q.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    def _grad_keys_kernel(q, read_id, read_g, read_tok, bucket, partial, n, heads, n_keys,
                          buckets, chunk, stride_qh, stride_qn, HALF: tl.constexpr,
                          BLOCK_N: tl.constexpr, KNN: tl.constexpr, READS: tl.constexpr,
                          BLOCK_D: tl.constexpr, KEY_BLOCK: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        hi = tl.program_id(0)  # head·2 + half
        h = hi // 2
        i = hi % 2
        kb = tl.program_id(1)
        r = kb * KEY_BLOCK + tl.arange(0, KEY_BLOCK)  # this program's sub-keys
        c = tl.program_id(2)  # chunk of `chunk` token blocks
        d = tl.arange(0, BLOCK_D)
        d_ok = _cols_ok(d, HALF, BLOCK_D)
        p = tl.arange(0, READS)
        local = tl.arange(0, BLOCK_N)
        acc = tl.zeros([KEY_BLOCK, BLOCK_D], dtype=tl.float32)
        for b in range(c * chunk, tl.minimum(tl.cdiv(n, BLOCK_N), (c + 1) * chunk)):
            block = (b * heads + h).to(tl.int64) * 2 + i
            reads = block * BLOCK_N * KNN
            first = tl.load(bucket + block * (buckets + 1) + kb)
            last = tl.load(bucket + block * (buckets + 1) + kb + 1)
            # dSᵀ [KEY_BLOCK, tokens] of the block = [sub-keys, reads] of g (a sub-key chosen
            # twice by a token: two reads) times [reads, tokens] of ones
            grad_s = tl.zeros([KEY_BLOCK, BLOCK_N], dtype=tl.float32)
            for p0 in range(first, last, READS):
                on = p0 + p < last
                r_p = tl.load(read_id + reads + p0 + p, mask=on, other=-1)
                g_p = tl.load(read_g + reads + p0 + p, mask=on, other=0)
                t_p = tl.load(read_tok + reads + p0 + p, mask=on, other=-1)
                ones = (t_p[:, None] == local[None, :]).to(tl.float32)
                grad_s = _dot_in(tl.where(r[:, None] == r_p[None, :], g_p[None, :], 0.0),
                                 ones.to(q.dtype.element_ty), grad_s, PRECISION, UPCAST)
            toks = b * BLOCK_N + local
            qt = tl.load(q + h.to(tl.int64) * stride_qh + toks.to(tl.int64)[:, None] * stride_qn
                         + i * HALF + d[None, :], mask=(toks < n)[:, None] & d_ok[None, :],
                         other=0)
            acc = _dot_in(grad_s, qt, acc, PRECISION, UPCAST)
        out = ((c * heads * 2 + hi).to(tl.int64) * n_keys + r)[:, None] * HALF + d[None, :]
        tl.store(partial + out, acc, mask=(r < n_keys)[:, None] & d_ok[None, :])

    return (triton.jit(_halves_kernel), triton.jit(_pairs_kernel), triton.jit(_grad_query_kernel),
            triton.jit(_grad_keys_kernel))


# ---- launches ------------------------------------------------------------------------------

class SearchLaunch(NamedTuple):
    """The forward's constexprs (besides HALF) and warps: a function of the shape and the dtype
    only (:func:`search_launch`)."""

    BLOCK_N: int  # tokens a program (64: each of the 4 warps holds 16 rows of a score block)
    BLOCK_D: int  # the padded half width
    DOT_D: int  # dims a tl.dot step (all of them: the half-queries are loaded once)
    GROUPS: int  # group maxima a row (τ <= the knn-th largest of them)
    KB: int  # sub-keys a step of the filter
    TILE: int  # scores >= τ a row kept for the top-k (more: the exact fallback)
    FB: int  # sub-keys a step of the fallback
    KNN: int  # knn padded
    PAIRS: int  # candidate pairs padded
    BISECT: int  # bisection steps of τ
    PRECISION: str  # the tl.dot input precision
    warps: int


def _precision(dtype: torch.dtype) -> str:
    # bf16/fp16: tensor cores, float32 accumulation ("tf32" names no rounding for them); float32:
    # FP32_PRECISION (3xTF32), the precision `auto` ships
    return (FP32_PRECISION or "ieee") if dtype == torch.float32 else "tf32"


def search_launch(half: int, knn: int, n_keys: int,
                  dtype: torch.dtype = torch.bfloat16) -> SearchLaunch:
    """The forward's launch for half-queries of ``half`` dims in ``dtype``: GROUPS = 4·knn
    group maxima (their knn-th largest leaves ~1.1·knn scores >= τ on random rows, 35 at knn 32,
    whatever n_keys), TILE = 2·knn, steps of 32 sub-keys, 10 bisection steps."""
    block_d = max(16, _pow2(half))
    knn_p = _pow2(knn)
    kb = SCORE_BLOCK
    return SearchLaunch(
        BLOCK_N=BLOCK_N, BLOCK_D=block_d, DOT_D=block_d if block_d <= DOT_MAX else DOT_MAX,
        GROUPS=max(16, min(_pow2(n_keys), _pow2(4 * knn))), KB=kb,
        TILE=max(knn_p, _pow2(2 * knn)), FB=max(kb, knn_p), KNN=knn_p,
        PAIRS=_pow2(sum(knn // (a + 1) for a in range(knn))), BISECT=BISECT,
        PRECISION=_precision(dtype), warps=4)


# ---- the choice: auto, triton, torch -------------------------------------------------------

def check_search_kernel(kernel: Optional[str]) -> str:
    if kernel not in SEARCH_KERNELS:
        raise ValueError(f"PKM search kernel must be one of {', '.join(SEARCH_KERNELS)}, got "
                         f"{kernel!r}")
    return kernel


def why_search_unavailable(query: Tensor, keys: Tensor, knn: int) -> Optional[str]:
    """None when the kernels can search these tensors, else one line saying why not."""
    if not pkm_triton.HAS_TRITON:
        return "Triton is not importable (pip install triton; it ships with CUDA builds of torch)"
    if not (query.is_cuda or (pkm_triton.interpreted() and query.device.type == "cpu")):
        return pkm_triton.needs_cuda("the queries are", query.device.type)
    if keys.size(-1) > MAX_HALF or knn > MAX_KNN or keys.size(-2) > MAX_KEYS:
        return (f"the search kernel takes k_dim/2 <= {MAX_HALF}, knn <= {MAX_KNN} and n_keys <= "
                f"{MAX_KEYS}, got {keys.size(-1)}, {knn} and {keys.size(-2)}")
    return None


class SearchUnavailable(KernelUnavailable):
    """``search_kernel="triton"`` where the fused search cannot run (``why``)."""

    def __init__(self, why: str):
        super().__init__(why, argument="search_kernel",
                         instead="'torch' (or 'auto': the kernel where it runs)")


_SAID = set()


def _auto(query: Tensor, keys: Tensor, knn: int) -> Tuple[bool, str]:
    """``auto``'s choice for these tensors and why (one line). The search's input dtype is the
    sub-keys' (the layer rounds its float32 queries to it for the kernel: ``lookup``)."""
    why = why_search_unavailable(query, keys, knn)
    if why is not None or not query.is_cuda:
        return False, f"the PyTorch search ({why or 'queries on ' + query.device.type})"
    if keys.dtype in (torch.bfloat16, torch.float16):
        return True, f"the fused Triton search ({str(keys.dtype)[6:]} inputs on CUDA)"
    if FP32_PRECISION is not None:
        return True, ("the fused Triton search (float32 inputs on CUDA: tl.dot in "
                      f"{FP32_PRECISION})")
    return False, ("the PyTorch search (float32 inputs on CUDA: no fused float32 "
                   "specialisation compiles without spilling registers)")


def use_search_kernel(kernel: str, query: Tensor, keys: Tensor, knn: int) -> bool:
    """Resolve ``kernel`` ("auto", "triton", "torch") for a search of these tensors. auto: the
    fused kernel on CUDA for bf16/fp16 search inputs (the sub-keys' dtype), and for float32 ones
    where its float32 specialisation compiles without a spill (:data:`FP32_PRECISION`); the PyTorch path on the
    CPU -- said once in the log; triton where it cannot run: one line with the fix."""
    if kernel == "torch":
        return False
    if kernel == "triton":
        why = why_search_unavailable(query, keys, knn)
        if why:
            raise SearchUnavailable(why)
        return True
    fused, said = _auto(query, keys, knn)
    if said not in _SAID and not torch.compiler.is_compiling():  # (no logging in a trace)
        _SAID.add(said)
        logger.info(f"PKM search_kernel=auto: {said}")
    return fused


# ---- the launches of the kernels ------------------------------------------------------------

def _check(query: Tensor, keys: Tensor, knn: int):
    h, _, k_dim = query.shape
    if keys.dim() != 4 or keys.size(0) != h or keys.size(1) != 2 or 2 * keys.size(3) != k_dim:
        raise ValueError(f"PKM search: keys must be [H, 2, n_keys, k_dim/2] = [{h}, 2, n_keys, "
                         f"{k_dim // 2}] for queries {list(query.shape)}, got {list(keys.shape)}")
    if not 1 <= knn <= keys.size(2):
        raise ValueError(f"PKM search: knn must be in 1..n_keys ({keys.size(2)}), got {knn}")


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and pkm_triton.interpreted()


def _search(query: Tensor, keys: Tensor, knn: int,
            stats: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`search_op`; ``stats`` (a dict) gets ``"fallback"``: how many (block of tokens,
    head, half) took the exact fallback (a host sync: the tests and the benchmark only)."""
    halves_kernel, pairs_kernel = _search_kernels()[:2]
    _check(query, keys, knn)
    h, n, k_dim = query.shape
    n_keys, half = keys.size(2), keys.size(3)
    if query.stride(2) != 1:
        query = query.contiguous()
    keys = keys.to(query.dtype).contiguous()
    w = torch.empty(n, h, knn, dtype=torch.float32, device=query.device)
    slots = torch.empty(n, h, knn, dtype=torch.int32, device=query.device)
    sub = torch.empty(n, h, 2, knn, dtype=torch.int32, device=query.device)
    if n:
        L = search_launch(half, knn, n_keys, query.dtype)
        grid = (-(-n // L.BLOCK_N), h)
        tiles = torch.empty(grid[0] * h * L.BLOCK_N * L.TILE, dtype=torch.int64,
                            device=query.device)
        lists = torch.empty(n, h, 2, L.KNN, dtype=torch.int64, device=query.device)
        flags = torch.empty(grid[0], h, 2, dtype=torch.int32, device=query.device)
        halves_kernel[grid](
            query, keys, tiles, lists, flags, n, h, n_keys, knn, query.stride(0), query.stride(1),
            HALF=half, BLOCK_N=L.BLOCK_N, BLOCK_D=L.BLOCK_D, DOT_D=L.DOT_D, GROUPS=L.GROUPS,
            KB=L.KB, TILE=L.TILE, FB=L.FB, KNN=L.KNN, BISECT=L.BISECT, PRECISION=L.PRECISION,
            UPCAST=_upcast(query.dtype), num_warps=L.warps)
        pairs_kernel[(-(-n // PAIRS_BLOCK_N), h)](
            lists, w, slots, sub, n, h, n_keys, knn, BLOCK_N=PAIRS_BLOCK_N, KNN=L.KNN,
            PAIRS=L.PAIRS, num_warps=PAIRS_WARPS)
        if stats is not None:
            stats["fallback"] = int(flags.sum())
    elif stats is not None:
        stats["fallback"] = 0
    return w, slots, sub


def _backward(grad_w: Tensor, weights: Tensor, sub: Tensor, query: Tensor, keys: Tensor
              ) -> Tuple[Tensor, Tensor]:
    query_kernel, key_kernel = _search_kernels()[2:]
    h, n, k_dim = query.shape
    n_keys, half = keys.size(2), keys.size(3)
    knn = weights.size(-1)
    if query.stride(2) != 1:
        query = query.contiguous()
    keys_q = keys.to(query.dtype).contiguous()
    grad_q = torch.empty(n, h, k_dim, dtype=query.dtype, device=query.device)
    blocks, buckets, knn_p = -(-n // GRAD_BLOCK_N), -(-n_keys // KEY_BLOCK), _pow2(knn)
    grad_s = torch.empty(n, h, knn, dtype=torch.float32, device=query.device)
    reads = dict(device=query.device, size=(blocks, h, 2, GRAD_BLOCK_N * knn_p))
    read_id = torch.empty(**reads, dtype=torch.int32)
    read_g = torch.empty(**reads, dtype=torch.float32)
    read_tok = torch.empty(**reads, dtype=torch.int32)
    bucket = torch.empty(blocks, h, 2, buckets + 1, dtype=torch.int32, device=query.device)
    chunk = CHUNK_TOKENS // GRAD_BLOCK_N  # token blocks a key-gradient program sums
    chunks = max(1, -(-blocks // chunk))
    partial = torch.empty(chunks, h, 2, n_keys, half, dtype=torch.float32, device=query.device)
    if n:
        block_d = max(16, _pow2(half))
        precision, upcast = _precision(query.dtype), _upcast(query.dtype)
        query_kernel[(blocks, h)](
            grad_w.contiguous(), weights, sub, keys_q, grad_q, grad_s, read_id, read_g, read_tok,
            bucket, n, h, n_keys, knn, buckets, HALF=half, BLOCK_N=GRAD_BLOCK_N,
            BLOCK_D=block_d, KNN=knn_p, KEY_BLOCK=KEY_BLOCK, READS=QUERY_READS,
            PRECISION=precision, UPCAST=upcast, num_warps=GRAD_WARPS)
        key_kernel[(2 * h, buckets, chunks)](
            query, read_id, read_g, read_tok, bucket, partial, n, h, n_keys, buckets, chunk,
            query.stride(0), query.stride(1), HALF=half, BLOCK_N=GRAD_BLOCK_N, KNN=knn_p,
            READS=READS, BLOCK_D=block_d, KEY_BLOCK=KEY_BLOCK, PRECISION=precision,
            UPCAST=upcast, num_warps=4)
    else:
        partial.zero_()
    # the chunks' partial sums added in chunk order: deterministic
    grad_keys = partial[0] if chunks == 1 else partial.sum(0)
    return grad_q.transpose(0, 1), grad_keys.to(keys.dtype)


# ---- the specialisations shipped, for an ahead-of-time compile (the spill check) ------------

#: the shape the specialisations are compiled at: the paper's (k_dim 256, knn 32, n_keys 512)
PAPER_SHAPE = dict(half=128, knn=32, n_keys=512)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def shipped_dtypes() -> Tuple[torch.dtype, ...]:
    """The query dtypes ``auto`` runs the fused kernels on (CUDA)."""
    return (torch.bfloat16, torch.float16) + ((torch.float32,) if FP32_PRECISION else ())


def sm90_specializations(half: int = PAPER_SHAPE["half"], knn: int = PAPER_SHAPE["knn"],
                         n_keys: int = PAPER_SHAPE["n_keys"],
                         dtypes: Optional[Tuple[torch.dtype, ...]] = None
                         ) -> Iterator[Tuple[str, object, Dict[str, str], dict, int]]:
    """Every kernel specialisation the layer and the benchmark launch for queries of ``half``
    dims a half (each dtype ``auto`` ships, or ``dtypes``; the launch :func:`search_launch`
    picks), as ``(label, kernel, signature, constexprs, num_warps)`` for the spill check
    (scripts/sm90.py). An integer typed ``"i32:16"`` is divisible by 16 at the paper shape (n,
    n_keys, knn, the strides, the chunk), as Triton's launcher specialises it on a device."""
    halves, pairs, grad_query, grad_keys = _search_kernels()
    block_d = max(16, _pow2(half))
    for dtype in dtypes or shipped_dtypes():
        t = _TYPES[dtype]
        L = search_launch(half, knn, n_keys, dtype)
        sig = dict(q=f"*{t}", keys=f"*{t}", tiles="*i64", lists="*i64", flags="*i32",
                   n="i32:16", heads="i32", n_keys="i32:16", knn="i32:16", stride_qh="i32:16",
                   stride_qn="i32:16")
        cx = dict(HALF=half, BLOCK_N=L.BLOCK_N, BLOCK_D=L.BLOCK_D, DOT_D=L.DOT_D,
                  GROUPS=L.GROUPS, KB=L.KB, TILE=L.TILE, FB=L.FB, KNN=L.KNN, BISECT=L.BISECT,
                  PRECISION=L.PRECISION, UPCAST=False, FALLBACK=True)
        yield f"search {t}", halves, dict(sig, **{k: "constexpr" for k in cx}), cx, L.warps
        sig = dict(lists="*i64", w_out="*fp32", slot_out="*i32", sub_out="*i32", n="i32:16",
                   heads="i32", n_keys="i32:16", knn="i32:16")
        cx = dict(BLOCK_N=PAIRS_BLOCK_N, KNN=L.KNN, PAIRS=L.PAIRS)
        if dtype == torch.bfloat16:  # (no input of the queries' dtype: one specialisation)
            yield "search pairs", pairs, dict(sig, **{k: "constexpr" for k in cx}), cx, PAIRS_WARPS
        sig = dict(grad_w="*fp32", w="*fp32", sub="*i32", keys=f"*{t}", grad_q=f"*{t}",
                   grad_s="*fp32", read_id="*i32", read_g="*fp32", read_tok="*i32",
                   bucket="*i32", n="i32:16", heads="i32", n_keys="i32:16", knn="i32:16",
                   buckets="i32")
        cx = dict(HALF=half, BLOCK_N=GRAD_BLOCK_N, BLOCK_D=block_d, KNN=L.KNN,
                  KEY_BLOCK=KEY_BLOCK, READS=QUERY_READS, PRECISION=L.PRECISION, UPCAST=False)
        yield (f"search backward query {t}", grad_query,
               dict(sig, **{k: "constexpr" for k in cx}), cx, GRAD_WARPS)
        sig = dict(q=f"*{t}", read_id="*i32", read_g="*fp32", read_tok="*i32", bucket="*i32",
                   partial="*fp32", n="i32:16", heads="i32", n_keys="i32:16", buckets="i32",
                   chunk="i32:16", stride_qh="i32:16", stride_qn="i32:16")
        cx = dict(HALF=half, BLOCK_N=GRAD_BLOCK_N, KNN=L.KNN, READS=READS, BLOCK_D=block_d,
                  KEY_BLOCK=KEY_BLOCK, PRECISION=L.PRECISION, UPCAST=False)
        yield (f"search backward keys {t}", grad_keys,
               dict(sig, **{k: "constexpr" for k in cx}), cx, 4)


# ---- the custom ops (torch.compile traces them as single nodes), registered on first use -----

_OPS: Dict[str, object] = {}


def _ops() -> Dict[str, object]:
    if not _OPS:
        _OPS.update(_register_ops())
    return _OPS


def _register_ops() -> Dict[str, object]:
    @torch.library.custom_op("attnzoo::pkm_search", mutates_args=())
    def search_op(query: Tensor, keys: Tensor, knn: int) -> Tuple[Tensor, Tensor, Tensor]:
        return _search(query, keys, knn)

    @search_op.register_fake
    def _(query, keys, knn):
        _check(query, keys, knn)
        h, n, _ = query.shape
        return (query.new_empty(n, h, knn, dtype=torch.float32),
                query.new_empty(n, h, knn, dtype=torch.int32),
                query.new_empty(n, h, 2, knn, dtype=torch.int32))

    @torch.library.custom_op("attnzoo::pkm_search_backward", mutates_args=())
    def backward_op(grad_w: Tensor, weights: Tensor, sub: Tensor, query: Tensor, keys: Tensor
                    ) -> Tuple[Tensor, Tensor]:
        return _backward(grad_w, weights, sub, query, keys)

    @backward_op.register_fake
    def _(grad_w, weights, sub, query, keys):
        h, n, k_dim = query.shape
        return query.new_empty(n, h, k_dim).transpose(0, 1), torch.empty_like(keys)

    def setup(ctx, inputs, output):
        query, keys, _ = inputs
        weights, _, sub = output
        ctx.save_for_backward(weights, sub, query, keys)

    def grad(ctx, grad_w, _slots, _sub):
        weights, sub, query, keys = ctx.saved_tensors
        if grad_w is None:
            return None, None, None
        grad_q, grad_keys = backward_op(grad_w, weights, sub, query, keys)
        return grad_q, grad_keys, None

    search_op.register_autograd(grad, setup_context=setup)
    return {"search": search_op, "backward": backward_op}


def search_op(query: Tensor, keys: Tensor, knn: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(query [H, N, k_dim], keys [H, 2, n_keys, k_dim/2], knn)`` -> softmax weights
    ``[N, H, knn]`` (float32), slots ``[N, H, knn]`` and sub-key ids ``[N, H, 2, knn]`` (int32);
    slots sorted by score, largest first (the op ``attnzoo::pkm_search``)."""
    return _ops()["search"](query, keys, knn)


def search_backward_op(grad_w: Tensor, weights: Tensor, sub: Tensor, query: Tensor, keys: Tensor
                       ) -> Tuple[Tensor, Tensor]:
    """The gradients of :func:`search_op` with respect to query and keys, in their dtypes (the
    op ``attnzoo::pkm_search_backward``)."""
    return _ops()["backward"](grad_w, weights, sub, query, keys)


def search(query: Tensor, keys: Tensor, knn: int) -> Tuple[Tensor, Tensor]:
    """The fused product-key search, differentiable in ``query`` and ``keys``: softmax weights
    ``[N, H, knn]`` (float32) and slots ``[N, H, knn]`` (int32), token-major like the value read
    takes them (:meth:`ProductKeyMemory.lookup`'s kernel path)."""
    weights, slots, _ = search_op(query, keys, knn)
    return weights, slots

"""A fused Triton kernel for the product-key search and a lean backward for it.

The reference is :class:`~fairseq_attnzoo.modules.pkm._ProductTopk` (and the softmax of
:meth:`~fairseq_attnzoo.modules.pkm.ProductKeyMemory.lookup`) in plain PyTorch. Per block of
``BLOCK_N`` tokens and one head, one program computes:

* both halves' scores ``q^i · C_i`` by ``tl.dot`` (bf16/fp16 in with float32 accumulation; float32
  in as IEEE float32, no TF32), one block of ``KEY_BLOCK`` sub-keys at a time, each block merged
  into a running top-knn kept in registers -- no score block in global memory;
* the candidate pairs (a, b) of the two sorted lists that can win, (a+1)(b+1) <= knn (the
  reference's set, 119 of 1024 at knn 32), gathered from a per-program scratch of the two lists
  and scored ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ in float32 (the reference's arithmetic), and their top-knn;
* the softmax of the knn final scores (float32).

It writes only the answer: the softmax weights ``[N, H, knn]`` (float32), the slots a·n_keys + b
(int32) and the chosen sub-key ids ``[N, H, 2, knn]`` (int32).

A top-k carries its indices in one integer per element: the score's float32 bits mapped to an
integer of the same order (negative floats' magnitude bits flipped; -0 counted as +0) in the high
32 bits, and ``MAX - index`` in the low 31 bits, so the packed int64 keys of a row are distinct and
ordered by score with **ties going to the lower index** (the sub-key id within a half; the slot
among the candidate pairs) -- the tie rule of this kernel. A top-knn is knn rounds of taking each
row's largest key out of the tile (a compare-and-select over it): no sort; the first H200 visit
measured a bitonic ``tl.topk`` merge of 64-key blocks at 1.4x torch.topk's time
(docs/performance.md, ``pkm/search-forward``). On random inputs the slots equal the reference's
but for near-ties that the two summation orders round apart (11-25 of 65,536 rows at the paper
shape on an H200, each within 5e-8 of the top score); the reference's own ties go wherever
``torch.topk`` puts them (undocumented).

Backward (``g`` = ∂L/∂score = w ⊙ (∂L/∂w − Σ w ∂L/∂w), the softmax's backward, in float32):

* ∂L/∂q^i = Σ_j g_j C_i[sub_ij]: a gather-sum over the chosen sub-keys, one program per token
  block and head (the sub-key table, 2 MiB at the paper shape, stays in cache);
* ∂L/∂C_i[r] = Σ_{(n, j): sub = r} g_j q^i_n, into the ``[H, 2, n_keys, k_dim/2]`` gradient
  itself (no ``[H, N, n_keys]`` buffer), by one of :data:`KEY_BACKWARDS`:
  ``"segment"`` (the default): the reads sorted by sub-key row (one ``torch.sort`` of int32
  keys), one program per sub-key row summing its reads in a fixed order -- deterministic, like
  the value backward of :mod:`.pkm_triton`, so a run repeats bit for bit;
  ``"atomic"``: float32 atomic adds from the query-gradient program (no sort, one pass), whose
  sums depend on the order the adds land in: not deterministic.

Registered as the custom ops ``attnzoo::pkm_search`` / ``attnzoo::pkm_search_backward`` (with
fake implementations and an autograd rule), so ``torch.compile`` traces a layer through them
without a graph break. Triton is imported on first use; ``TRITON_INTERPRET=1`` runs the kernels
on CPU tensors in Triton's interpreter (the tests).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import pkm_triton
from .constants import cached_constant

#: the widest half-query a program holds ([BLOCK_N, k_dim/2] and a [k_dim/2, KEY_BLOCK] key block)
MAX_HALF = 512
#: the largest knn (the candidate merge holds [BLOCK_N, 2·knn] packed keys)
MAX_KNN = 128
#: the most sub-keys a half (slot ids a·n_keys + b must fit the packed key's low 31 bits)
MAX_KEYS = 1 << 15
#: tokens a program searches (tl.dot needs at least 16 rows)
BLOCK_N = 16
#: the most sub-keys a program scores at once ([BLOCK_N, KEY_BLOCK] scores, packed to int64): on
#: an H200 with bf16 inputs 256 beat 128 and 64 (2.12, 2.56, 3.77 ms at n_keys 512;
#: docs/performance.md, pkm/search-forward)
KEY_BLOCK = 256
#: the dims of a half-query a tl.dot step takes (a [DOT_D, KEY_BLOCK] key tile)
DOT_D = 32
#: elements of the key-gradient program's [reads, k_dim/2] tile (32 reads of a 128-wide half)
KEY_ROWS = 4096
#: the key-gradient methods; :data:`KEY_BACKWARD` is the default (deterministic)
KEY_BACKWARDS = ("segment", "atomic")
KEY_BACKWARD = "segment"

_KERNELS = []
triton = tl = None  # set by _define()
_pack = _unpack_score = _take_top = _half_topk = None


def _kernels():
    if not _KERNELS:
        _KERNELS.extend(_define())
    return _KERNELS


def _define():
    global triton, tl, _pack, _unpack_score, _take_top, _half_topk  # (found by the kernels here)
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
    def _take_top(block, top, knn, KNN: tl.constexpr, EMPTY: tl.constexpr):
        """The knn largest packed keys of ``block`` [BLOCK_N, B] and ``top`` [BLOCK_N, KNN] (keys
        distinct within a row; EMPTY: none), largest first: knn rounds of taking each row's
        maximum out of both (a round is a compare-and-select over the tiles; no sort)."""
        col = tl.arange(0, KNN)[None, :]
        out = tl.full([block.shape[0], KNN], EMPTY, tl.int64)
        for r in range(0, knn):
            m = tl.maximum(tl.max(block, 1), tl.max(top, 1))[:, None]
            out = tl.where(col == r, m, out)
            block = tl.where(block == m, EMPTY, block)
            top = tl.where(top == m, EMPTY, top)
        return out

    @triton.jit
    def _half_topk(q, keys, h, i, rows, row_ok, n_keys, knn, stride_qh, stride_qn,
                   HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_D: tl.constexpr, KEY_BLOCK: tl.constexpr, KNN: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMPTY: tl.constexpr):
        """Half i's top-knn sub-keys of each token, packed (score, 2^31-1 - id), largest first;
        the entries past knn are EMPTY. A block of KEY_BLOCK sub-keys is scored DOT_D dims at a
        time (a [DOT_D, KEY_BLOCK] key tile, not the whole [k_dim/2, KEY_BLOCK] block)."""
        kb = tl.arange(0, KEY_BLOCK)
        dd = tl.arange(0, DOT_D)
        q_rows = q + h.to(tl.int64) * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + i * HALF
        base = keys + (h * 2 + i).to(tl.int64) * n_keys * HALF
        top = tl.full([BLOCK_N, KNN], EMPTY, tl.int64)
        for s in range(0, n_keys, KEY_BLOCK):  # a block of sub-keys, merged into the top-knn
            k_ok = s + kb < n_keys
            scores = tl.zeros([BLOCK_N, KEY_BLOCK], dtype=tl.float32)
            for c in tl.static_range(0, BLOCK_D, DOT_D):
                d = c + dd
                qi = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & (d[None, :] < HALF),
                             other=0)
                kt = tl.load(base + (s + kb)[None, :] * HALF + d[:, None],
                             mask=k_ok[None, :] & (d[:, None] < HALF), other=0)
                if UPCAST:  # the interpreter's bf16 tl.dot reads the bits wrong (Triton 3.9)
                    scores = tl.dot(qi.to(tl.float32), kt.to(tl.float32), scores,
                                    input_precision="ieee")
                else:  # float32 accumulation
                    scores = tl.dot(qi, kt, scores, input_precision=PRECISION)
            packed = tl.where(k_ok[None, :], _pack(scores, 0x7FFFFFFF - (s + kb)[None, :]), EMPTY)
            top = _take_top(packed, top, knn, KNN, EMPTY)
        return top

    def _search_kernel(q, keys, scratch, w_out, slot_out, sub_out, n, heads, n_keys, knn,
                       stride_qh, stride_qn, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT_D: tl.constexpr, KEY_BLOCK: tl.constexpr,
                       KNN: tl.constexpr, PAIRS: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
        EMPTY: tl.constexpr = -9223372036854775807 - 1  # below every packed key
        h = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        pos = tl.arange(0, KNN)
        keep = pos < knn
        # the two half lists go through this program's scratch [2, BLOCK_N, KNN], from which the
        # candidate pairs are gathered
        mine = scratch + (tl.program_id(0) * heads + h).to(tl.int64) * (2 * BLOCK_N * KNN)
        local = tl.arange(0, BLOCK_N)[:, None] * KNN
        for i in tl.static_range(2):
            top = _half_topk(q, keys, h, i, rows, row_ok, n_keys, knn, stride_qh, stride_qn,
                             HALF, BLOCK_N, BLOCK_D, DOT_D, KEY_BLOCK, KNN, PRECISION, UPCAST,
                             EMPTY)
            tl.store(mine + i * BLOCK_N * KNN + local + pos[None, :], top)
        tl.debug_barrier()
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
        ok = (j < end)[None, :]
        p1 = tl.load(mine + local + a[None, :], mask=ok, other=EMPTY)
        p2 = tl.load(mine + BLOCK_N * KNN + local + (j - start)[None, :], mask=ok, other=EMPTY)
        id1 = 0x7FFFFFFF - (p1 & 0x7FFFFFFF).to(tl.int32)
        id2 = 0x7FFFFFFF - (p2 & 0x7FFFFFFF).to(tl.int32)
        max_slot = n_keys * n_keys - 1
        # ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ in float32, as the reference adds them; ties: the lower slot
        cand = tl.where(ok, _pack(_unpack_score(p1) + _unpack_score(p2),
                                  max_slot - (id1 * n_keys + id2)), EMPTY)
        final = _take_top(cand, tl.full([BLOCK_N, KNN], EMPTY, tl.int64), knn, KNN, EMPTY)
        slot = max_slot - (final & 0x7FFFFFFF).to(tl.int32)
        score = tl.where(keep[None, :], _unpack_score(final), float("-inf"))
        e = tl.exp(score - tl.max(score, 1)[:, None])  # (the first is the largest)
        w = e / tl.sum(e, 1)[:, None]
        nh = rows.to(tl.int64)[:, None] * heads + h
        ok = row_ok[:, None] & keep[None, :]
        tl.store(w_out + nh * knn + pos[None, :], w, mask=ok)
        tl.store(slot_out + nh * knn + pos[None, :], slot, mask=ok)
        tl.store(sub_out + nh * 2 * knn + pos[None, :], slot // n_keys, mask=ok)
        tl.store(sub_out + nh * 2 * knn + knn + pos[None, :], slot % n_keys, mask=ok)

    def _query_backward_kernel(grad_w, w, sub, q, keys, grad_q, grad_s, grad_keys, n, heads,
                               n_keys, knn, stride_qh, stride_qn, HALF: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KNN: tl.constexpr,
                               ATOMIC: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HALF
        pos = tl.arange(0, KNN)
        nh = rows.to(tl.int64) * heads + h
        ok = row_ok[:, None] & (pos < knn)[None, :]
        wt = tl.load(w + nh[:, None] * knn + pos[None, :], mask=ok, other=0).to(tl.float32)
        gw = tl.load(grad_w + nh[:, None] * knn + pos[None, :], mask=ok, other=0).to(tl.float32)
        g = wt * (gw - tl.sum(wt * gw, 1)[:, None])  # ∂L/∂score: the softmax's backward
        if not ATOMIC:  # the key-gradient kernel reads it
            tl.store(grad_s + nh[:, None] * knn + pos[None, :], g, mask=ok)
        q_rows = h.to(tl.int64) * stride_qh + rows.to(tl.int64)[:, None] * stride_qn
        for i in tl.static_range(2):
            base = (h * 2 + i).to(tl.int64) * n_keys
            if ATOMIC:
                qi = tl.load(q + q_rows + i * HALF + d[None, :],
                             mask=row_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for j in range(0, knn):
                gj = tl.sum(tl.where(pos[None, :] == j, g, 0.0), 1)
                r = tl.load(sub + (nh * 2 + i) * knn + j, mask=row_ok, other=0)
                where = (base + r)[:, None] * HALF + d[None, :]
                m = row_ok[:, None] & d_ok[None, :]
                acc += gj[:, None] * tl.load(keys + where, mask=m, other=0).to(tl.float32)
                if ATOMIC:
                    tl.atomic_add(grad_keys + where, gj[:, None] * qi, mask=m)
            tl.store(grad_q + nh[:, None] * 2 * HALF + i * HALF + d[None, :],
                     acc.to(grad_q.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    def _key_backward_kernel(grad_s, order, starts, counts, q, grad_keys, heads, knn, n_keys,
                             stride_qh, stride_qn, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)  # the sub-key row (h·2 + i)·n_keys + r
        i = (p // n_keys) % 2
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HALF
        start = tl.load(starts + p)
        count = tl.load(counts + p)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, count, BLOCK_R):
            t = s + tl.arange(0, BLOCK_R)
            t_ok = t < count
            # read ((n·H + h)·2 + i)·knn + j
            read = tl.load(order + start + t, mask=t_ok, other=0).to(tl.int64)
            nh = read // (2 * knn)
            g = tl.load(grad_s + nh * knn + read % knn, mask=t_ok, other=0)
            qr = tl.load(q + (nh % heads)[:, None] * stride_qh + (nh // heads)[:, None] * stride_qn
                         + i * HALF + d[None, :], mask=t_ok[:, None] & d_ok[None, :],
                         other=0).to(tl.float32)
            acc += tl.sum(g[:, None] * qr, 0)
        tl.store(grad_keys + p * HALF + d, acc, mask=d_ok)

    return (triton.jit(_search_kernel), triton.jit(_query_backward_kernel),
            triton.jit(_key_backward_kernel))


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs: IEEE products and sums (TF32 would round the inputs to 10 mantissa bits and
    # rank near-ties differently from the float32 reference)
    return "ieee" if dtype == torch.float32 else "tf32"


def search_launch(half: int, knn: int, n_keys: int) -> Tuple[int, int, int, int, int]:
    """``(BLOCK_D, DOT_D, KEY_BLOCK, KNN, PAIRS)``: the padded half width; the dims a tl.dot step
    takes (16 at least); the sub-keys scored a step (16 at least, tl.dot's least; at most
    :data:`KEY_BLOCK`); the padded knn; the padded number of candidate pairs."""
    block_d = max(16, pkm_triton._pow2(half))
    return (block_d, min(block_d, DOT_D), max(16, min(KEY_BLOCK, pkm_triton._pow2(n_keys))),
            pkm_triton._pow2(knn), pkm_triton._pow2(sum(knn // (a + 1) for a in range(knn))))


def why_unavailable(query: Tensor, keys: Tensor, knn: int) -> Optional[str]:
    """None when the kernels can search these tensors, else one line saying why not."""
    if not pkm_triton.HAS_TRITON:
        return "Triton is not importable (pip install triton; it ships with CUDA builds of torch)"
    if not (query.is_cuda or (pkm_triton.interpreted() and query.device.type == "cpu")):
        return pkm_triton.needs_cuda("the queries are", query.device.type)
    if keys.size(-1) > MAX_HALF or knn > MAX_KNN or keys.size(-2) > MAX_KEYS:
        return (f"the search kernel takes k_dim/2 <= {MAX_HALF}, knn <= {MAX_KNN} and n_keys <= "
                f"{MAX_KEYS}, got {keys.size(-1)}, {knn} and {keys.size(-2)}")
    return None


class SearchUnavailable(pkm_triton.KernelUnavailable):
    """``search_kernel="triton"`` where the fused search cannot run (``why``)."""

    def __init__(self, why: str):
        super().__init__(why, argument="search_kernel",
                         instead="'torch' (or 'auto': the kernel where it runs)")


def use_kernel(kernel: str, query: Tensor, keys: Tensor, knn: int) -> bool:
    """Resolve ``kernel`` ("auto", "triton", "torch") for a search of these tensors: auto = the
    kernels on CUDA when they can run; triton where they cannot: one line with the fix."""
    if kernel == "torch":
        return False
    why = why_unavailable(query, keys, knn)
    if kernel == "triton" and why:
        raise SearchUnavailable(why)
    return why is None and (kernel == "triton" or query.is_cuda)


def _check(query: Tensor, keys: Tensor, knn: int):
    h, _, k_dim = query.shape
    if keys.dim() != 4 or keys.size(0) != h or keys.size(1) != 2 or 2 * keys.size(3) != k_dim:
        raise ValueError(f"PKM search: keys must be [H, 2, n_keys, k_dim/2] = [{h}, 2, n_keys, "
                         f"{k_dim // 2}] for queries {list(query.shape)}, got {list(keys.shape)}")
    if not 1 <= knn <= keys.size(2):
        raise ValueError(f"PKM search: knn must be in 1..n_keys ({keys.size(2)}), got {knn}")


def _search(query: Tensor, keys: Tensor, knn: int, key_block: Optional[int] = None,
            dot_d: Optional[int] = None, precision: Optional[str] = None
            ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`search_op`; ``key_block``, ``dot_d`` (of :func:`search_launch`) and the tl.dot
    ``precision`` (:func:`_precision`) may be given (the benchmark's launch rows)."""
    search_kernel = _kernels()[0]
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
        block_d, default_dot, default_block, knn_p, pairs = search_launch(half, knn, n_keys)
        grid = (-(-n // BLOCK_N), h)
        scratch = torch.empty(grid[0] * h * 2 * BLOCK_N * knn_p, dtype=torch.int64,
                              device=query.device)
        search_kernel[grid](
            query, keys, scratch, w, slots, sub, n, h, n_keys, knn, query.stride(0),
            query.stride(1), HALF=half, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            DOT_D=dot_d or default_dot, KEY_BLOCK=key_block or default_block, KNN=knn_p,
            PAIRS=pairs, PRECISION=precision or _precision(query.dtype),
            UPCAST=query.dtype == torch.bfloat16 and pkm_triton.interpreted(), num_warps=4)
    return w, slots, sub


def _backward(grad_w: Tensor, weights: Tensor, sub: Tensor, query: Tensor, keys: Tensor,
              method: str) -> Tuple[Tensor, Tensor]:
    if method not in KEY_BACKWARDS:
        raise ValueError(f"PKM search backward must be one of {', '.join(KEY_BACKWARDS)}, "
                         f"got {method!r}")
    query_kernel, key_kernel = _kernels()[1:]
    h, n, k_dim = query.shape
    n_keys, half = keys.size(2), keys.size(3)
    knn = weights.size(-1)
    if query.stride(2) != 1:
        query = query.contiguous()
    keys_q = keys.to(query.dtype).contiguous()
    atomic = method == "atomic"
    grad_q = torch.empty(n, h, k_dim, dtype=query.dtype, device=query.device)
    grad_keys = torch.zeros(h, 2, n_keys, half, dtype=torch.float32, device=query.device) \
        if atomic else torch.empty(h, 2, n_keys, half, dtype=torch.float32, device=query.device)
    grad_s = torch.empty(n, h, knn, dtype=torch.float32, device=query.device)
    block_d, _, _, knn_p, _ = search_launch(half, knn, n_keys)
    if n:
        query_kernel[(-(-n // BLOCK_N), h)](
            grad_w.contiguous(), weights, sub, query, keys_q, grad_q, grad_s, grad_keys, n, h,
            n_keys, knn, query.stride(0), query.stride(1), HALF=half, BLOCK_N=BLOCK_N,
            BLOCK_D=block_d, KNN=knn_p, ATOMIC=atomic, num_warps=4)
    if not atomic:  # the reads sorted by sub-key row; one program per row, in read order
        rows = (sub + _row_offsets(h, n_keys, sub.device)).view(-1)
        rows_sorted, order = torch.sort(rows, stable=True)
        starts, counts = pkm_triton.row_ranges(rows_sorted, h * 2 * n_keys)
        key_kernel[(h * 2 * n_keys,)](
            grad_s, order, starts, counts, query, grad_keys, h, knn, n_keys, query.stride(0),
            query.stride(1), HALF=half, BLOCK_R=max(1, KEY_ROWS // block_d), BLOCK_D=block_d,
            num_warps=4)
    return grad_q.transpose(0, 1), grad_keys.to(keys.dtype)


@cached_constant
def _row_offsets(heads: int, n_keys: int, device) -> Tensor:
    """[1, H, 2, 1] (int32): the first row of sub-key set (head, half) in [H·2·n_keys, k_dim/2]."""
    return torch.arange(0, heads * 2 * n_keys, n_keys, dtype=torch.int32,
                        device=device).view(1, heads, 2, 1)


# ---- the custom ops (torch.compile traces them as single nodes) -------------------------------

@torch.library.custom_op("attnzoo::pkm_search", mutates_args=())
def search_op(query: Tensor, keys: Tensor, knn: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(query [H, N, k_dim], keys [H, 2, n_keys, k_dim/2], knn)`` -> softmax weights
    ``[N, H, knn]`` (float32), slots ``[N, H, knn]`` and sub-key ids ``[N, H, 2, knn]`` (int32);
    slots sorted by score, largest first."""
    return _search(query, keys, knn)


@search_op.register_fake
def _(query, keys, knn):
    _check(query, keys, knn)
    h, n, _ = query.shape
    return (query.new_empty(n, h, knn, dtype=torch.float32),
            query.new_empty(n, h, knn, dtype=torch.int32),
            query.new_empty(n, h, 2, knn, dtype=torch.int32))


@torch.library.custom_op("attnzoo::pkm_search_backward", mutates_args=())
def search_backward_op(grad_w: Tensor, weights: Tensor, sub: Tensor, query: Tensor, keys: Tensor,
                       method: str) -> Tuple[Tensor, Tensor]:
    """The gradients of :func:`search_op` with respect to query and keys (``method``: one of
    :data:`KEY_BACKWARDS`), in their dtypes."""
    return _backward(grad_w, weights, sub, query, keys, method)


@search_backward_op.register_fake
def _(grad_w, weights, sub, query, keys, method):
    h, n, k_dim = query.shape
    return query.new_empty(n, h, k_dim).transpose(0, 1), torch.empty_like(keys)


def _setup(ctx, inputs, output):
    query, keys, _ = inputs
    weights, _, sub = output
    ctx.save_for_backward(weights, sub, query, keys)
    ctx.method = KEY_BACKWARD


def _grad(ctx, grad_w, _slots, _sub):
    weights, sub, query, keys = ctx.saved_tensors
    if grad_w is None:
        return None, None, None
    grad_q, grad_keys = search_backward_op(grad_w, weights, sub, query, keys, ctx.method)
    return grad_q, grad_keys, None


search_op.register_autograd(_grad, setup_context=_setup)


def search(query: Tensor, keys: Tensor, knn: int) -> Tuple[Tensor, Tensor]:
    """The fused product-key search, differentiable in ``query`` and ``keys``: softmax weights
    ``[N, H, knn]`` (float32) and slots ``[N, H, knn]`` (int32), token-major like the value read
    takes them (:meth:`ProductKeyMemory.lookup`'s kernel path)."""
    weights, slots, _ = search_op(query, keys, knn)
    return weights, slots

"""A Triton kernel for attention over a shared parameter memory (AOP's sublayer, :mod:`.aop`).

Every token n of every head h reads the same n_p keys and values::

    O[n, h] = c · Σ_j softmax_j(s · q[n, h]·K[h, j]) V[h, j]     (s: the logit scale, c: V's)

The reference is the module's SDPA path (``F.scaled_dot_product_attention`` over the tokens as a
sequence, then ``· c``); this computes the same, with the constant c folded into the kernel
(applied to the output tile and to dV, no pass over V), in three launches:

* **forward**, one program per (block of tokens, head): the query tile stays on chip while it
  walks the slot blocks with an online softmax (as FlashAttention); it writes O and the
  log-sum-exp per token (fp32);
* **dQ**, one program per (block of tokens, head): recomputes the probabilities block by block,
  ``dQ = s · Σ_j P (c·dO·V_j − Δ) K_j`` with ``Δ = rowsum(dO ∘ O)``, which it computes from its
  own tiles and stores for the next kernel;
* **dK, dV**, one program per (block of slots, head, **chunk of tokens**): the memory is shared by
  all N tokens, so a program per slot block alone gives only h·n_p/block programs (SDPA's
  backward, one sequence of blocks of 128 slots at AOP₁'s shape: 96, for an H100's 132 SMs). Splitting the token sum
  into chunks gives h·n_p/block × chunks programs; each writes its chunk's partial sums in fp32
  to its own slice of a ``[chunks, h, n_p, d]`` buffer, summed after (one ``sum`` over the
  chunks) -- no atomics, so the result is deterministic. :func:`token_chunks` picks enough chunks
  for a few programs per SM (one chunk: written straight into the gradient).

All products accumulate in fp32 (``tl.dot``; fp32 inputs in IEEE precision, not TF32);
probabilities are cast to the values' dtype for the P·V product, as FlashAttention does.

Triton is optional and imported on first use; the kernels run on CUDA tensors, or on CPU tensors
in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is imported (how the
tests compare them with the SDPA reference without a GPU). The launch sizes below are not tuned
on a GPU yet (the benchmark case ``aop/sublayer-vs-ffn`` times this kernel and SDPA's backends
against the FFN).
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .pkm_triton import HAS_TRITON, interpreted, needs_cuda

#: tokens and slots per tile on CUDA (interpreter: 16, the smallest ``tl.dot`` tile)
BLOCK_TOKENS, BLOCK_SLOTS = 64, 64
#: the same for float32 inputs (IEEE ``tl.dot``: FMA code, no tensor cores): the largest tiles
#: whose three kernels compile for sm_90 without a spill (tests/test_sm90_spills.py; at 64 x 64
#: the dK/dV kernel kept 11 KB of stack a thread, the dQ kernel 6 KB)
FP32_BLOCK_TOKENS, FP32_BLOCK_SLOTS = 32, 16
#: the dK/dV kernel aims at this many programs per SM (token chunks fill what the slots leave)
PROGRAMS_PER_SM = 4
#: head dims up to this (padded to a power of two) fit one tile
MAX_HEAD_DIM = 256
_LOG2E = 1.0 / math.log(2.0)


def available(q: Tensor) -> bool:
    """The kernel can run on ``q``'s device (CUDA, or the CPU under Triton's interpreter)."""
    return HAS_TRITON and (q.is_cuda or (interpreted() and q.device.type == "cpu"))


def why_unavailable(q: Tensor, key_dim: int, value_dim: int) -> Optional[str]:
    """One line: why the kernel cannot run on ``q``'s device for these head dims (None: it can)."""
    if not HAS_TRITON:
        return "Triton is not importable (pip install triton; it ships with CUDA builds of torch)"
    if max(key_dim, value_dim) > MAX_HEAD_DIM:
        return f"head dims {key_dim}/{value_dim} exceed the kernel's {MAX_HEAD_DIM}"
    if not available(q):
        return needs_cuda("the tokens are", q.device.type)
    return None


_KERNELS = []
triton = tl = _dot = None  # set by _define()


def _kernels():
    if not _KERNELS:
        _KERNELS.extend(_define())
    return _KERNELS


def _define():
    global triton, tl, _dot  # (a jitted kernel finds the functions it calls here)
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        """``a @ b`` accumulated in fp32. PRECISION "bf16-interpreted": bf16 operands widened to
        fp32 first -- exact (a product of two bf16 is exact in fp32), and needed because Triton
        3.9's interpreter multiplies bf16 operands' raw bits; on a GPU the dot takes bf16."""
        if PRECISION == "bf16-interpreted":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=PRECISION)

    def _forward_kernel(q, k, v, o, lse, n, slots, dk, dv, stride_qn, stride_qh, qk_scale,
                        v_scale, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
        h = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ck, cv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
        row_ok = rows < n
        qt = tl.load(q + rows[:, None] * stride_qn + h * stride_qh + ck[None, :],
                     mask=row_ok[:, None] & (ck < dk)[None, :], other=0)
        k_h, v_h = k + h * slots * dk, v + h * slots * dv
        m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for start in range(0, slots, BLOCK_P):
            cols = start + tl.arange(0, BLOCK_P)
            col_ok = cols < slots
            kt = tl.load(k_h + cols[None, :] * dk + ck[:, None],
                         mask=col_ok[None, :] & (ck < dk)[:, None], other=0)
            s = _dot(qt, kt, PRECISION) * qk_scale  # log2 units
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_h + cols[:, None] * dv + cv[None, :],
                         mask=col_ok[:, None] & (cv < dv)[None, :], other=0)
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRECISION)
            m_i = m_new
        acc = acc * (v_scale / l_i)[:, None]
        tl.store(o + rows[:, None] * (tl.num_programs(1) * dv) + h * dv + cv[None, :],
                 acc.to(o.dtype.element_ty), mask=row_ok[:, None] & (cv < dv)[None, :])
        tl.store(lse + h * n + rows, m_i + tl.log2(l_i), mask=row_ok)

    def _dq_kernel(q, k, v, o, do, lse, delta, dq, n, slots, dk, dv, stride_qn, stride_qh,
                   qk_scale, k_scale, v_scale, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
        h = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ck, cv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
        row_ok = rows < n
        qmask, vmask = row_ok[:, None] & (ck < dk)[None, :], row_ok[:, None] & (cv < dv)[None, :]
        qt = tl.load(q + rows[:, None] * stride_qn + h * stride_qh + ck[None, :], mask=qmask,
                     other=0)
        out_rows = rows[:, None] * (tl.num_programs(1) * dv) + h * dv + cv[None, :]
        g = tl.load(do + out_rows, mask=vmask, other=0)
        d_i = tl.sum(g.to(tl.float32) * tl.load(o + out_rows, mask=vmask, other=0).to(
            tl.float32), 1)  # Δ = rowsum(dO ∘ O)
        tl.store(delta + h * n + rows, d_i, mask=row_ok)
        lse_i = tl.load(lse + h * n + rows, mask=row_ok, other=0)
        k_h, v_h = k + h * slots * dk, v + h * slots * dv
        acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
        for start in range(0, slots, BLOCK_P):
            cols = start + tl.arange(0, BLOCK_P)
            col_ok = cols < slots
            kt = tl.load(k_h + cols[:, None] * dk + ck[None, :],
                         mask=col_ok[:, None] & (ck < dk)[None, :], other=0)  # [P, DK]
            vt = tl.load(v_h + cols[None, :] * dv + cv[:, None],
                         mask=col_ok[None, :] & (cv < dv)[:, None], other=0)  # [DV, P]
            s = _dot(qt, tl.trans(kt), PRECISION) * qk_scale
            p = tl.exp2(tl.where(col_ok[None, :], s, float("-inf")) - lse_i[:, None])
            dp = _dot(g, vt, PRECISION) * v_scale
            ds = p * (dp - d_i[:, None])
            acc += _dot(ds.to(kt.dtype), kt, PRECISION)
        tl.store(dq + rows[:, None] * (tl.num_programs(1) * dk) + h * dk + ck[None, :],
                 (acc * k_scale).to(dq.dtype.element_ty), mask=qmask)

    def _dkv_kernel(q, k, v, do, lse, delta, dk_out, dv_out, n, slots, dk, dv, stride_qn,
                    stride_qh, chunk, qk_scale, k_scale, v_scale,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
        h, c = tl.program_id(1), tl.program_id(2)
        heads = tl.num_programs(1)
        cols = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        ck, cv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
        col_ok = cols < slots
        kmask, vmask = col_ok[:, None] & (ck < dk)[None, :], col_ok[:, None] & (cv < dv)[None, :]
        kt = tl.load(k + (h * slots + cols[:, None]) * dk + ck[None, :], mask=kmask, other=0)
        vt = tl.load(v + (h * slots + cols[:, None]) * dv + cv[None, :], mask=vmask, other=0)
        acc_k = tl.zeros([BLOCK_P, BLOCK_DK], tl.float32)
        acc_v = tl.zeros([BLOCK_P, BLOCK_DV], tl.float32)
        for start in range(c * chunk, tl.minimum(c * chunk + chunk, n), BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            row_ok = rows < n
            qt = tl.load(q + rows[:, None] * stride_qn + h * stride_qh + ck[None, :],
                         mask=row_ok[:, None] & (ck < dk)[None, :], other=0)  # [N, DK]
            g = tl.load(do + rows[:, None] * (heads * dv) + h * dv + cv[None, :],
                          mask=row_ok[:, None] & (cv < dv)[None, :], other=0)  # [N, DV]
            # a row past the tokens has lse +inf: its probabilities are 0
            lse_i = tl.load(lse + h * n + rows, mask=row_ok, other=float("inf"))
            d_i = tl.load(delta + h * n + rows, mask=row_ok, other=0)
            pt = tl.exp2(_dot(kt, tl.trans(qt), PRECISION) * qk_scale
                         - lse_i[None, :])  # Pᵀ [P, N]
            acc_v += _dot(pt.to(g.dtype), g, PRECISION)
            dpt = _dot(vt, tl.trans(g), PRECISION) * v_scale
            dst = pt * (dpt - d_i[None, :])
            acc_k += _dot(dst.to(qt.dtype), qt, PRECISION)
        part = c * heads * slots  # this chunk's slice of the partial sums (chunk 0: all)
        tl.store(dk_out + part * dk + (h * slots + cols[:, None]) * dk + ck[None, :],
                 (acc_k * k_scale).to(dk_out.dtype.element_ty), mask=kmask)
        tl.store(dv_out + part * dv + (h * slots + cols[:, None]) * dv + cv[None, :],
                 (acc_v * v_scale).to(dv_out.dtype.element_ty), mask=vmask)

    return triton.jit(_forward_kernel), triton.jit(_dq_kernel), triton.jit(_dkv_kernel)


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, int(x) - 1).bit_length())  # (tl.dot's smallest tile: 16)


def _blocks(device: torch.device, dtype: torch.dtype) -> Tuple[int, int]:
    if device.type != "cuda":
        return 16, 16
    if dtype == torch.float32:
        return FP32_BLOCK_TOKENS, FP32_BLOCK_SLOTS
    return BLOCK_TOKENS, BLOCK_SLOTS


def token_chunks(n: int, heads: int, slots: int, device: torch.device, dtype: torch.dtype
                 ) -> int:
    """How many token chunks the dK/dV kernel splits the sum over tokens into: enough for
    :data:`PROGRAMS_PER_SM` programs per SM beside the h·⌈n_p/block⌉ slot blocks, at most one
    chunk per token block (CPU: 1)."""
    block_n, block_p = _blocks(device, dtype)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    slot_programs = heads * -(-slots // block_p)
    return max(1, min(-(-PROGRAMS_PER_SM * sms // slot_programs), -(-n // block_n)))


def _launch(q: Tensor, k: Tensor, v: Tensor):
    """The shared launch arguments: sizes, q's strides, tile sizes, the dot precision."""
    n, heads, dk = q.shape
    slots, dv = k.size(1), v.size(2)
    block_n, block_p = _blocks(q.device, q.dtype)
    precision = ("ieee" if q.dtype == torch.float32  # (tf32: unused for 16-bit dots)
                 else "bf16-interpreted" if q.dtype == torch.bfloat16 and not q.is_cuda
                 else "tf32")
    meta = dict(PRECISION=precision, BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_DK=_pow2(dk),
                BLOCK_DV=_pow2(dv))
    return n, heads, slots, dk, dv, meta


def forward(q: Tensor, k: Tensor, v: Tensor, key_scale: float, value_scale: float
            ) -> Tuple[Tensor, Tensor]:
    """``(O [N, h, d_pv], lse [h, N] fp32, base 2)`` for queries ``q [N, h, d_pk]`` (last dim
    contiguous), keys ``k [h, n_p, d_pk]``, values ``v [h, n_p, d_pv]``."""
    fwd = _kernels()[0]
    n, heads, slots, dk, dv, meta = _launch(q, k, v)
    o = torch.empty(n, heads, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, n, dtype=torch.float32, device=q.device)
    if n:
        fwd[(-(-n // meta["BLOCK_N"]), heads)](
            q, k, v, o, lse, n, slots, dk, dv, q.stride(0), q.stride(1), key_scale * _LOG2E,
            value_scale, **meta)
    return o, lse


def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
             key_scale: float, value_scale: float, chunks: Optional[int] = None
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` of :func:`forward` for the output gradient ``grad [N, h, d_pv]``.
    ``chunks``: token chunks of the dK/dV kernel (default :func:`token_chunks`)."""
    _, dq_kernel, dkv_kernel = _kernels()
    n, heads, slots, dk, dv, meta = _launch(q, k, v)
    grad = grad.contiguous()
    dq = torch.empty(n, heads, dk, dtype=q.dtype, device=q.device)
    delta = torch.empty(heads, n, dtype=torch.float32, device=q.device)
    scales = (key_scale * _LOG2E, key_scale, value_scale)
    if n == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    dq_kernel[(-(-n // meta["BLOCK_N"]), heads)](
        q, k, v, o, grad, lse, delta, dq, n, slots, dk, dv, q.stride(0), q.stride(1), *scales,
        **meta)
    if chunks is None:
        chunks = token_chunks(n, heads, slots, q.device, q.dtype)
    blocks = -(-n // meta["BLOCK_N"])
    chunk = -(-blocks // chunks) * meta["BLOCK_N"]  # tokens a chunk: whole token blocks
    chunks = -(-n // chunk)  # (none left empty)
    if chunks == 1:  # the gradients themselves
        d_k, d_v = torch.empty_like(k), torch.empty_like(v)
    else:  # fp32 partial sums per chunk, summed below
        d_k = torch.empty(chunks, *k.shape, dtype=torch.float32, device=k.device)
        d_v = torch.empty(chunks, *v.shape, dtype=torch.float32, device=v.device)
    dkv_kernel[(-(-slots // meta["BLOCK_P"]), heads, chunks)](
        q, k, v, grad, lse, delta, d_k, d_v, n, slots, dk, dv, q.stride(0), q.stride(1), chunk,
        *scales, **meta)
    if chunks > 1:
        d_k, d_v = d_k.sum(0).to(k.dtype), d_v.sum(0).to(v.dtype)
    return dq, d_k, d_v


def sm90_specializations():
    """``(label, kernel, signature, constexprs, num_warps)`` of every specialisation the layer and
    the benchmark launch at the paper's shape (AOP₁ and AOP₂ at d 512: head dims 64, 1,536 or 512
    slots, 16,384 tokens; ``i32:16``: an integer the launcher specialises as divisible by 16), in
    each dtype, for the spill check (scripts/sm90.py). Launched with Triton's default 4 warps."""
    scalars = dict(n="i32:16", slots="i32:16", dk="i32:16", dv="i32:16", stride_qn="i32:16",
                   stride_qh="i32:16")
    for dt, precision in (("fp32", "ieee"), ("fp16", "tf32"), ("bf16", "tf32")):
        block_n, block_p = _blocks(torch.device("cuda"), getattr(torch, dict(
            fp32="float32", fp16="float16", bf16="bfloat16")[dt]))
        meta = dict(BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_DK=64, BLOCK_DV=64)
        t = f"*{dt}"
        sigs = [dict(q=t, k=t, v=t, o=t, lse="*fp32", **scalars, qk_scale="fp32", v_scale="fp32"),
                dict(q=t, k=t, v=t, o=t, do=t, lse="*fp32", delta="*fp32", dq=t, **scalars,
                     qk_scale="fp32", k_scale="fp32", v_scale="fp32"),
                dict(q=t, k=t, v=t, do=t, lse="*fp32", delta="*fp32", dk_out="*fp32",
                     dv_out="*fp32", **scalars, chunk="i32:16", qk_scale="fp32", k_scale="fp32",
                     v_scale="fp32")]
        for kernel, sig in zip(_kernels(), sigs):
            sig.update({k: "constexpr" for k in ("PRECISION", *meta)})
            yield (f"{kernel.fn.__name__} {dt}", kernel, sig, dict(meta, PRECISION=precision), 4)


class ParameterAttention(torch.autograd.Function):
    """``O = c · softmax(s · q Kᵀ) V`` per head over a shared memory, by the kernels above."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_scale: float, value_scale: float,
                chunks: Optional[int] = None) -> Tensor:
        q = q if q.stride(-1) == 1 else q.contiguous()
        k, v = k.contiguous(), v.contiguous()
        o, lse = forward(q, k, v, key_scale, value_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scales, ctx.chunks = (key_scale, value_scale), chunks
        return o

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(grad, q, k, v, o, lse, *ctx.scales, chunks=ctx.chunks)
        return dq, dk, dv, None, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, key_scale: float, value_scale: float = 1.0,
              chunks: Optional[int] = None) -> Tensor:
    """``[N, h, d_pv]``: for each token and head, ``value_scale · softmax(key_scale · q Kᵀ) V``
    over the ``[h, n_p, ·]`` memory ``k``, ``v``, differentiable in q, k and v."""
    return ParameterAttention.apply(q, k, v, key_scale, value_scale, chunks)

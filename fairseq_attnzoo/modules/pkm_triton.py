"""Fused Triton kernels for the product-key memory's value read and its gradients.

The reference is :class:`~fairseq_attnzoo.modules.pkm_values._WeightedRowSum` in plain PyTorch
(ATen's embedding-bag kernels); these kernels compute the same three quantities, each accumulated in
float32 whatever the table's dtype, and are used on CUDA when Triton is importable
(``ProductKeyMemory(kernel="auto")``, fairseq ``--pkm-kernel``):

* **read** ``out[n] = Σ_j w[n, j] · V[idx[n, j]]``: one program per token and chunk of at most
  :data:`READ_COLS` columns, its k·heads rows read once each, one rounding at the end;
* **backward**: the reads sorted by table row once (one ``torch.sort`` of 32-bit row ids); then
  for each table row r (dense gradient: every row, so the |K| × d gradient is written once with
  no zero-fill; sparse: each distinct row read, a U × d coalesced gradient)::

        ∂L/∂V[r]  = Σ_{i: idx_i = r} w_i · grad[token_i]     (the value gradient)
        ∂L/∂w_i   = ⟨grad[token_i], V[r]⟩                     (the weight gradient, stored at i)

  Each read's output-gradient row is gathered once and serves both products; the table row is
  read once instead of once per read; every sum runs in an order fixed by the launch, so both
  gradients are deterministic (no atomics). Two kernels (:data:`BACKWARDS`):

  - ``"blocks"`` (fp16/bf16, the default there): one program per block of ``rows`` table rows
    (16) and column chunk. Its reads are one contiguous run of the sorted reads, taken a tile of
    ``reads`` (64) at a time: the tile's output-gradient rows ``G`` [reads, cols] are gathered
    once (Triton pipelines the gather into shared memory), and both gradients are tensor-core
    products with the tile's read-to-row matrix ``S`` [reads, rows] (``S[t, u] = w_t`` where read
    t is of row u, else 0): ``∂V[block] += Sᵀ·G`` and the weight gradients ``(G·V[block]ᵀ)[t,
    row_t]``. Products of two 16-bit numbers are exact in the float32 accumulator, so this is the
    reference's arithmetic in another order. 262,144 rows at 8 reads each become 16,384 row
    blocks of ~128 reads instead of 262,144 programs of ~8 (the "rows" kernel's: 1.10 ms dense
    at d 512 on an H200, docs/performance.md, ``pkm/value-read``);
  - ``"rows"`` (float32, and inputs of mixed dtypes): one program per table row walking its reads
    a few at a time in plain float32 FMAs -- float32 tensor-core products would round the inputs
    (TF32), and IEEE float32 ``tl.dot`` spills registers on sm_90. The benchmark case
    ``pkm/launch-sweep`` also times it in bf16 beside "blocks" (one run, the same rows).

  This replaces ATen's two embedding-bag calls and the float32 gather fallback that bfloat16
  needs on CUDA (ATen has no bf16 CUDA kernel for the weight gradient).

Triton is optional and imported on first use: without it (or on a CPU) the reference path runs.
With ``TRITON_INTERPRET=1`` in the environment before Triton is imported, the kernels run on CPU
tensors in Triton's interpreter -- that is how the tests compare them with the reference on
machines without a GPU (tests/conftest.py sets it). :func:`sm90_specializations` lists what the
layer and the benchmark launch, for the spill check (scripts/sm90.py).
"""

import importlib.util
import os
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .constants import cached_constant

#: table rows of at most this many elements are handled by one program (larger: reference path)
MAX_DIM = 8192
#: elements of the [reads, columns] tile a read program holds at once
_TILE = 8192
#: elements of the rows backward's [reads, columns] tile: at d 512 on an H100, 4 reads a step
#: (1.06 ms) beat 8 (1.46 ms) and 16 (2.60 ms) (pkm/launch-sweep; a wider row is split in chunks)
_BACKWARD_TILE = 2048
#: widest column chunk of one read or rows-backward program: a wider row is split over several
#: programs, each like a d-512 program (a whole d-1024 row per program read further from the copy
#: bandwidth on an H100 and took 11x the backward time of d 512 on an H200: docs/performance.md,
#: ``pkm/value-read``; CHANGELOG)
READ_COLS = 512
#: widest column chunk of a blocks-backward program: its products hold a [cols, rows] float32
#: accumulator and stage [reads, cols] tiles in shared memory; at 256 columns, 16 rows, 64 reads
#: and 8 warps a thread takes 110 registers on sm_90 (2 programs an SM), no spill
#: (scripts/sm90.py); at 512 columns 171 (1 an SM)
BLOCK_COLS = 256


class Launch(NamedTuple):
    """How the read or the rows backward is launched: ``cols`` columns per program (a row wider
    than that is split over programs along the grid's second axis), ``rows`` reads per loop step,
    ``warps`` per program. The defaults are :func:`read_launch` / :func:`backward_launch`; the
    benchmark case ``pkm/launch-sweep`` times alternatives on a GPU."""

    cols: int
    rows: int
    warps: int


class BlockLaunch(NamedTuple):
    """How the blocks backward is launched: ``cols`` columns per program (a wider row: several
    programs, whose weight-gradient dots are partial sums), ``rows`` table rows per program,
    ``reads`` sorted reads per tile, ``warps`` per program (:func:`block_launch`)."""

    cols: int
    rows: int
    reads: int
    warps: int


HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def value_kernel_available(table: Tensor) -> bool:
    """The value kernels can run on ``table``'s device and width."""
    if not HAS_TRITON or table.size(1) > MAX_DIM:
        return False
    return table.is_cuda or (interpreted() and table.device.type == "cpu")


def needs_cuda(what: str, device: str) -> str:
    """Why ``what`` (a Triton kernel, "the kernels") cannot run on ``device``: the words every
    kernel's refusal uses. Triton's interpreter is named as what it is, a test mode."""
    return (f"{what} on {device}; the kernels need a CUDA device (TRITON_INTERPRET=1 interprets "
            "them on the CPU, a test mode orders of magnitude slower, not for training)")


def why_value_kernel_unavailable(table: Tensor) -> str:
    """One line: why :func:`value_kernel_available` is False for this table (for
    ``kernel="triton"``)."""
    if not HAS_TRITON:
        return "Triton is not importable (pip install triton; it ships with CUDA builds of torch)"
    if table.size(1) > MAX_DIM:
        return f"the value dim {table.size(1)} exceeds the kernels' {MAX_DIM}"
    return needs_cuda("the value table is", table.device.type)


_VALUE_KERNELS = []
triton = tl = _dot = None  # set by _define_value_kernels()


def _value_kernels():
    """The jitted kernels (read, rows backward, blocks backward), built on first use (Triton is
    imported then: in interpreter mode when ``TRITON_INTERPRET`` is set at that moment)."""
    if not _VALUE_KERNELS:
        _VALUE_KERNELS.extend(_define_value_kernels())
    return _VALUE_KERNELS


def _define_value_kernels():
    global triton, tl, _dot  # (a jitted kernel finds the functions it calls here)
    import triton
    import triton.language as tl

    def _read_kernel(table, idx, w, out, m, d, stride_t,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # this program's column chunk
        col_ok = cols < d
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, m, BLOCK_M):
            j = s + tl.arange(0, BLOCK_M)
            j_ok = j < m
            rows = tl.load(idx + n * m + j, mask=j_ok, other=0)
            wj = tl.load(w + n * m + j, mask=j_ok, other=0).to(tl.float32)
            v = tl.load(table + rows[:, None] * stride_t + cols[None, :],
                        mask=j_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
            acc += tl.sum(v * wj[:, None], axis=0)
        tl.store(out + n * d + cols, acc.to(out.dtype.element_ty), mask=col_ok)

    def _rows_backward_kernel(grad, table, w, order, bounds, rows, grad_table, grad_w,
                              m, d, stride_g, stride_t, stride_gt, stride_gw,
                              HAS_ROWS: tl.constexpr, NEED_GT: tl.constexpr,
                              NEED_GW: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)  # column chunk; its weight-gradient dots are partial
        start = tl.load(bounds + p)  # this row's reads: sorted reads [start, start + count)
        count = tl.load(bounds + p + 1) - start
        if HAS_ROWS:  # sparse: the program's table row
            row = tl.load(rows + p).to(tl.int64)
        else:  # dense: program p is table row p
            row = p
        cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < d
        if NEED_GW:  # (an unread row's program loads nothing)
            width = tl.where(count > 0, d, 0)
            v = tl.load(table + row * stride_t + cols, mask=cols < width, other=0).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, count, BLOCK_R):
            r = s + tl.arange(0, BLOCK_R)
            r_ok = r < count
            flat = tl.load(order + start + r, mask=r_ok, other=0)  # read i = token·m + j
            token = flat // m
            g = tl.load(grad + token[:, None] * stride_g + cols[None, :],
                        mask=r_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
            if NEED_GT:
                wi = tl.load(w + flat, mask=r_ok, other=0).to(tl.float32)
                acc += tl.sum(g * wi[:, None], axis=0)
            if NEED_GW:
                dots = tl.sum(g * v[None, :], axis=1)
                tl.store(grad_w + c * stride_gw + flat, dots.to(grad_w.dtype.element_ty),
                         mask=r_ok)
        if NEED_GT:
            tl.store(grad_table + p * stride_gt + cols, acc.to(grad_table.dtype.element_ty),
                     mask=col_ok)

    @triton.jit
    def _dot(a, b, acc, UPCAST: tl.constexpr):
        """``acc + a @ b`` (float32 accumulator). UPCAST: bf16 operands widened to float32 first
        -- exact -- for Triton 3.9's interpreter, which multiplies bf16 operands' raw bits."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    def _blocks_backward_kernel(grad, table, w, order, bounds, rows, grad_table, grad_w,
                                n_rows, chunks, m, d, stride_g, stride_t, stride_gt, stride_gw,
                                HAS_ROWS: tl.constexpr, NEED_GT: tl.constexpr,
                                NEED_GW: tl.constexpr, ROWS: tl.constexpr, READS: tl.constexpr,
                                BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
        # program: ROWS table rows (program rows u; dense: u is the table row) x one column chunk
        # (the chunks of a block are neighbours in the grid: they share its reads in the cache)
        pid = tl.program_id(0)
        p = pid // chunks
        c = pid % chunks
        u = p * ROWS + tl.arange(0, ROWS)
        u_ok = u < n_rows
        # the block's reads are the sorted reads [first, last); row u's are [start_u, end_u),
        # kept relative to first (int32: a block's reads fit)
        first = tl.load(bounds + p * ROWS)
        span = (tl.load(bounds + tl.minimum(p * ROWS + ROWS, n_rows)) - first).to(tl.int32)
        start = tl.where(u_ok, (tl.load(bounds + u, mask=u_ok) - first).to(tl.int32), 0)
        end = tl.where(u_ok, (tl.load(bounds + u + 1, mask=u_ok) - first).to(tl.int32), 0)
        cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < d
        if NEED_GW:  # the block's table rows [ROWS, BLOCK_D], once (an unread row: nothing)
            if HAS_ROWS:
                row = tl.load(rows + u, mask=u_ok, other=0).to(tl.int64)
            else:
                row = u.to(tl.int64)
            v = tl.load(table + row[:, None] * stride_t + cols[None, :],
                        mask=(end > start)[:, None] & col_ok[None, :], other=0)
        acc = tl.zeros([BLOCK_D, ROWS], dtype=tl.float32)  # ∂V of the block, transposed
        for s in range(0, span, READS):
            t = s + tl.arange(0, READS)  # a tile of the block's reads
            ok = t < span
            flat = tl.load(order + first + t, mask=ok, other=0)  # read i = token·m + j
            g = tl.load(grad + (flat // m)[:, None] * stride_g + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0)  # [READS, BLOCK_D]
            mine = (t[:, None] >= start[None, :]) & (t[:, None] < end[None, :])  # [READS, ROWS]
            if NEED_GT:  # ∂V[u] += Σ_t S[t, u] G[t]: acc += Gᵀ·S
                wi = tl.load(w + flat, mask=ok, other=0)
                acc = _dot(tl.trans(g), tl.where(mine, wi[:, None], 0).to(g.dtype), acc, UPCAST)
            if NEED_GW:  # ⟨G[t], V[row_t]⟩: the row_t column of G·Vᵀ [READS, ROWS]
                dots = _dot(g, tl.trans(v), tl.zeros([READS, ROWS], dtype=tl.float32), UPCAST)
                dots = tl.sum(tl.where(mine, dots, 0.0), axis=1)
                tl.store(grad_w + c.to(tl.int64) * stride_gw + flat,
                         dots.to(grad_w.dtype.element_ty), mask=ok)
        if NEED_GT:
            tl.store(grad_table + u.to(tl.int64)[None, :] * stride_gt + cols[:, None],
                     acc.to(grad_table.dtype.element_ty), mask=u_ok[None, :] & col_ok[:, None])

    return (triton.jit(_read_kernel), triton.jit(_rows_backward_kernel),
            triton.jit(_blocks_backward_kernel))


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


#: warps of a read or rows-backward program (of at most READ_COLS columns): on an H100 (bf16, d
#: 512; docs/performance.md, pkm/launch-sweep) 2 beat 4 and 8 for the read and both backwards
#: at every chunk and row count
_WARPS = 2


def read_launch(d: int, m: int) -> Launch:
    """The read's launch: column chunks of at most :data:`READ_COLS`, rows filling the tile."""
    cols = min(_pow2(d), READ_COLS)
    return Launch(cols, max(1, min(_pow2(m), _TILE // cols)), _WARPS)


def backward_launch(d: int) -> Launch:
    """The rows backward's launch, in column chunks of at most :data:`READ_COLS` (like the read;
    an H200 took 12.2 ms for the dense backward of d 1024 as one 1024-column program a row,
    against 1.08 ms for d 512: docs/performance.md, ``pkm/value-read``), rows filling a tile of
    :data:`_BACKWARD_TILE`."""
    cols = min(_pow2(d), READ_COLS)
    return Launch(cols, max(1, _BACKWARD_TILE // cols), _WARPS)


def block_launch(d: int) -> BlockLaunch:
    """The blocks backward's launch: column chunks of at most :data:`BLOCK_COLS` (16 at least:
    ``tl.dot``'s least), 16 table rows a program (~128 reads at the paper's shape), tiles of 64
    reads (a tile of 64 makes both products Hopper's warpgroup MMAs, whose operands stay in
    shared memory; 32 reads take 255 registers and spill), 8 warps: 110 registers a thread at
    256 columns on sm_90. Chosen by the compiled code, not yet timed on a GPU
    (``pkm/launch-sweep``)."""
    return BlockLaunch(max(16, min(_pow2(d), BLOCK_COLS)), 16, 64, 8)


def _chunks(d: int, cols: int) -> int:
    return -(-d // cols)


def row_ranges(rows: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """``(starts, counts)`` ``[size]`` of each table row's run in the ascending row ids ``rows``
    (a row nobody reads: count 0, start where it would be), by one binary search per row.
    ``torch.bincount`` would be 3-5x faster on the CPU, but on CUDA it reads its input's maximum
    back to the host: a sync of the whole queue inside the backward."""
    bounds = row_bounds(rows, size)
    return bounds[:-1], bounds[1:] - bounds[:-1]


def row_bounds(rows: Tensor, size: int) -> Tensor:
    """``[size + 1]`` (int64): row r's run in the ascending row ids ``rows`` is
    ``[bounds[r], bounds[r + 1])`` (:func:`row_ranges` without the subtraction)."""
    return torch.searchsorted(rows, _row_ids(size + 1, rows.dtype, rows.device))


def dead_last(indices: Tensor, dead: Optional[Tensor], size: int, dtype: torch.dtype) -> Tensor:
    """The reads of ``indices`` [N, m] as flat sort keys of ``dtype``: each read's table row, plus
    |K| = ``size`` for the reads of a token marked in ``dead`` [N] (bool; None: none), so that a
    sort puts them after every live read."""
    n, m = indices.shape
    keys = indices.reshape(-1).to(dtype)
    if dead is None:
        return keys
    return keys + (dead.to(dtype) * size).unsqueeze(1).expand(n, m).reshape(-1)


def live_runs(keys: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """``(starts, offsets)`` of the runs of equal ascending ``keys`` below ``size`` (the live reads
    of :func:`dead_last`): ``starts`` [U] where each run begins, found by the one op sized by the
    data (a ``nonzero``: a host sync on CUDA); ``offsets`` [U + 1] those and the live reads' end."""
    live = keys < size
    first = torch.cat([live[:1], keys[1:] != keys[:-1]]) & live
    starts = first.nonzero().squeeze(1)
    return starts, torch.cat([starts, live.sum().view(1)])


@cached_constant
def _row_ids(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``0 .. n-1`` (an arange kernel per backward otherwise)."""
    return torch.arange(n, dtype=dtype, device=device)


def read(table: Tensor, indices: Tensor, weights: Tensor, launch: Optional[Launch] = None
         ) -> Tensor:
    """``out[n] = Σ_j weights[n, j] · table[indices[n, j]]``: [N, m] × [|K|, d] -> [N, d]
    (table's dtype, float32 accumulation). ``launch``: :func:`read_launch` unless given."""
    read_kernel = _value_kernels()[0]
    n, m = indices.shape
    d = table.size(1)
    table = table if table.stride(1) == 1 else table.contiguous()
    out = torch.empty(n, d, dtype=table.dtype, device=table.device)
    if n == 0:
        return out
    launch = launch or read_launch(d, m)
    read_kernel[(n, _chunks(d, launch.cols))](
        table, indices.contiguous(), weights.contiguous(), out, m, d, table.stride(0),
        BLOCK_M=launch.rows, BLOCK_D=launch.cols, num_warps=launch.warps)
    return out


#: the backward kernels: ``blocks`` (16-bit inputs: tensor-core products over blocks of rows) and
#: ``rows`` (float32 or mixed dtypes: one program per row)
BACKWARDS = ("blocks", "rows")
_HALF = (torch.float16, torch.bfloat16)


def backward_method(grad: Tensor, table: Tensor, weights: Tensor) -> str:
    """The kernel :func:`backward` uses unless told: ``blocks`` when the output gradient, the
    table and the weights share a 16-bit dtype, else ``rows``."""
    same = grad.dtype == table.dtype == weights.dtype
    return "blocks" if same and table.dtype in _HALF else "rows"


def backward(grad: Tensor, table: Tensor, indices: Tensor, weights: Tensor, sparse: bool,
             need_table: bool, need_weights: bool, launch=None, method: Optional[str] = None,
             dead: Optional[Tensor] = None):
    """The gradients of :func:`read`: ``(grad_table, grad_weights)``, each None when not needed.

    ``grad_table`` is dense [|K|, d], or with ``sparse`` a coalesced sparse tensor holding the
    rows read; ``grad_weights`` is [N, m] in ``weights``' dtype. ``method``: one of
    :data:`BACKWARDS` (default :func:`backward_method`); ``launch``: a :class:`BlockLaunch`
    (blocks) or :class:`Launch` (rows), :func:`block_launch` / :func:`backward_launch` unless
    given. With a row split over several column chunks each chunk writes its partial
    weight-gradient dots in float32, and they are summed in chunk order. Every sum runs in an
    order fixed by the launch, so the gradients are deterministic (no atomics).

    ``dead`` [N] (bool, optional; sparse): tokens whose output gradient is 0 and whose reads are
    no rows of the sparse gradient (pads; every token of a loss multiplied by 0). Their reads
    sort after every row and are left out by the one op sized by the data (a ``nonzero``: the
    backward's one host sync on CUDA); their weight gradients are 0."""
    _, rows_kernel, blocks_kernel = _value_kernels()
    method = method or backward_method(grad, table, weights)
    if method not in BACKWARDS:
        raise ValueError(f"PKM backward must be one of {', '.join(BACKWARDS)}, got {method!r}")
    if method == "blocks" and backward_method(grad, table, weights) != "blocks":
        raise ValueError(f"PKM backward 'blocks' takes one 16-bit dtype for the gradient, table "
                         f"and weights, got {grad.dtype}, {table.dtype} and {weights.dtype}; "
                         "pass method='rows'")
    n, m = indices.shape
    size, d = table.shape
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    table = table if table.stride(1) == 1 else table.contiguous()
    weights = weights.contiguous()
    # reads sorted by table row, ties in read order (stable): the sum order of a row is fixed.
    # Row ids fit 32 bits, and a radix sort of 32-bit keys makes half the passes of 64-bit ones
    skip = dead is not None and sparse and need_table
    keys = dead_last(indices, dead if skip else None, size, torch.int32)
    rows_read, order = torch.sort(keys, stable=True)
    # the rows programs take: program row u's reads are the sorted reads [bounds[u], bounds[u+1])
    rows = None  # sparse: the distinct rows read, whose gradients ``out_table`` holds
    if skip:  # the distinct rows of the live reads (keys < |K|)
        starts, bounds = live_runs(rows_read, size)
        rows = rows_read.index_select(0, starts)
    elif need_table and sparse:  # the distinct rows read
        rows, counts = torch.unique_consecutive(rows_read, return_counts=True)
        bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    else:  # every table row; an unread row writes its zeros
        bounds = row_bounds(rows_read, size)
    n_rows = bounds.numel() - 1
    out_table = grad.new_empty(n_rows, d) if need_table else grad
    launch = launch or (block_launch(d) if method == "blocks" else backward_launch(d))
    chunks = _chunks(d, launch.cols)
    grad_w = weights  # (not written when not needed)
    if need_weights:  # one chunk: the dots themselves; several: float32 partial dots per chunk
        new = torch.zeros if skip else torch.empty  # (skip: the dead reads' dots are 0, unvisited)
        grad_w = (new(n * m, dtype=weights.dtype, device=weights.device) if chunks == 1
                  else new(chunks, n * m, dtype=torch.float32, device=weights.device))
    common = dict(HAS_ROWS=rows is not None, NEED_GT=need_table, NEED_GW=need_weights,
                  BLOCK_D=launch.cols, num_warps=launch.warps)
    if n_rows and method == "blocks":
        blocks_kernel[(-(-n_rows // launch.rows) * chunks,)](
            grad, table, weights, order, bounds, rows if rows is not None else bounds,
            out_table, grad_w, n_rows, chunks, m, d, grad.stride(0), table.stride(0),
            out_table.stride(0), n * m, ROWS=launch.rows, READS=launch.reads,
            UPCAST=table.dtype == torch.bfloat16 and interpreted(), **common)
    elif n_rows:
        rows_kernel[(n_rows, chunks)](
            grad, table, weights, order, bounds, rows if rows is not None else bounds,
            out_table, grad_w, m, d, grad.stride(0), table.stride(0), out_table.stride(0),
            n * m, BLOCK_R=launch.rows, **common)
    grad_table = None
    if need_table:
        grad_table = out_table if rows is None else torch.sparse_coo_tensor(
            rows.long().unsqueeze(0), out_table, table.shape, is_coalesced=True,
            check_invariants=False)
    if not need_weights:
        return grad_table, None
    if chunks > 1:
        grad_w = grad_w.sum(0).to(weights.dtype)
    return grad_table, grad_w.view(n, m)


def sm90_specializations() -> Iterator[tuple]:
    """``(label, kernel, signature, constexprs, num_warps)`` of every specialisation the layer
    and the benchmark launch at the paper's shapes (value dims 512 and 1024 -- the tiles stop
    growing at :data:`READ_COLS` / :data:`BLOCK_COLS` columns, so a wider row compiles the same
    code, a narrower one smaller tiles -- and 4 heads × knn 32 reads a token), for the spill
    check (scripts/sm90.py; ``i32:16``: an integer the launcher specialises as divisible by 16):
    the read in each dtype; the blocks backward in fp16 and bf16, each gradient alone and both,
    dense and sparse; the rows backward likewise in float32 and, for the benchmark's one-run
    comparison, bf16 (dense, both gradients); the launches of ``pkm/launch-sweep``. A row split
    over column chunks writes float32 partial dots: another specialisation."""
    read_kernel, rows_kernel, blocks_kernel = _value_kernels()
    for dt in ("fp32", "fp16", "bf16"):
        launch = read_launch(512, 128)
        yield (f"read {dt}", read_kernel,
               dict(table=f"*{dt}", idx="*i64", w=f"*{dt}", out=f"*{dt}", m="i32:16",
                    d="i32:16", stride_t="i32:16", BLOCK_M="constexpr", BLOCK_D="constexpr"),
               dict(BLOCK_M=launch.rows, BLOCK_D=launch.cols), launch.warps)
    grads = (("dense", False, True, True), ("sparse", True, True, True),
             ("values only", False, True, False), ("weights only", False, False, True))
    default = block_launch(512)
    runs = [("rows", "fp32", backward_launch, grads), ("rows", "bf16", backward_launch, grads[:1])]
    runs += [("blocks", dt, block_launch, grads) for dt in ("fp16", "bf16")]
    runs += [("blocks", "bf16", lambda d, x=BlockLaunch(*x): x, grads[:1]) for x in SWEEP_BLOCKS
             if BlockLaunch(*x) != default]
    seen = set()
    for method, dt, launch_of, kinds in runs:
        for d in (512, 1024):
            launch = launch_of(d)
            chunks = _chunks(d, launch.cols)
            for kind, has_rows, gt, gw in kinds:
                sig = dict(grad=f"*{dt}", table=f"*{dt}", w=f"*{dt}", order="*i64",
                           bounds="*i64", rows="*i32" if has_rows else "*i64",
                           grad_table=f"*{dt}",
                           grad_w="*fp32" if gw and chunks > 1 else f"*{dt}")
                if method == "blocks":  # (a sparse gradient's row count is any number)
                    sig.update(n_rows="i32" if has_rows else "i32:16", chunks="i32")
                sig.update(m="i32:16", d="i32:16", stride_g="i32:16", stride_t="i32:16",
                           stride_gt="i32:16", stride_gw="i32:16")
                const = dict(HAS_ROWS=has_rows, NEED_GT=gt, NEED_GW=gw, BLOCK_D=launch.cols)
                if method == "blocks":
                    const.update(ROWS=launch.rows, READS=launch.reads, UPCAST=False)
                else:
                    const.update(BLOCK_R=launch.rows)
                sig.update({k: "constexpr" for k in const})
                key = (method, str(sig), str(const), launch.warps)
                if key not in seen:
                    seen.add(key)
                    yield (f"{method} backward {dt} {kind} d {d} {tuple(launch)}",
                           blocks_kernel if method == "blocks" else rows_kernel, sig, const,
                           launch.warps)


#: the blocks-backward launches ``pkm/launch-sweep`` times at d 512 (cols, rows, reads, warps),
#: each compiled without a spill (:func:`sm90_specializations`)
SWEEP_BLOCKS = ((256, 16, 64, 8), (128, 16, 64, 4), (128, 16, 64, 8), (256, 32, 64, 8))


def backward_traffic(p: dict, element: int) -> List[Tuple[str, float, float]]:
    """The value backward on CUDA (these kernels), step by step, modelled -- its floor, beside it
    (a trace on ``meta`` cannot run a Triton kernel; scripts/costmodel.py and the bench's
    value-backward rows read it): ``(step, bytes from DRAM, bytes served from L2)`` at
    shape ``p`` (tokens, heads, knn, n_keys, d; ``sparse``) for values of ``element`` bytes
    (2: the blocks kernel, 4: the rows kernel) and int32 slot ids (the layer's).

    DRAM: each tensor a step reads or writes, once -- the reads sorted by row make every table
    row's reads adjacent, so a row is loaded once. The output gradient [N, d] is gathered once
    per read (128 times at the paper shape), but it is 16.8 MB in bf16: after its first loads it
    sits in the 50 MB L2, so the gathers are the third column, not DRAM. Rows read: the expected
    number of distinct rows of uniformly random reads."""
    size, d, n = p["n_keys"] ** 2, p["d"], p["tokens"]
    reads = n * p["heads"] * p["knn"]
    distinct = size * (1 - (1 - 1 / size) ** reads)
    rows = distinct if p.get("sparse") else size  # rows of the gradient, programs' rows
    cols = (block_launch(d) if element == 2 else backward_launch(d)).cols
    chunks = -(-d // cols)
    dots = reads * (element if chunks == 1 else 4 * chunks)  # the weight-gradient dots written
    steps = [("sort the reads by row (int32 keys; sorted keys, int64 order)", reads * 16, 0),
             ("each row's run of sorted reads (searchsorted; sparse: nonzero)",
              reads * 4 + rows * 12, 0),
             ("the kernel: table rows read, gradient rows written, output gradient, order, "
              "weights, dots", distinct * d * element + rows * d * element + n * d * element
              + reads * (8 + element) + dots, reads * d * element - n * d * element)]
    if chunks > 1:
        steps.append((f"sum of the {chunks} column chunks' float32 dots", dots + reads * element,
                      0))
    return steps


class KernelUnavailable(ValueError):
    """``argument="triton"`` of ``module`` where its Triton kernels cannot run (``why``): one line
    in the module's own words (``instead``: the values to pass instead)."""

    def __init__(self, why: str, module: str = "ProductKeyMemory", argument: str = "kernel",
                 instead: str = "'auto' (the kernels where they run) or 'torch'"):
        self.why = why
        super().__init__(f"{module} {argument}='triton' cannot run: {why}; pass "
                         f"{argument}={instead}")


def use_value_kernel(kernel: str, table: Tensor) -> bool:
    """Resolve ``kernel`` ("auto", "triton", "torch") for a read of ``table``."""
    if kernel == "torch":
        return False
    if kernel == "triton":
        if not value_kernel_available(table):
            raise KernelUnavailable(why_value_kernel_unavailable(table))
        return True
    return value_kernel_available(table) and table.is_cuda


KERNELS = ("auto", "triton", "torch")


def check_kernel(kernel: Optional[str]) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"PKM kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel

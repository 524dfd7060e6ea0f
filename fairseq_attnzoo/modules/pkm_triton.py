"""Fused Triton kernels for the product-key memory's value read and its gradients.

The reference is :class:`~fairseq_attnzoo.modules.pkm._WeightedRowSum` in plain PyTorch (ATen's
embedding-bag kernels); these kernels compute the same three quantities, each accumulated in
float32 whatever the table's dtype, and are used on CUDA when Triton is importable
(``ProductKeyMemory(kernel="auto")``, fairseq ``--pkm-kernel``):

* **read** ``out[n] = Σ_j w[n, j] · V[idx[n, j]]``: one program per token and chunk of at most
  :data:`READ_COLS` columns, its k·heads rows read once each, one rounding at the end;
* **backward**, one fused kernel over the reads sorted by table row (one ``torch.sort``): one
  program per table row r (dense gradient: every row, unread rows write their zeros, so the
  |K| × d gradient is written once with no zero-fill) or per distinct row read (sparse: a U × d
  coalesced gradient). The program loads V[r] once and walks its reads i in index order::

        ∂L/∂V[r]  = Σ_{i: idx_i = r} w_i · grad[token_i]     (the value gradient)
        ∂L/∂w_i   = ⟨grad[token_i], V[r]⟩                     (the weight gradient, stored at i)

  Each read's output-gradient row is loaded once and serves both products; the table row is read
  once instead of once per read; the sum over a row's reads runs in a fixed order, so the value
  gradient is deterministic (no atomics). This replaces ATen's two embedding-bag calls and the
  float32 gather fallback that bfloat16 needs on CUDA (ATen has no bf16 CUDA kernel for the
  weight gradient). This is ``method="rows"``, the default (:data:`BACKWARD`);
* **backward over reads** (``method="reads"``): the same two gradients from one program per block
  of sorted reads -- full tiles whatever the rows, no per-row loop -- whose value-gradient rows
  are summed by a segmented scan and written by the program that holds a row's first read (it
  reads on past its block while the row goes on); V is loaded per read (repeats hit the cache).
  Also deterministic. The benchmark case ``pkm/launch-sweep`` times both methods.

Triton is optional and imported on first use: without it (or on a CPU) the reference path runs.
With ``TRITON_INTERPRET=1`` in the environment before Triton is imported, the kernels run on CPU
tensors in Triton's interpreter -- that is how the tests compare them with the reference on
machines without a GPU (tests/conftest.py sets it).
"""

import importlib.util
import os
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .constants import cached_constant

#: table rows of at most this many elements are handled by one program (larger: reference path)
MAX_DIM = 8192
#: elements of the [reads, columns] tile a program holds at once
_TILE = 8192
#: elements of the rows backward's [reads, columns] tile: at d 512 on an H100, 4 reads a step
#: (1.06 ms) beat 8 (1.46 ms) and 16 (2.60 ms) (pkm/launch-sweep; a wider row is split in chunks)
_BACKWARD_TILE = 2048
#: widest column chunk of one read or backward program: a wider row is split over several
#: programs, each like a d-512 program (a whole d-1024 row per program read further from the copy
#: bandwidth on an H100 and took 11x the backward time of d 512 on an H200: docs/performance.md,
#: ``pkm/value-read``; CHANGELOG)
READ_COLS = 512


class Launch(NamedTuple):
    """How a kernel is launched: ``cols`` columns per program (a row wider than that is split over
    programs along the grid's second axis), ``rows`` reads per loop step, ``warps`` per program.
    The defaults are :func:`read_launch` / :func:`backward_launch`; the benchmark case
    ``pkm/launch-sweep`` times the alternatives on a GPU."""

    cols: int
    rows: int
    warps: int


HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available(table: Tensor) -> bool:
    """The kernels can run on ``table``'s device and width."""
    if not HAS_TRITON or table.size(1) > MAX_DIM:
        return False
    return table.is_cuda or (interpreted() and table.device.type == "cpu")


def needs_cuda(what: str, device: str) -> str:
    """Why ``what`` (a Triton kernel, "the kernels") cannot run on ``device``: the words every
    kernel's refusal uses. Triton's interpreter is named as what it is, a test mode."""
    return (f"{what} on {device}; the kernels need a CUDA device (TRITON_INTERPRET=1 interprets "
            "them on the CPU, a test mode orders of magnitude slower, not for training)")


def why_unavailable(table: Tensor) -> str:
    """One line: why :func:`available` is False for this table (for ``kernel="triton"``)."""
    if not HAS_TRITON:
        return "Triton is not importable (pip install triton; it ships with CUDA builds of torch)"
    if table.size(1) > MAX_DIM:
        return f"the value dim {table.size(1)} exceeds the kernels' {MAX_DIM}"
    return needs_cuda("the value table is", table.device.type)


_KERNELS = []
triton = tl = _segment_sum = None  # set by _define()


def _kernels():
    """The two jitted kernels, built on first use (Triton is imported then: in interpreter mode
    when ``TRITON_INTERPRET`` is set at that moment)."""
    if not _KERNELS:
        _KERNELS.extend(_define())
    return _KERNELS


def _define():
    global triton, tl, _segment_sum  # (a jitted kernel finds the functions it calls here)
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


    def _rows_backward_kernel(grad, table, w, order, starts, counts, rows, grad_table, grad_w,
                              m, d, stride_g, stride_t, stride_gt, stride_gw,
                              HAS_ROWS: tl.constexpr, NEED_GT: tl.constexpr,
                              NEED_GW: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)  # column chunk; its weight-gradient dots are partial
        start = tl.load(starts + p)
        count = tl.load(counts + p)
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
    def _segment_sum(row_a, sum_a, row_b, sum_b):  # a segmented scan's combine: sums within a row
        return row_b, tl.where(row_a == row_b, sum_a + sum_b, sum_b)

    def _reads_backward_kernel(grad, table, w, rows_sorted, order, out_index, grad_table, grad_w,
                               total, m, d, stride_g, stride_t, stride_gt, stride_gw,
                               SPARSE: tl.constexpr, NEED_GT: tl.constexpr,
                               NEED_GW: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        # program p: the sorted reads [p·BLOCK_R, (p+1)·BLOCK_R), one full tile whatever the rows
        p = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)  # column chunk
        cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < d
        first = p * BLOCK_R
        i = first + tl.arange(0, BLOCK_R)
        ok = i < total
        r = tl.load(rows_sorted + i, mask=ok, other=-1)
        flat = tl.load(order + i, mask=ok, other=0)  # read = token·m + j
        g = tl.load(grad + (flat // m)[:, None] * stride_g + cols[None, :],
                    mask=ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
        if NEED_GW:  # ⟨grad[token_i], V[r_i]⟩ (a row read again in the tile is a cache hit)
            v = tl.load(table + r.to(tl.int64)[:, None] * stride_t + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
            tl.store(grad_w + c * stride_gw + flat,
                     tl.sum(g * v, axis=1).to(grad_w.dtype.element_ty), mask=ok)
        if NEED_GT:  # each row's Σ w_i grad[token_i], written by the program of its first read
            wi = tl.load(w + flat, mask=ok, other=0).to(tl.float32)
            keys = r[:, None] + tl.zeros([BLOCK_R, BLOCK_D], dtype=r.dtype)
            _, sums = tl.associative_scan((keys, g * wi[:, None]), 0, _segment_sum)
            prev = tl.load(rows_sorted + first - 1, mask=first > 0, other=-1)
            after = tl.load(rows_sorted + i + 1, mask=i + 1 < total, other=-1)
            # a row that began before this tile is its first program's; one that runs past it
            # ends below (the tile's last read)
            ends = ok & (r != prev) & (r != after)
            if SPARSE:  # the row's place among the distinct rows read
                dest = tl.load(out_index + i, mask=ends, other=0)
            else:
                dest = r.to(tl.int64)
            tl.store(grad_table + dest[:, None] * stride_gt + cols[None, :],
                     sums.to(grad_table.dtype.element_ty), mask=ends[:, None] & col_ok[None, :])
            last = tl.minimum(first + BLOCK_R, total) - 1
            row = tl.load(rows_sorted + last)
            if (row != prev) & (row == tl.load(rows_sorted + last + 1, mask=last + 1 < total,
                                               other=-1)):
                acc = tl.sum(tl.where((i == last)[:, None], sums, 0.0), axis=0)
                pos = last + 1
                more = pos < total
                while more:  # the row's reads after the tile, a block at a time
                    j = pos + tl.arange(0, BLOCK_R)
                    same = tl.load(rows_sorted + j, mask=j < total, other=-1) == row
                    fj = tl.load(order + j, mask=same, other=0)
                    gj = tl.load(grad + (fj // m)[:, None] * stride_g + cols[None, :],
                                 mask=same[:, None] & col_ok[None, :], other=0).to(tl.float32)
                    wj = tl.load(w + fj, mask=same, other=0).to(tl.float32)
                    acc += tl.sum(gj * wj[:, None], axis=0)
                    pos += BLOCK_R
                    more = (tl.sum(same.to(tl.int32), axis=0) == BLOCK_R) & (pos < total)
                if SPARSE:
                    dest_row = tl.load(out_index + last)
                else:
                    dest_row = row.to(tl.int64)
                tl.store(grad_table + dest_row * stride_gt + cols,
                         acc.to(grad_table.dtype.element_ty), mask=col_ok)

    return (triton.jit(_read_kernel), triton.jit(_rows_backward_kernel),
            triton.jit(_reads_backward_kernel))


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


#: warps of a program (of at most READ_COLS columns): on an H100 (bf16, d 512; docs/performance.md,
#: pkm/launch-sweep) 2 beat 4 and 8 for the read and both backwards at every chunk and row count
_WARPS = 2


def read_launch(d: int, m: int) -> Launch:
    """The read's launch: column chunks of at most :data:`READ_COLS`, rows filling the tile."""
    cols = min(_pow2(d), READ_COLS)
    return Launch(cols, max(1, min(_pow2(m), _TILE // cols)), _WARPS)


def backward_launch(d: int, method: str = "rows") -> Launch:
    """The backward's launch, in column chunks of at most :data:`READ_COLS` (like the read; an
    H200 took 12.2 ms for the dense backward of d 1024 as one 1024-column program a row, against
    1.08 ms for d 512: docs/performance.md, ``pkm/value-read``). ``rows``: rows filling a tile
    of :data:`_BACKWARD_TILE`; ``reads``: blocks of 8 reads (its segmented scan needs about
    twice the registers of a plain tile: 16 reads of 512 columns take 230 a thread on sm_90, 8
    take 128)."""
    cols = min(_pow2(d), READ_COLS)
    if method == "rows":
        return Launch(cols, max(1, _BACKWARD_TILE // cols), _WARPS)
    return Launch(cols, 8, _WARPS)


def _chunks(d: int, cols: int) -> int:
    return -(-d // cols)


def row_ranges(rows: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """``(starts, counts)`` ``[size]`` of each table row's run in the ascending row ids ``rows``
    (a row nobody reads: count 0, start where it would be), by one binary search per row.
    ``torch.bincount`` would be 3-5x faster on the CPU, but on CUDA it reads its input's maximum
    back to the host: a sync of the whole queue inside the backward."""
    bounds = torch.searchsorted(rows, _row_ids(size + 1, rows.dtype, rows.device))
    return bounds[:-1], bounds[1:] - bounds[:-1]


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
    read_kernel = _kernels()[0]
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


#: the backward kernels. ``rows``: one program per table row (dense) or per distinct row read
#: (sparse), walking that row's reads; ``reads``: one program per block of sorted reads, a full
#: tile whatever the rows, whose rows are summed by a segmented scan, each row written by the
#: program that holds its first read (which reads on past its block while the row goes on)
BACKWARDS = ("rows", "reads")
#: the one :func:`backward` uses unless told (the other is the launch sweep's alternative)
BACKWARD = "rows"


def backward(grad: Tensor, table: Tensor, indices: Tensor, weights: Tensor, sparse: bool,
             need_table: bool, need_weights: bool, launch: Optional[Launch] = None,
             method: Optional[str] = None, dead: Optional[Tensor] = None):
    """The gradients of :func:`read`: ``(grad_table, grad_weights)``, each None when not needed.

    ``grad_table`` is dense [|K|, d], or with ``sparse`` a coalesced sparse tensor holding the
    rows read; ``grad_weights`` is [N, m] in ``weights``' dtype. ``method``: one of
    :data:`BACKWARDS` (default :data:`BACKWARD`); ``launch``: :func:`backward_launch` unless
    given. With a row split over several column chunks each chunk writes its partial
    weight-gradient dots in float32, and they are summed in chunk order. Every sum runs in an
    order fixed by the launch, so the gradients are deterministic (no atomics).

    ``dead`` [N] (bool, optional; sparse ``rows`` method): tokens whose output gradient is 0 and
    whose reads are no rows of the sparse gradient (pads; every token of a loss multiplied by 0).
    Their reads sort after every row and are left out by the one op sized by the data (a
    ``nonzero``: the backward's one host sync on CUDA); their weight gradients are 0."""
    rows_kernel, reads_kernel = _kernels()[1:]
    method = method or BACKWARD
    n, m = indices.shape
    size, d = table.shape
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    table = table if table.stride(1) == 1 else table.contiguous()
    weights = weights.contiguous()
    # reads sorted by table row, ties in read order (stable): the sum order of a row is fixed.
    # Row ids fit 32 bits, and a radix sort of 32-bit keys makes half the passes of 64-bit ones
    skip = dead is not None and sparse and need_table
    if skip and method != "rows":
        raise ValueError(f"PKM backward: dead reads are left out by the rows method, not {method}")
    keys = dead_last(indices, dead if skip else None, size, torch.int32)
    rows_read, order = torch.sort(keys, stable=True)
    launch = launch or backward_launch(d, method)
    chunks = _chunks(d, launch.cols)
    grad_w = weights  # (not written when not needed)
    if need_weights:  # one chunk: the dots themselves; several: float32 partial dots per chunk
        new = torch.zeros if skip else torch.empty  # (skip: the dead reads' dots are 0, unvisited)
        grad_w = (new(n * m, dtype=weights.dtype, device=weights.device) if chunks == 1
                  else new(chunks, n * m, dtype=torch.float32, device=weights.device))
    rows = None  # sparse: the distinct rows read, whose gradients ``out_table`` holds
    common = dict(NEED_GT=need_table, NEED_GW=need_weights, BLOCK_R=launch.rows,
                  BLOCK_D=launch.cols, num_warps=launch.warps)
    if method == "reads":
        out_index = rows_read  # sparse: each read's place among the distinct rows
        if need_table and sparse:
            rows, out_index = torch.unique_consecutive(rows_read, return_inverse=True)
            out_table = grad.new_empty(rows.numel(), d)
        else:  # dense: the rows nobody reads stay zero
            out_table = grad.new_zeros(size, d) if need_table else grad
        if rows_read.numel():
            reads_kernel[(_chunks(rows_read.numel(), launch.rows), chunks)](
                grad, table, weights, rows_read, order, out_index, out_table, grad_w,
                rows_read.numel(), m, d, grad.stride(0), table.stride(0), out_table.stride(0),
                n * m, SPARSE=rows is not None, **common)
    elif method == "rows":
        if skip:  # one program per distinct row of the live reads (keys < |K|)
            starts, offsets = live_runs(rows_read, size)
            starts, counts = starts.to(torch.int32), (offsets[1:] - starts).to(torch.int32)
            rows = rows_read.index_select(0, starts)
            out_table = grad.new_empty(rows.numel(), d)
        elif need_table and sparse:  # one program per distinct row read
            rows, counts = torch.unique_consecutive(rows_read, return_counts=True)
            out_table = grad.new_empty(rows.numel(), d)
            starts = counts.cumsum(0) - counts
        else:  # one program per table row; empty reads write the zero rows
            starts, counts = row_ranges(rows_read, size)
            out_table = grad.new_empty(size, d) if need_table else grad
        if counts.numel():
            rows_kernel[(counts.numel(), chunks)](
                grad, table, weights, order, starts, counts,
                rows if rows is not None else starts, out_table, grad_w, m, d,
                grad.stride(0), table.stride(0), out_table.stride(0), n * m,
                HAS_ROWS=rows is not None, **common)
    else:
        raise ValueError(f"PKM backward must be one of {', '.join(BACKWARDS)}, got {method!r}")
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


class KernelUnavailable(ValueError):
    """``argument="triton"`` of ``module`` where its Triton kernels cannot run (``why``): one line
    in the module's own words (``instead``: the values to pass instead)."""

    def __init__(self, why: str, module: str = "ProductKeyMemory", argument: str = "kernel",
                 instead: str = "'auto' (the kernels where they run) or 'torch'"):
        self.why = why
        super().__init__(f"{module} {argument}='triton' cannot run: {why}; pass "
                         f"{argument}={instead}")


def use_kernel(kernel: str, table: Tensor) -> bool:
    """Resolve ``kernel`` ("auto", "triton", "torch") for a read of ``table``."""
    if kernel == "torch":
        return False
    if kernel == "triton":
        if not available(table):
            raise KernelUnavailable(why_unavailable(table))
        return True
    return available(table) and table.is_cuda


KERNELS = ("auto", "triton", "torch")


def check_kernel(kernel: Optional[str]) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"PKM kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel

"""The fused Triton kernels of the PKM value read (modules/pkm_triton.py) against their PyTorch
reference (modules/pkm.py ``_WeightedRowSum``), in fp32, fp16 and bf16, dense and sparse.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
here per test); ``ATTNZOO_TEST_DEVICE=cuda`` runs the same tests on a GPU's compiled kernels. The
kernels are also compiled ahead of time for an H100 (sm_90), which needs no GPU: a codegen error
that the interpreter cannot see fails here, not on a lent machine."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fairseq_attnzoo.modules import pkm_search_triton, pkm_triton
from fairseq_attnzoo.modules.pkm import ProductKeyMemory, _ProductTopk, _WeightedRowSum

pytestmark = pytest.mark.skipif(not pkm_triton.HAS_TRITON,
                                reason="Triton is not installed (make install adds it)")

DEVICE = torch.device(os.environ.get("ATTNZOO_TEST_DEVICE", "cpu"))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    assert DEVICE.type != "cpu" or pkm_triton.interpreted(), "conftest sets TRITON_INTERPRET"
    torch.manual_seed(0)


def _tol(dtype):
    # the kernels accumulate in float32 and round once; the reference is float32 arithmetic on the
    # same (rounded) inputs, so the difference is the output's rounding: 1-2 ulps
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


def _problem(dtype, size=40, n=9, m=6, d=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(size, d, generator=g)
    idx = torch.randint(0, size - 8, (n, m), generator=g)  # the last 8 rows are never read
    idx[1, :4] = 7  # a row read four times by one token
    idx[4, 0] = 7  # and again by another
    w = torch.rand(n, m, generator=g)
    up = torch.randn(n, d, generator=g)
    return [t.to(DEVICE) for t in (table.to(dtype), idx, w.to(dtype), up.to(dtype))]


def _grads(table, idx, w, up, sparse, fused):
    table = table.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    out = _WeightedRowSum.apply(table, idx, w, sparse, fused)
    out.backward(up)
    return out, table.grad, w.grad


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_equal_the_reference(dtype, sparse):
    """Read, table gradient (dense: every row, unread rows exactly 0; sparse: the distinct rows
    read, coalesced) and weight gradient equal the PyTorch path computed in float32."""
    table, idx, w, up = _problem(dtype)
    out, g_table, g_w = _grads(table, idx, w, up, sparse, fused=True)
    ref_out, ref_table, ref_w = _grads(table.float(), idx, w.float(), up.float(), sparse, False)
    assert out.dtype == g_w.dtype == g_table.dtype == dtype
    assert g_table.is_sparse == sparse
    if sparse:  # one entry per distinct row, sorted (autograd drops the coalesced flag)
        assert torch.equal(g_table._indices()[0], torch.unique(idx))
        g_table, ref_table = g_table.to_dense(), ref_table.to_dense()
    else:
        assert g_table[-8:].abs().max() == 0
    for ours, ref in ((out, ref_out), (g_table, ref_table), (g_w, ref_w)):
        torch.testing.assert_close(ours.float(), ref, **_tol(dtype))


def test_value_dim_not_a_power_of_two_and_one_read_per_token():
    table, idx, w, up = _problem(torch.float32, size=10, n=5, m=1, d=37)
    for got, ref in zip(_grads(table, idx, w, up, False, True),
                        _grads(table, idx, w, up, False, False)):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_split_over_column_chunks_give_the_same_result(dtype, sparse):
    """A row wider than a program's columns is split over programs (the read at d > READ_COLS; the
    backward's alternatives that the case pkm/launch-sweep times): the read, the table gradient and the
    weight gradient (partial dots summed over the chunks) equal the one-chunk launch's, for
    chunks that divide d and a last chunk that is cut short, and any rows and warps per step."""
    table, idx, w, up = _problem(dtype, d=40)
    ref_out, ref_table, ref_w = _grads(table, idx, w, up, sparse, fused=True)
    ref_table = ref_table.to_dense() if sparse else ref_table
    for cols, rows, warps in ((16, 4, 2), (8, 16, 1), (32, 2, 4)):  # 3, 5 and 2 chunks of 40
        launch = pkm_triton.Launch(cols, rows, warps)
        out = pkm_triton.read(table, idx, w, launch)
        g_table, g_w = pkm_triton.backward(up, table, idx, w, sparse, True, True, launch)
        only_w = pkm_triton.backward(up, table, idx, w, sparse, False, True, launch)[1]
        only_table = pkm_triton.backward(up, table, idx, w, sparse, True, False, launch)[0]
        if sparse:
            g_table, only_table = g_table.to_dense(), only_table.to_dense()
        assert g_w.dtype == dtype
        torch.testing.assert_close(out, ref_out, **_tol(dtype))
        torch.testing.assert_close(g_table, ref_table, **_tol(dtype))
        torch.testing.assert_close(g_w, ref_w, **_tol(dtype))
        assert torch.equal(only_w, g_w) and torch.equal(only_table, g_table)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_over_blocks_of_reads_equals_the_reference(dtype, sparse):
    """``method="reads"`` (one program per block of sorted reads, rows summed by a segmented
    scan): a row read 23 times runs over several blocks (its first program reads on until it
    ends), rows end on block boundaries and inside blocks, a block can lie wholly inside one row;
    with blocks of 1 to 32 reads, split columns, and each gradient alone."""
    table, idx, w, up = _problem(dtype, n=12, m=5, d=24)
    idx[2:7] = 11  # row 11: 25 reads in all, sorted next to each other
    idx[2, 0], idx[9, 4] = 12, 11
    ref = _grads(table.float(), idx, w.float(), up.float(), sparse, False)
    ref_table = ref[1].to_dense() if sparse else ref[1]
    for rows, cols in ((1, 32), (2, 8), (4, 32), (8, 16), (32, 32)):
        launch = pkm_triton.Launch(cols, rows, 2)
        g_table, g_w = pkm_triton.backward(up, table, idx, w, sparse, True, True, launch, "reads")
        only_w = pkm_triton.backward(up, table, idx, w, sparse, False, True, launch, "reads")[1]
        only_table = pkm_triton.backward(up, table, idx, w, sparse, True, False, launch,
                                         "reads")[0]
        if sparse:
            assert torch.equal(g_table._indices()[0], torch.unique(idx))
            g_table, only_table = g_table.to_dense(), only_table.to_dense()
        else:
            assert g_table[-8:].abs().max() == 0
        assert g_table.dtype == g_w.dtype == dtype
        torch.testing.assert_close(g_table.float(), ref_table, **_tol(dtype), msg=str(launch))
        torch.testing.assert_close(g_w.float(), ref[2], **_tol(dtype), msg=str(launch))
        assert torch.equal(only_w, g_w) and torch.equal(only_table, g_table)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_row_ranges(dtype):
    """``row_ranges`` gives every row's start and count among sorted reads: unread rows, the
    first and the last row, no reads at all."""
    g = torch.Generator().manual_seed(0)
    size = 50
    rows = torch.cat([torch.tensor([0, 0, size - 1]), torch.randint(3, 40, (200,), generator=g)])
    rows = rows.sort().values.to(dtype)
    starts, counts = pkm_triton.row_ranges(rows, size)
    assert torch.equal(counts.long(), torch.bincount(rows.long(), minlength=size))
    assert torch.equal(starts.long(), torch.tensor([int((rows < r).sum()) for r in range(size)]))
    starts, counts = pkm_triton.row_ranges(rows[:0], 4)
    assert starts.tolist() == counts.tolist() == [0, 0, 0, 0]


def test_default_launches():
    """A row of up to READ_COLS columns is one read program; a wider one is split into chunks of
    READ_COLS, in the read and both backwards alike."""
    assert pkm_triton.read_launch(512, 128) == pkm_triton.Launch(512, 16, 2)
    assert pkm_triton.read_launch(1024, 128) == pkm_triton.Launch(512, 16, 2)
    assert pkm_triton.read_launch(37, 1) == pkm_triton.Launch(64, 1, 2)
    assert pkm_triton.backward_launch(512) == pkm_triton.Launch(512, 4, 2)
    assert pkm_triton.backward_launch(1024) == pkm_triton.Launch(512, 4, 2)
    assert pkm_triton.backward_launch(1024, "reads") == pkm_triton.Launch(512, 8, 2)


def test_a_zeroed_loss_gives_an_empty_sparse_gradient():
    """The padding batch of a DDP rank (loss × 0) reads no rows on the kernel path either."""
    table, idx, w, up = _problem(torch.float32)
    _, g_table, g_w = _grads(table, idx, w, up * 0, True, True)
    assert g_table.is_sparse and g_table._nnz() == 0 and g_w.abs().max() == 0


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_memory_with_kernels_equals_memory_without(sparse):
    """A whole PKM layer (search, batch norm, padding, value read) gives the same output and the
    same gradient on every parameter with ``kernel="triton"`` and ``kernel="torch"``."""
    results = []
    for kernel in ("triton", "torch"):
        torch.manual_seed(0)
        m = ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, sparse=sparse,
                             kernel=kernel).to(DEVICE)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(5, 3, 16, generator=g).to(DEVICE).requires_grad_(True)
        pad = torch.zeros(3, 5, dtype=torch.bool, device=DEVICE)
        pad[1, 3:] = True
        out = m(x, pad)
        out.backward(torch.randn(out.shape, generator=g).to(DEVICE))
        grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad)
                 for n, p in m.named_parameters()}
        results.append((out, x.grad, grads))
    (out, gx, grads), (ref, ref_gx, ref_grads) = results
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, ref_gx)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)


def test_kernel_choice(monkeypatch):
    """auto: the kernels on CUDA only; triton where they cannot run: one line with the fix."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(4, 8)
    assert not pkm_triton.use_kernel("auto", cpu) and not pkm_triton.use_kernel("torch", cpu)
    with pytest.raises(ValueError, match=r"kernel='triton' cannot run: .*CUDA.*"
                                         r"pass kernel='auto'") as e:
        pkm_triton.use_kernel("triton", cpu)
    assert "\n" not in str(e.value) and "--" not in str(e.value)  # the module's own arguments
    assert "TRITON_INTERPRET=1 interprets them on the CPU, a test mode" in str(e.value)
    _hosted_refusal(r"--pkm-kernel triton cannot run: .*CUDA.*--pkm-kernel auto",
                    kernel="triton")
    with pytest.raises(ValueError, match="PKM kernel must be one of auto, triton, torch"):
        ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, kernel="cuda")


def _hosted_refusal(match: str, **kernels):
    """The fairseq sublayer's refusal names the flag (the module's names its argument)."""
    from fairseq_attnzoo.models.pkm import FairseqProductKeyMemory

    hosted = FairseqProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, **kernels)
    with pytest.raises(ValueError, match=match) as e:
        hosted(torch.randn(3, 2, 16))
    assert "\n" not in str(e.value)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the kernels run compiled on this device")
def test_kernels_compile_for_an_h100():
    """Every specialisation the module launches at the paper's value dims (both backward
    methods) compiles for sm_90 (in a process where Triton is not in interpreter mode; no GPU
    needed), and none spills registers to local memory (read from the cubin with the cuobjdump
    that Triton ships, where it does)."""
    _compile_without_spills("compile_for_sm90", 54, timeout=300)


def _compile_without_spills(function: str, count: int, timeout: int):
    """Run this module's ``function`` in a process where Triton is not in interpreter mode; it
    prints a line ``NAME local BYTES`` per compiled kernel: ``count`` lines, none spilling."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import test_pkm_triton as t; t.{function}()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == count, run.stdout
    for line in lines:
        name, _, local = line.rpartition(" local ")
        assert local in ("0", "unknown"), f"{name} spills {local} bytes a thread"


def _local_bytes(kernel) -> str:
    """Bytes of local memory (register spills) a thread of a compiled kernel uses."""
    import re
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "unknown"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    found = re.search(r"LOCAL:(\d+)", usage)
    return found.group(1) if found else "unknown"


def compile_for_sm90():
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not pkm_triton.interpreted()
    read_kernel, backward_kernel, reads_kernel = pkm_triton._kernels()

    def build(kernel, sig, launch, **constexprs):
        """Compile one specialisation for sm_90 at ``launch``; its local-memory bytes a thread."""
        return _local_bytes(compile(ASTSource(kernel, sig, constexprs=dict(
            constexprs, BLOCK_D=launch.cols)), target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=launch.warps)))

    for dt in ("fp32", "fp16", "bf16"):
        for d in (512, 1024):
            launch = pkm_triton.read_launch(d, 128)
            sig = dict(table=f"*{dt}", idx="*i64", w=f"*{dt}", out=f"*{dt}", m="i32", d="i32",
                       stride_t="i32", BLOCK_M="constexpr", BLOCK_D="constexpr")
            print(f"read {dt} d {d} local {build(read_kernel, sig, launch, BLOCK_M=launch.rows)}")
            launch = pkm_triton.backward_launch(d)
            sig = dict(grad=f"*{dt}", table=f"*{dt}", w=f"*{dt}", order="*i64", starts="*i64",
                       counts="*i64", rows=None, grad_table=f"*{dt}", grad_w=f"*{dt}",
                       m="i32", d="i32", stride_g="i32", stride_t="i32", stride_gt="i32",
                       stride_gw="i32", HAS_ROWS="constexpr", NEED_GT="constexpr",
                       NEED_GW="constexpr", BLOCK_R="constexpr", BLOCK_D="constexpr")
            for rows, gt, gw in ((True, True, True), (False, True, True), (False, True, False),
                                 (False, False, True)):
                sig["rows"] = "*i32" if rows else "*i64"  # sparse: the rows read; dense: unused
                local = build(backward_kernel, sig, launch, HAS_ROWS=rows, NEED_GT=gt, NEED_GW=gw,
                              BLOCK_R=launch.rows)
                print(f"backward {dt} d {d} rows {rows} table {gt} weights {gw} local {local}")
            launch = pkm_triton.backward_launch(d, "reads")
            sig = dict(grad=f"*{dt}", table=f"*{dt}", w=f"*{dt}", rows_sorted="*i32",
                       order="*i64", out_index=None, grad_table=f"*{dt}", grad_w=f"*{dt}",
                       total="i32", m="i32", d="i32", stride_g="i32", stride_t="i32",
                       stride_gt="i32", stride_gw="i32", SPARSE="constexpr",
                       NEED_GT="constexpr", NEED_GW="constexpr", BLOCK_R="constexpr",
                       BLOCK_D="constexpr")
            for sparse, gt, gw in ((True, True, True), (False, True, True), (False, True, False),
                                   (False, False, True)):
                sig["out_index"] = "*i64" if sparse else "*i32"  # sparse: inverse; dense: unused
                local = build(reads_kernel, sig, launch, SPARSE=sparse, NEED_GT=gt, NEED_GW=gw,
                              BLOCK_R=launch.rows)
                print(f"backward over reads {dt} d {d} sparse {sparse} table {gt} weights {gw} "
                      f"local {local}")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="fairseq-train --cpu")
@pytest.mark.parametrize("sparse", ["true", "false"])
def test_fairseq_train_with_kernels_logs_the_same_losses(sparse, lm_data, tmp_path):
    """``fairseq-train --pkm-kernel triton`` (interpreted here) and ``--pkm-kernel torch`` log
    the same losses update after update (sparse values under pkm_adam, and dense), and the flag
    reaches the memory."""
    from zoo_testlib import json_logs, run_cli, tiny_flags

    logs = {}
    for kernel in ("triton", "torch"):
        lines = run_cli("train", tiny_flags("transformer_lm_pkm", lm_data) + [
            "--pkm-kernel", kernel, "--pkm-sparse", sparse, "--optimizer", "pkm_adam",
            "--lr", "1e-3", "--max-tokens", "400", "--max-update", "4", "--no-save",
            "--disable-validation", "--log-interval", "1", "--log-format", "json",
            "--num-workers", "0", "--seed", "1", "--save-dir", str(tmp_path / kernel)])
        assert any(f"kernel={kernel}" in line for line in lines)  # the model as logged
        logs[kernel] = [float(r["loss"]) for r in json_logs(lines, "train_inner")]
    assert len(logs["triton"]) == 4
    assert logs["triton"] == pytest.approx(logs["torch"], abs=1e-3)


# ---- the fused product-key search (modules/pkm_search_triton.py) ------------------------------

def _search_problem(dtype, heads=2, n=19, k_dim=16, n_keys=12, seed=5):
    """Queries as the layer hands them over (a [H, N, k_dim] view of [N, H·k_dim]) and sub-keys
    [H, 2, n_keys, k_dim/2]; 19 tokens: a full block of 16 and a cut one."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(n, heads, k_dim, generator=g).to(DEVICE, dtype).transpose(0, 1)
    keys = torch.randn(heads, 2, n_keys, k_dim // 2, generator=g).to(DEVICE, dtype)
    return query, keys


def _reference_search(query, keys, knn):
    """The PyTorch path in float32 on the same (rounded) inputs: softmax weights, slots."""
    scores, slots = _ProductTopk.apply(query.float(), keys.float(), knn)
    return torch.softmax(scores, -1), slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_search_equals_the_reference(dtype):
    """The fused search finds the reference's slots in the reference's order (fp32, fp16 and bf16
    inputs; scores accumulated in float32), the sub-key pairs behind them, and its softmax weights
    agree to float32 rounding (the sums differ only in order); knn not a power of two."""
    query, keys = _search_problem(dtype)
    weights, slots, sub = pkm_search_triton.search_op(query, keys, 3)
    ref_w, ref_slots = _reference_search(query, keys, 3)
    assert slots.dtype == sub.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(slots.long(), ref_slots)
    assert torch.equal(sub.long(), torch.stack([ref_slots // 12, ref_slots % 12], 2))
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k_dim", [16, 96], ids=["half 8", "half 48"])
def test_search_merges_blocks_of_sub_keys(k_dim):
    """Sub-keys scored a block at a time (blocks of 16 of 40, the last cut short; knn 4), and a
    half-query wider than a tl.dot step (48 dims: steps of 32, the last cut short) give the
    one-block answer and the reference's."""
    assert pkm_search_triton.search_launch(k_dim // 2, 4, 40)[:3] == (
        (16, 16, 64) if k_dim == 16 else (64, 32, 64))
    query, keys = _search_problem(torch.float32, heads=1, n=16, k_dim=k_dim, n_keys=40)
    ref_w, ref_slots = _reference_search(query, keys, 4)
    for block in (16, None):
        weights, slots, _ = pkm_search_triton._search(query, keys, 4, key_block=block)
        assert torch.equal(slots.long(), ref_slots), block
        torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_search_ties_go_to_the_lower_index():
    """The documented tie rule on constructed scores (a one-hot query: a score is one key
    coordinate, exactly): equal half scores -> the lower sub-key id; equal candidate sums -> the
    lower slot; scores one ulp apart keep their order; -0 ties +0; negative scores rank by value."""
    n_keys, knn, half = 16, 4, 8
    query = torch.zeros(1, 16, 2 * half)
    query[:, :, 0] = query[:, :, half] = 1
    keys = torch.zeros(1, 2, n_keys, half)
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    # half 1: ids 9 and 3 score one_up and 1.0 (one ulp apart, the higher id ahead), ids 5 and 12
    # tie at 1.0 with id 3 -> 9, 3, 5, 12; every other id scores below
    keys[0, 0, :, 0] = torch.linspace(-3, -2, n_keys)
    keys[0, 0, [9, 3, 5, 12], 0] = torch.tensor([one_up, 1.0, 1.0, 1.0])
    # half 2: -0.0 (id 2) ties +0.0 (id 7); id 11 at -1e-30 is below both; the rest below -1
    keys[0, 1, :, 0] = torch.linspace(-5, -1, n_keys)
    keys[0, 1, [7, 2, 11], 0] = torch.tensor([0.0, -0.0, -1e-30])
    weights, slots, sub = pkm_search_triton.search_op(query, keys, knn)
    # sums: 9+{2,7} tie at one_up -> slots 9·16+2, 9·16+7; 9+11 = one_up - 1e-30 rounds to one_up:
    # a tie made by rounding -> 9·16+11; then 1.0 + 0 for a in {3, 5, 12}: the lowest slot, 3·16+2
    expected = [9 * n_keys + 2, 9 * n_keys + 7, 9 * n_keys + 11, 3 * n_keys + 2]
    assert slots[:, 0].tolist() == [expected] * 16
    assert sub[0, 0].tolist() == [[9, 9, 9, 3], [2, 7, 11, 2]]
    torch.testing.assert_close(weights[0, 0, :3], torch.full((3,), weights[0, 0, 0].item()))
    # the half lists alone: a query that reads half 1 only, with all of half 2 tied at 0
    keys[0, 1] = 0
    _, slots, _ = pkm_search_triton.search_op(query, keys, knn)
    assert slots[0, 0].tolist() == [9 * n_keys, 9 * n_keys + 1, 9 * n_keys + 2, 9 * n_keys + 3]
    query[:, :, 0] = -1  # now the lowest half-1 scores win: linspace(-3, -2) negated, id 0 first
    _, slots, _ = pkm_search_triton.search_op(query, keys, knn)
    assert slots[0, 0].tolist() == [0, 1, 2, 3]


def _reference_grads(query, keys, knn, up):
    """torch.autograd through the reference search's scores: the dense half scores gathered at
    the chosen sub-keys, summed, softmaxed."""
    q = query.detach().float().requires_grad_(True)
    k = keys.detach().float().requires_grad_(True)
    _, slots = _ProductTopk.apply(q.detach(), k.detach(), knn)
    half = k.size(-1)
    n_keys = k.size(2)
    s1 = torch.einsum("hnd,hkd->nhk", q[..., :half], k[:, 0]).gather(-1, slots // n_keys)
    s2 = torch.einsum("hnd,hkd->nhk", q[..., half:], k[:, 1]).gather(-1, slots % n_keys)
    (torch.softmax(s1 + s2, -1) * up).sum().backward()
    return q.grad, k.grad


@pytest.mark.parametrize("method", pkm_search_triton.KEY_BACKWARDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_search_backward_equals_autograd(dtype, method):
    """The lean backward (query gradient gathered over the chosen sub-keys; sub-key gradient by
    a sorted segment sum or float32 atomics into [H, 2, n_keys, k_dim/2]) equals autograd through
    the reference search, in the inputs' dtypes; the segment sum repeats bit for bit."""
    query, keys = _search_problem(dtype, n=17, n_keys=12)
    up = torch.randn(17, 2, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, slots = _reference_search(query, keys, 3)  # (the search's answer, without running it)
    sub = torch.stack([slots // 12, slots % 12], 2).int()
    grads = [pkm_search_triton.search_backward_op(up, weights, sub, query, keys, method)
             for _ in range(2 if method == "segment" else 1)]
    grad_q, grad_k = grads[0]
    ref_q, ref_k = _reference_grads(query, keys, 3, up)
    assert grad_q.dtype == grad_k.dtype == dtype and grad_q.shape == query.shape
    torch.testing.assert_close(grad_q.float(), ref_q, **_tol(dtype))
    torch.testing.assert_close(grad_k.float(), ref_k, **_tol(dtype))
    if method == "segment":
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_search_autograd_through_the_custom_op():
    """``search`` is differentiable through the registered op: torch.autograd's gradients of a
    loss on its weights equal the reference's (the default key backward)."""
    query, keys = _search_problem(torch.float32, n=16, n_keys=12)
    q, k = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
    up = torch.randn(16, 2, 3, generator=torch.Generator().manual_seed(2))
    weights, slots = pkm_search_triton.search(q, k, 3)
    (weights * up).sum().backward()
    ref_q, ref_k = _reference_grads(query, keys, 3, up)
    torch.testing.assert_close(q.grad, ref_q, **_tol(torch.float32))
    torch.testing.assert_close(k.grad, ref_k, **_tol(torch.float32))
    assert not slots.requires_grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_search_ops_fake_shapes_on_meta(dtype):
    """The custom ops' fake implementations (what torch.compile traces with) give the kernels'
    shapes, dtypes and strides on the meta device, and check the keys' shape there too."""
    query = torch.empty(7, 3, 16, device="meta", dtype=dtype).transpose(0, 1)  # [H 3, N 7, 16]
    keys = torch.empty(3, 2, 10, 8, device="meta", dtype=dtype)
    weights, slots, sub = pkm_search_triton.search_op(query, keys, 4)
    assert (weights.shape, weights.dtype) == ((7, 3, 4), torch.float32)
    assert (slots.shape, slots.dtype) == ((7, 3, 4), torch.int32)
    assert (sub.shape, sub.dtype) == ((7, 3, 2, 4), torch.int32)
    grad_q, grad_k = pkm_search_triton.search_backward_op(weights, weights, sub, query, keys,
                                                          "segment")
    assert grad_q.shape == query.shape and grad_q.stride() == query.stride()
    assert grad_q.dtype == grad_k.dtype == dtype and grad_k.shape == keys.shape
    with pytest.raises(ValueError, match=r"keys must be \[H, 2, n_keys, k_dim/2\]"):
        pkm_search_triton.search_op(query, keys[:, :, :, :4], 4)
    with pytest.raises(ValueError, match=r"knn must be in 1..n_keys \(10\), got 11"):
        pkm_search_triton.search_op(query, keys, 11)


def test_search_compiles_whole_with_its_backward():
    """``torch.compile(fullgraph=True)`` takes a function calling the search (forward and
    backward through the custom ops' autograd rule: no graph break) and gives eager's result."""
    query, keys = _search_problem(torch.float32, heads=1, n=16, n_keys=12)
    up = torch.randn(16, 1, 3, generator=torch.Generator().manual_seed(2))

    def loss(q, k):
        return (pkm_search_triton.search(q, k, 3)[0] * up).sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        q, k = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
        value = fn(q, k)
        value.backward()
        results.append((value, q.grad, k.grad))
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref)


def test_search_kernel_choice(monkeypatch):
    """auto: the search kernel on CUDA only; triton where it cannot run: one line with the fix."""
    query, keys = _search_problem(torch.float32)
    assert pkm_search_triton.use_kernel("triton", query, keys, 3)
    assert not pkm_search_triton.use_kernel("auto", query, keys, 3)
    assert not pkm_search_triton.use_kernel("torch", query, keys, 3)
    with pytest.raises(ValueError, match=r"search_kernel='triton' cannot run: .*knn <= 128.*"
                                         r"pass search_kernel='torch'") as e:
        pkm_search_triton.use_kernel("triton", query, keys, 129)
    assert "\n" not in str(e.value) and "--" not in str(e.value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"cannot run: the queries are on cpu"):
        pkm_search_triton.use_kernel("triton", query, keys, 3)
    _hosted_refusal(r"^--pkm-search-kernel triton cannot run: the queries are on cpu.*"
                    r"--pkm-search-kernel torch", search_kernel="triton")
    with pytest.raises(ValueError, match="PKM kernel must be one of auto, triton, torch"):
        ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, search_kernel="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_with_search_kernel_equals_memory_without(dtype):
    """A whole layer (batch norm, padding, search, value read) gives the same output and the
    same gradient on every parameter with ``search_kernel="triton"`` and ``"torch"``."""
    results = []
    for kernel in ("triton", "torch"):
        torch.manual_seed(0)
        m = ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, kernel="torch",
                             search_kernel=kernel).to(DEVICE, dtype)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(6, 3, 16, generator=g).to(DEVICE, dtype).requires_grad_(True)
        pad = torch.zeros(3, 6, dtype=torch.bool, device=DEVICE)
        pad[1, 3:] = True
        out = m(x, pad)
        out.backward(torch.randn(out.shape, generator=g).to(DEVICE, dtype))
        results.append((out, x.grad, {n: p.grad for n, p in m.named_parameters()}))
    (out, gx, grads), (ref, ref_gx, ref_grads) = results
    assert "search_kernel=triton" in repr(m) or kernel == "torch"
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(gx, ref_gx, **_tol(dtype))
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **_tol(dtype), msg=name)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the kernels run compiled on this device")
def test_search_kernels_compile_for_an_h100():
    """The search (float32 and bfloat16 inputs) and both backward kernels compile for sm_90 at the
    paper's shape (k_dim 256, knn 32; n_keys is not compiled in) -- no GPU needed: a codegen error
    that the interpreter cannot see (tl.dot, int64 reductions, atomics) fails here -- and none
    spills registers to local memory."""
    _compile_without_spills("compile_search_for_sm90", 5, timeout=600)


def compile_search_for_sm90():
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not pkm_triton.interpreted()
    search, query_backward, key_backward = pkm_search_triton._kernels()
    S = pkm_search_triton

    def build(kernel, sig, **constexprs):
        compiled = compile(ASTSource(kernel, sig, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        return _local_bytes(compiled)

    half, knn = 128, 32
    block_d, dot_d, key_block, knn_p, pairs = S.search_launch(half, knn, 512)
    for dt in ("fp32", "bf16"):
        sig = dict(q=f"*{dt}", keys=f"*{dt}", scratch="*i64", w_out="*fp32", slot_out="*i32",
                   sub_out="*i32", n="i32", heads="i32", n_keys="i32", knn="i32",
                   stride_qh="i32", stride_qn="i32", HALF="constexpr", BLOCK_N="constexpr",
                   BLOCK_D="constexpr", DOT_D="constexpr", KEY_BLOCK="constexpr",
                   KNN="constexpr", PAIRS="constexpr", PRECISION="constexpr", UPCAST="constexpr")
        local = build(search, sig, HALF=half, BLOCK_N=S.BLOCK_N, BLOCK_D=block_d, DOT_D=dot_d,
                      KEY_BLOCK=key_block, KNN=knn_p, PAIRS=pairs,
                      PRECISION=S._precision({"fp32": torch.float32}.get(dt, torch.bfloat16)),
                      UPCAST=False)
        print(f"search {dt} local {local}")
    dt = "bf16"
    for atomic in (False, True):
        sig = dict(grad_w="*fp32", w="*fp32", sub="*i32", q=f"*{dt}", keys=f"*{dt}",
                   grad_q=f"*{dt}", grad_s="*fp32", grad_keys="*fp32", n="i32", heads="i32",
                   n_keys="i32", knn="i32", stride_qh="i32", stride_qn="i32",
                   HALF="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr",
                   KNN="constexpr", ATOMIC="constexpr")
        local = build(query_backward, sig, HALF=half, BLOCK_N=S.BLOCK_N, BLOCK_D=block_d,
                      KNN=knn_p, ATOMIC=atomic)
        print(f"query backward {dt} atomic {atomic} local {local}")
    sig = dict(grad_s="*fp32", order="*i64", starts="*i64", counts="*i64", q=f"*{dt}",
               grad_keys="*fp32", heads="i32", knn="i32", n_keys="i32", stride_qh="i32",
               stride_qn="i32", HALF="constexpr", BLOCK_R="constexpr", BLOCK_D="constexpr")
    local = build(key_backward, sig, HALF=half, BLOCK_R=S.KEY_ROWS // block_d, BLOCK_D=block_d)
    print(f"key backward {dt} local {local}")


def test_search_kernel_flag_reaches_the_memory(lm_data):
    """``--pkm-search-kernel`` (default torch: the fused kernel has not run on a GPU yet) reaches
    every memory of a fairseq model."""
    from zoo_testlib import build

    for flags, expected in (([], "torch"), (["--pkm-search-kernel", "auto"], "auto")):
        model = build("transformer_lm_pkm", lm_data, flags)[2]
        kernels = {m.search_kernel for m in model.modules() if isinstance(m, ProductKeyMemory)}
        assert kernels == {expected}

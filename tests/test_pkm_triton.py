"""The fused Triton kernels of the PKM value read (modules/pkm_triton.py) against their PyTorch
reference (modules/pkm_values.py ``_WeightedRowSum``), in fp32, fp16 and bf16, dense and sparse.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
here per test); ``ATTNZOO_TEST_DEVICE=cuda`` runs the same tests on a GPU's compiled kernels. The
kernels are also compiled ahead of time for an H100 (sm_90), which needs no GPU, by the spill
check (tests/test_sm90_spills.py): a codegen error that the interpreter cannot see fails there,
not on a lent machine."""

import os

import pytest
import torch

from fairseq_attnzoo.modules import pkm_triton
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.modules.pkm_values import _WeightedRowSum

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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_dim_not_a_power_of_two_and_one_read_per_token(dtype):
    table, idx, w, up = _problem(dtype, size=10, n=5, m=1, d=37)
    for got, ref in zip(_grads(table, idx, w, up, False, True),
                        _grads(table.float(), idx, w.float(), up.float(), False, False)):
        torch.testing.assert_close(got.float(), ref, **_tol(dtype))


#: launches of the tests: 3, 5 and 2 chunks of a 40-wide row (the last cut short), any reads a
#: step, warps; and for the blocks kernel 1 to 32 rows a program and tiles of 16 to 64 reads
LAUNCHES = {"rows": [pkm_triton.Launch(16, 4, 2), pkm_triton.Launch(8, 16, 1),
                     pkm_triton.Launch(32, 2, 4)],
            "blocks": [pkm_triton.BlockLaunch(16, 16, 16, 4), pkm_triton.BlockLaunch(32, 1, 64, 8),
                       pkm_triton.BlockLaunch(64, 32, 32, 2)]}


def _methods(dtype):
    return ["blocks", "rows"] if dtype != torch.float32 else ["rows"]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_split_over_column_chunks_give_the_same_result(dtype, sparse):
    """A row wider than a program's columns is split over programs (the read at d > READ_COLS,
    the blocks backward at d > BLOCK_COLS; the launch sweep's alternatives): the read, the table
    gradient and the weight gradient (partial dots summed over the chunks) equal the reference's,
    for chunks that divide d and a last chunk that is cut short, with each backward its inputs
    can take (16-bit: blocks and rows; float32: rows) and each gradient alone."""
    table, idx, w, up = _problem(dtype, d=40)
    ref_out, ref_table, ref_w = _grads(table.float(), idx, w.float(), up.float(), sparse, False)
    ref_table = ref_table.to_dense() if sparse else ref_table
    for launch in LAUNCHES["rows"]:
        torch.testing.assert_close(pkm_triton.read(table, idx, w, launch).float(), ref_out,
                                   **_tol(dtype))
    for method in _methods(dtype):
        for launch in LAUNCHES[method]:
            def run(gt, gw):
                return pkm_triton.backward(up, table, idx, w, sparse, gt, gw, launch, method)
            g_table, g_w = run(True, True)
            only_w, only_table = run(False, True)[1], run(True, False)[0]
            if sparse:
                g_table, only_table = g_table.to_dense(), only_table.to_dense()
            assert g_w.dtype == g_table.dtype == dtype
            torch.testing.assert_close(g_table.float(), ref_table, **_tol(dtype), msg=str(launch))
            torch.testing.assert_close(g_w.float(), ref_w, **_tol(dtype), msg=str(launch))
            assert torch.equal(only_w, g_w) and torch.equal(only_table, g_table)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_blocks_backward_equals_the_reference_and_repeats_bit_for_bit(dtype, sparse):
    """The blocks backward (rows a program, its sorted reads a tile at a time, both gradients as
    tensor-core products with the tile's read-to-row matrix): a row read 25 times runs over
    several tiles, tiles hold many rows and rows end on tile boundaries and inside tiles, blocks
    hold unread rows and a last block is cut short, at 1 to 32 rows a program and 16 to 64 reads
    a tile; each gradient alone; and a second run gives the same bits (no atomics)."""
    table, idx, w, up = _problem(dtype, size=70, n=12, m=5, d=24)
    idx[2:7] = 11  # row 11: 25 reads in all, sorted next to each other
    idx[2, 0], idx[9, 4] = 12, 11
    ref = _grads(table.float(), idx, w.float(), up.float(), sparse, False)
    ref_table = ref[1].to_dense() if sparse else ref[1]
    for launch in [pkm_triton.BlockLaunch(32, r, t, 4) for r, t in ((1, 16), (2, 16), (16, 16),
                                                                    (4, 64), (32, 32))]:
        def run(gt, gw):
            return pkm_triton.backward(up, table, idx, w, sparse, gt, gw, launch, "blocks")
        g_table, g_w = run(True, True)
        only_w, only_table = run(False, True)[1], run(True, False)[0]
        again = run(True, True)
        assert torch.equal(again[1], g_w)
        if sparse:
            assert torch.equal(g_table._indices()[0], torch.unique(idx))
            assert torch.equal(again[0]._values(), g_table._values())
            g_table, only_table = g_table.to_dense(), only_table.to_dense()
        else:
            assert torch.equal(again[0], g_table) and g_table[-8:].abs().max() == 0
        torch.testing.assert_close(g_table.float(), ref_table, **_tol(dtype), msg=str(launch))
        torch.testing.assert_close(g_w.float(), ref[2], **_tol(dtype), msg=str(launch))
        assert torch.equal(only_w, g_w) and torch.equal(only_table, g_table)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pads_and_dead_reads_equal_the_reference(dtype, sparse):
    """Tokens that count nowhere -- pads (``keep`` False, their output gradient 0, as the layer
    masks them) and every token of a loss multiplied by 0 -- on the kernels' path (blocks for
    16-bit, rows for float32) as on the reference's: a sparse gradient holds the kept tokens'
    rows only (an empty one for the zeroed loss), the dead reads' weight gradients are 0."""
    table, idx, w, up = _problem(dtype)
    keep = torch.ones(idx.size(0), dtype=torch.bool, device=DEVICE)
    keep[[0, 4, 8]] = False
    up = up.masked_fill(~keep[:, None], 0)
    for scale in (1, 0):
        got, ref = ([], [])
        for fused, out in ((True, got), (False, ref)):
            t = (table if fused else table.float()).detach().requires_grad_(True)
            ww = (w if fused else w.float()).detach().requires_grad_(True)
            _WeightedRowSum.apply(t, idx, ww, sparse, fused, keep).backward(
                (up if fused else up.float()) * scale)
            out.extend([t.grad, ww.grad])
        if sparse:
            assert torch.equal(got[0]._indices(), ref[0]._indices())
            assert got[0]._nnz() == (0 if scale == 0 else torch.unique(idx[keep]).numel())
            got[0], ref[0] = got[0].to_dense(), ref[0].to_dense()
        assert got[1][~keep].abs().max() == 0
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.float(), b, **_tol(dtype))


@pytest.mark.parametrize("sparse,expected", [(False, []), (True, ["nonzero"])],
                         ids=["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_backward_syncs_only_for_sparse_rows(dtype, sparse, expected):
    """The kernels' backward of a padded batch (blocks for 16-bit inputs, rows for float32) makes
    the host wait for the device once with a sparse gradient (its distinct rows: one
    ``nonzero``) and never with a dense one, as the PyTorch path (counted as CUDA would:
    tests/syncs_testlib.py)."""
    from syncs_testlib import syncs

    table, idx, w, up = _problem(dtype)
    keep = torch.ones(idx.size(0), dtype=torch.bool, device=DEVICE)
    keep[2] = False
    t, ww = table.requires_grad_(True), w.requires_grad_(True)
    out = _WeightedRowSum.apply(t, idx, ww, sparse, True, keep)
    assert syncs(lambda: out.backward(up)) == expected
    assert t.grad is not None and ww.grad is not None


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
    READ_COLS, in the read and the rows backward alike; the blocks backward takes chunks of up to
    BLOCK_COLS columns, 16 rows a program, tiles of 64 reads; 16-bit inputs take it, float32 and
    mixed dtypes the rows backward, and it refuses the others in one line."""
    assert pkm_triton.read_launch(512, 128) == pkm_triton.Launch(512, 16, 2)
    assert pkm_triton.read_launch(1024, 128) == pkm_triton.Launch(512, 16, 2)
    assert pkm_triton.read_launch(37, 1) == pkm_triton.Launch(64, 1, 2)
    assert pkm_triton.backward_launch(512) == pkm_triton.Launch(512, 4, 2)
    assert pkm_triton.backward_launch(1024) == pkm_triton.Launch(512, 4, 2)
    assert pkm_triton.block_launch(512) == pkm_triton.BlockLaunch(256, 16, 64, 8)
    assert pkm_triton.block_launch(8) == pkm_triton.BlockLaunch(16, 16, 64, 8)
    x = {dt: torch.zeros(2, 2, dtype=dt) for dt in DTYPES}
    assert [pkm_triton.backward_method(x[dt], x[dt], x[dt]) for dt in DTYPES] == [
        "rows", "blocks", "blocks"]
    bf16, fp32 = x[torch.bfloat16], x[torch.float32]
    assert pkm_triton.backward_method(bf16, bf16, fp32) == "rows"
    with pytest.raises(ValueError, match=r"^PKM backward 'blocks' takes one 16-bit dtype .* "
                                         r"pass method='rows'$"):
        pkm_triton.backward(fp32, fp32, torch.zeros(2, 1, dtype=torch.long), fp32[:, :1], False,
                            True, True, method="blocks")


def test_a_zeroed_loss_gives_an_empty_sparse_gradient():
    """The padding batch of a DDP rank (loss × 0) reads no rows on the kernel path either."""
    table, idx, w, up = _problem(torch.float32)
    _, g_table, g_w = _grads(table, idx, w, up * 0, True, True)
    assert g_table.is_sparse and g_table._nnz() == 0 and g_w.abs().max() == 0


def layers_agree(dtype, tokens: int, choices: dict, tol: dict, **options):
    """A whole PKM layer (batch norm, padding, search, value read) built at one seed with each
    of ``choices`` (name -> constructor options, e.g. the kernel forced) gives the same output
    and the same gradient on every parameter, within ``tol``; returns the layers."""
    results, layers = [], []
    for choice in choices.values():
        torch.manual_seed(0)
        m = ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, **options,
                             **choice).to(DEVICE, dtype)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, 3, 16, generator=g).to(DEVICE, dtype).requires_grad_(True)
        pad = torch.zeros(3, tokens, dtype=torch.bool, device=DEVICE)
        pad[1, 3:] = True
        out = m(x, pad)
        out.backward(torch.randn(out.shape, generator=g).to(DEVICE, dtype))
        grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad)
                 for n, p in m.named_parameters()}
        results.append((out, x.grad, grads))
        layers.append(m)
    (out, gx, grads), (ref, ref_gx, ref_grads) = results
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(gx, ref_gx, **tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=name)
    return layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_memory_with_kernels_equals_memory_without(sparse, dtype):
    """A whole PKM layer (search, batch norm, padding, value read) gives the same output and the
    same gradient on every parameter with ``kernel="triton"`` and ``kernel="torch"`` (bf16: the
    blocks backward, float32: the rows backward)."""
    layers_agree(dtype, 5, {k: dict(kernel=k) for k in ("triton", "torch")},
                 _tol(dtype) if dtype != torch.float32 else {}, sparse=sparse)


def test_kernel_choice(monkeypatch):
    """auto: the kernels on CUDA only; triton where they cannot run: one line with the fix."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(4, 8)
    assert not pkm_triton.use_value_kernel("auto", cpu)
    assert not pkm_triton.use_value_kernel("torch", cpu)
    with pytest.raises(ValueError, match=r"kernel='triton' cannot run: .*CUDA.*"
                                         r"pass kernel='auto'") as e:
        pkm_triton.use_value_kernel("triton", cpu)
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

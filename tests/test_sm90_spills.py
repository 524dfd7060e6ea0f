"""The spill check: every Triton kernel specialisation that the layers and the benchmark launch,
compiled for an H100 (sm_90) on the CPU, keeps its values in registers -- no stack frame, no
local loads or stores (scripts/sm90.py reads both from the cubin; the modules list their
specialisations in ``sm90_specializations()``). ``python -m scripts.sm90`` prints the registers
and stack of each."""

import os

import pytest

from scripts import sm90
from fairseq_attnzoo.modules.pkm_triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("ATTNZOO_TEST_DEVICE", "cpu")
                                != "cpu", reason="compiled on the CPU, where Triton is installed")


@pytest.fixture(autouse=True)
def _cuobjdump():
    if not os.path.exists(sm90.tool("cuobjdump")):
        pytest.skip("Triton ships no cuobjdump here: the compiled code cannot be read")


def test_no_kernel_spills_registers_on_sm90():
    """The value kernels (read; rows and blocks backward, dense and sparse, each gradient alone;
    the launch sweep's launches) and the AOP kernels in every dtype the layers run, and whatever
    else a module lists: none has a stack frame or a local load or store."""
    rows = sm90.report()
    print(sm90.table(rows))
    assert {"pkm_triton", "aop_triton"} <= {r["module"] for r in rows}
    assert not any(sm90.spills(r) for r in rows), sm90.table(rows)


def hoarding_kernel_specializations():
    """A kernel made to spill: one warp holds two [128, 64] float32 tiles (512 values a thread,
    twice the 255 registers sm_90 gives one) across a loop."""
    import triton
    import triton.language as tl

    @triton.jit
    def hoard(x, y, n, ROWS: tl.constexpr, COLS: tl.constexpr):
        at = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tile = tl.load(x + at)
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        for k in range(n):
            acc = acc * tile + k
        tl.store(y + at, acc)

    yield "hoard", hoard, dict(x="*fp32", y="*fp32", n="i32", ROWS="constexpr",
                               COLS="constexpr"), dict(ROWS=128, COLS=64), 1


def test_spill_check_fails_on_a_kernel_that_spills():
    """The check can fail: a kernel whose tile cannot fit the registers is reported with a stack
    and local loads/stores (the check before read cuobjdump's ``LOCAL`` column, 0 for spills)."""
    [row] = sm90.report(["--spec", "test_sm90_spills:hoarding_kernel_specializations"])
    assert sm90.spills(row) and row["stack"] > 0 and row["local ops"] > 0, row


def float32_search_specializations():
    """The fused search's forward as ``auto`` would launch it on float32 inputs (not shipped)."""
    import torch

    from fairseq_attnzoo.modules import pkm_search_triton

    yield next(pkm_search_triton.sm90_specializations(dtypes=(torch.float32,)))


def test_spill_check_fails_on_the_float32_search_that_auto_does_not_ship():
    """The check fails on a real kernel: the fused search's forward on float32 inputs (tl.dot in
    IEEE float32) spills on sm_90 -- which is why ``auto`` keeps float32 searches on the PyTorch
    path (``pkm_search_triton.FP32_PRECISION`` is None) and ships only bf16/fp16."""
    import torch

    from fairseq_attnzoo.modules import pkm_search_triton

    assert torch.float32 not in pkm_search_triton.shipped_dtypes()
    [row] = sm90.report(["--spec", "test_sm90_spills:float32_search_specializations"])
    assert row["label"] == "search fp32" and sm90.spills(row), row

"""The spill check: every Triton kernel specialisation that the layers and the benchmark launch,
compiled for an H100 (sm_90) on the CPU, keeps its values in registers -- no stack frame, no
local loads or stores (scripts/sm90.py reads both from the cubin; the modules list their
specialisations in ``sm90_specializations()``). ``python -m scripts.sm90`` prints the registers
and stack of each."""

import os

import pytest

from scripts import sm90
from fairseq_attnzoo.modules.pkm_triton import HAS_TRITON

pytestmark = [pytest.mark.skipif(not HAS_TRITON or os.environ.get("ATTNZOO_TEST_DEVICE", "cpu")
                                 != "cpu", reason="compiled on the CPU, where Triton is installed"),
              pytest.mark.xdist_group("sm90")]  # (one worker: the compiles below, once)

#: the kernels below made to spill, compiled with the shipped ones
MADE_TO_SPILL = ["test_sm90_spills:hoarding_kernel_specializations",
                 "test_sm90_spills:float32_search_specializations"]


@pytest.fixture(scope="module")
def compiled():
    """Every module's specialisations, then MADE_TO_SPILL's, compiled in ONE child process (its
    imports paid once): ``(shipped rows, {label: row} of the others)``."""
    if not os.path.exists(sm90.tool("cuobjdump")):
        pytest.skip("Triton ships no cuobjdump here: the compiled code cannot be read")
    rows = sm90.report(["--all"] + [a for spec in MADE_TO_SPILL for a in ("--spec", spec)])
    made = {r["label"]: r for r in rows if r["module"] == "test"}
    assert len(made) == len(MADE_TO_SPILL), made
    return [r for r in rows if r["module"] != "test"], made


def test_no_kernel_spills_registers_on_sm90(compiled):
    """The value kernels (read; rows and blocks backward, dense and sparse, each gradient alone;
    the launch sweep's launches) and the AOP kernels in every dtype the layers run, and whatever
    else a module lists: none has a stack frame or a local load or store."""
    rows = compiled[0]
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


def test_spill_check_fails_on_a_kernel_that_spills(compiled):
    """The check can fail: a kernel whose tile cannot fit the registers is reported with a stack
    and local loads/stores (the check before read cuobjdump's ``LOCAL`` column, 0 for spills)."""
    row = compiled[1]["hoard"]
    assert sm90.spills(row) and row["stack"] > 0 and row["local ops"] > 0, row


def float32_search_specializations():
    """The fused search's forward as ``auto`` would launch it on float32 inputs (not shipped)."""
    import torch

    from fairseq_attnzoo.modules import pkm_search_triton

    yield next(pkm_search_triton.sm90_specializations(dtypes=(torch.float32,)))


def test_spill_check_fails_on_the_float32_search_that_auto_does_not_ship(compiled):
    """The check fails on a real kernel: the fused search's forward on float32 inputs (tl.dot in
    IEEE float32) spills on sm_90 -- which is why ``auto`` keeps float32 searches on the PyTorch
    path (``pkm_search_triton.FP32_PRECISION`` is None) and ships only bf16/fp16."""
    import torch

    from fairseq_attnzoo.modules import pkm_search_triton

    assert torch.float32 not in pkm_search_triton.shipped_dtypes()
    row = compiled[1]["search fp32"]
    assert sm90.spills(row), row

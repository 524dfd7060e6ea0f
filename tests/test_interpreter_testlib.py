"""tests/interpreter_testlib.py: Triton's interpreter, as the tests run it (tests/conftest.py),
computes what the interpreter as Triton ships it computes, patches ``triton.language`` once a
launch instead of once per helper call, and leaves it as it found it; ``xor_sum`` (what
``tl.sort`` and ``tl.topk`` reduce with) is NumPy's, not one interpreted call an element."""

import pytest
import torch

from interpreter_testlib import numpy_xor_sum, patch_once_a_launch

triton = pytest.importorskip("triton", reason="Triton is not installed (make install adds it)")
tl = triton.language

STEPS, PROGRAMS = 3, 2


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _kernel(x_ptr, y_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + at)
    for _ in range(STEPS):
        v = _twice(v) + 1
    tl.store(y_ptr + at, v)


def _launch(monkeypatch):
    """(y, how many times triton.language was scanned for builtins) of one launch of
    PROGRAMS programs, each calling the helper STEPS times."""
    from triton.runtime import interpreter

    scans, scan = [], interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda pkg, *a: (scans.append(pkg), scan(pkg, *a))[1])
    x = torch.arange(PROGRAMS * 4, dtype=torch.float32)
    y = torch.empty_like(x)
    _kernel[(PROGRAMS,)](x, y, STEPS=STEPS, BLOCK=4)
    want = x
    for _ in range(STEPS):
        want = want * 2 + 1
    assert torch.equal(y, want)
    return y, scans.count(tl)


def test_the_interpreter_patches_the_language_once_a_launch(monkeypatch):
    from triton.runtime import interpreter

    assert isinstance(_kernel, interpreter.InterpretedFunction)  # the interpreter runs the tests
    before = dict(vars(tl))
    assert interpreter._patch_lang.once_a_launch  # (tests/conftest.py applied it)
    patch_once_a_launch()  # (a second call changes nothing)
    y, scans = _launch(monkeypatch)
    assert scans == 1  # the launch's own
    assert dict(vars(tl)) == before  # put back as it was

    stock_patch, stock_launch = interpreter._patch_lang.stock
    monkeypatch.setattr(interpreter, "_patch_lang", stock_patch)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", stock_launch)
    stock_y, stock_scans = _launch(monkeypatch)
    assert torch.equal(y, stock_y)
    assert stock_scans == 1 + PROGRAMS * STEPS  # the launch's and each helper call's


@triton.jit
def _xor_and_sort_kernel(x_ptr, rows_ptr, cols_ptr, sorted_ptr, top_ptr, R: tl.constexpr,
                         C: tl.constexpr, K: tl.constexpr):
    r, c = tl.arange(0, R), tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(rows_ptr + r, tl.xor_sum(x, 1))  # each row's
    tl.store(cols_ptr + c[None, :], tl.xor_sum(x, 0, keep_dims=True))  # each column's, kept
    tl.store(sorted_ptr + r[:, None] * C + c[None, :], tl.sort(x, 1, descending=True))
    tl.store(top_ptr + r[:, None] * K + tl.arange(0, K)[None, :], tl.topk(x, K, 1))


def _xor_and_sort(monkeypatch):
    """The kernel's outputs on random int32 and how many reductions ran element by element."""
    from triton.runtime import interpreter

    slow, generic = [], interpreter.ReduceOps.generic_reduce
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce",
                        lambda self, input: (slow.append(1), generic(self, input))[1])
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (8, 16), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(0))
    out = [torch.empty(8, dtype=torch.int32), torch.empty(16, dtype=torch.int32),
           torch.empty(8, 16, dtype=torch.int32), torch.empty(8, 4, dtype=torch.int32)]
    _xor_and_sort_kernel[(1,)](x, *out, R=8, C=16, K=4)
    assert torch.equal(out[2], x.sort(1, descending=True).values)
    assert torch.equal(out[3], x.topk(4, 1).values)
    return out, len(slow)


def test_xor_sum_is_numpys_with_the_interpreters_result(monkeypatch):
    from triton.runtime import interpreter

    assert interpreter.ReduceOps.apply_impl.numpy_xor_sum  # (tests/conftest.py applied it)
    numpy_xor_sum()  # (a second call changes nothing)
    out, slow = _xor_and_sort(monkeypatch)
    assert slow == 0  # no reduction element by element
    stock = interpreter.ReduceOps.apply_impl.stock
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", stock)
    stock_out, stock_slow = _xor_and_sort(monkeypatch)
    assert stock_slow > 2  # the two xor_sums, and the sort's and the topk's steps
    assert all(torch.equal(a, b) for a, b in zip(out, stock_out))

"""tests/interpreter_testlib.py: Triton's interpreter, as the tests run it (tests/conftest.py),
computes what the interpreter as Triton ships it computes, patches ``triton.language`` once a
launch instead of once per helper call, and leaves it as it found it."""

import pytest
import torch

from interpreter_testlib import patch_once_a_launch

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
    patch_once_a_launch()  # (conftest did: a second call changes nothing)
    y, scans = _launch(monkeypatch)
    assert scans == 1  # the launch's own
    assert dict(vars(tl)) == before  # put back as it was

    stock_patch, stock_launch = interpreter._patch_lang.stock
    monkeypatch.setattr(interpreter, "_patch_lang", stock_patch)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", stock_launch)
    stock_y, stock_scans = _launch(monkeypatch)
    assert torch.equal(y, stock_y)
    assert stock_scans == 1 + PROGRAMS * STEPS  # the launch's and each helper call's

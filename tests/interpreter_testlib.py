"""Triton's interpreter (``TRITON_INTERPRET=1``, tests/conftest.py), without the work it repeats.

Triton 3.9's interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel
is launched (``GridExecutor.__call__`` -> ``_patch_lang``) and puts them back when the launch
ends. It also calls ``_patch_lang`` on every call of a ``@triton.jit`` helper inside the kernel
(``InterpretedFunction.__call__``), once per program and loop step: each call scans the
language modules again (``inspect.getmembers``) and sets again what the launch set. Where the
helper sees no language module the launch did not patch, that work changes nothing: it took
about 30 % of the interpreter's time in this suite (the PKM kernel tests: 81 s -> 57 s).
:func:`patch_once_a_launch` skips exactly those calls; the interpreted arithmetic is Triton's
own.

The interpreter reduces with NumPy where the combine function is one it knows (sum, max, min,
argmax, argmin) and otherwise element by element, calling the interpreted combine function once
per element (``ReduceOps.generic_reduce``). ``tl.sort`` and ``tl.topk`` (the fused search's
bitonic merges) reduce with ``xor_sum`` at every compare-and-swap step: about 30 % of the
interpreter's time in the suite went there. :func:`numpy_xor_sum` reduces ``xor_sum`` with
``np.bitwise_xor.reduce`` instead -- the same bits, integers being exact.

tests/test_interpreter_testlib.py checks both against the interpreter as Triton ships it."""

import inspect


def _languages(fn) -> set:
    """The language modules ``fn`` sees (the ones ``_patch_lang`` patches for it)."""
    import triton.language as tl

    return {id(v) for v in fn.__globals__.values()
            if inspect.ismodule(v) and v in (tl, tl.core)}


def patch_once_a_launch():
    """Inside a launch, a helper's ``_patch_lang`` does nothing where the launch (or an earlier
    helper of it) patched every language module the helper sees. Idempotent."""
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "once_a_launch", False):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches = []  # the language modules patched by each running launch

    def once(fn):
        languages = _languages(fn)
        if launches and languages <= launches[-1]:
            return interpreter._LangPatchScope()  # (nothing set: nothing to put back)
        scope = patch_lang(fn)
        if launches:
            launches[-1] |= languages
        return scope

    def launch_once(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    once.once_a_launch = True
    once.stock = patch_lang, launch  # (Triton's, for the test)
    interpreter._patch_lang = once
    interpreter.GridExecutor.__call__ = launch_once


def numpy_xor_sum():
    """The interpreter's reductions with ``xor_sum``'s combine function along an axis go to
    ``np.bitwise_xor.reduce``; every other reduction is the interpreter's own. Idempotent."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    apply_impl = interpreter.ReduceOps.apply_impl
    if getattr(apply_impl, "numpy_xor_sum", False):
        return

    def with_numpy_xor(self, input):
        if self.combine_fn is not tl.standard._xor_combine or self.axis is None:
            return apply_impl(self, input)
        data = input[0].handle.data
        return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis,
                                                    keepdims=self.keep_dims), input[0].dtype)

    with_numpy_xor.numpy_xor_sum = True
    with_numpy_xor.stock = apply_impl  # (Triton's, for the test)
    interpreter.ReduceOps.apply_impl = with_numpy_xor

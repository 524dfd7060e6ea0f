"""What ptxas makes of our Triton kernels for an H100 (sm_90), compiled on the CPU (no GPU): the
spill check (tests/test_sm90_spills.py) and the search's cost model (scripts/costmodel.py) read it.

Each kernel module of ``fairseq_attnzoo.modules`` that defines ``sm90_specializations()`` yields
``(label, kernel, signature, constexprs, num_warps)`` for every specialisation the layer and the
benchmark can launch. :func:`report` compiles them with
``triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=...),
target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))`` -- ``attrs``: what
Triton's launcher assumes on a device, pointers 16-byte aligned and the integers typed
``"i32:16"`` in ``signature`` divisible by 16 (:func:`compile_sm90`) -- and reads from each cubin,
with the ``cuobjdump`` that Triton ships:

* ``REG``: registers a thread; ``STACK``: bytes of stack frame a thread -- where ptxas puts the
  registers it spills (``--dump-resource-usage``; its ``LOCAL`` column stays 0 for spills);
* the number of local loads and stores (``LDL``/``STL``) in the SASS (``cuobjdump -sass``).

A specialisation spills when its stack or its local loads/stores are not 0. The compiles run in
ONE child process where Triton is not in interpreter mode (the tests' conftest sets
``TRITON_INTERPRET=1``), with a fresh Triton cache (nothing read from an earlier run), and
without fairseq (the kernels are plain PyTorch modules: the package's ``__init__`` would spend
about 6 s importing fairseq for nothing)::

    python -m scripts.sm90                          # every module's specialisations, a table
    python -m scripts.sm90 pkm_triton aop_triton    # some modules
    python -m scripts.sm90 --spec MODULE:FUNCTION   # a function's (a test's own kernels; tests/
                                                    # is on the path); --spec may repeat
    python -m scripts.sm90 --all --spec M:F         # every module's, then a function's
"""

import importlib
import importlib.abc
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def tool(name: str) -> str:
    """A binary Triton ships for NVIDIA targets (cuobjdump, ptxas)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def kernel_modules() -> List[str]:
    """The modules of fairseq_attnzoo.modules that define ``sm90_specializations``."""
    import fairseq_attnzoo.modules as package

    names = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if callable(getattr(module, "sm90_specializations", None)):
            names.append(info.name)
    return names


def specializations(modules: Optional[List[str]] = None) -> Iterator[Tuple[str, tuple]]:
    """``(module, (label, kernel, signature, constexprs, num_warps))`` of each module."""
    for name in modules or kernel_modules():
        module = importlib.import_module(f"fairseq_attnzoo.modules.{name}")
        for spec in module.sm90_specializations():
            yield name, spec


def disassemble(cubin: bytes) -> Tuple[Dict[str, int], str]:
    """(usage, SASS) of a cubin: ``registers``, ``stack`` (bytes a thread) and ``local ops``
    (LDL/STL in the SASS), and the SASS text (``cuobjdump -sass``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    found = {k: re.search(rf"\b{k}:(\d+)", res) for k in ("REG", "STACK")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump printed no REG/STACK: {res!r}")
    return {"registers": int(found["REG"].group(1)), "stack": int(found["STACK"].group(1)),
            "local ops": len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\s", sass))}, sass


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int):
    """The kernel compiled for sm_90 (no GPU needed), specialised as Triton's launcher does on a
    device: every pointer 16-byte aligned (a tensor from torch's allocator is), and an integer
    typed ``"i32:16"`` (Triton's own notation, as in ``triton.tools.compile``) divisible by 16 --
    the launcher compiles that variant for a value such as d 512 or a row stride; without it the
    loads along a row are not vectorised and the registers counted are not the device's."""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for name, kind in signature.items():
        kind, _, hint = (kind or "").partition(":")
        if kind.startswith("*") or hint == "16":
            attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
        sig[name] = kind or None
    return compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


class _WithoutFairseq(importlib.abc.MetaPathFinder):
    """Refuses ``fairseq`` and ``fairseq_cli``: ``fairseq_attnzoo``'s ``__init__`` then registers
    nothing (its without-fairseq path) and the kernel modules import as they do anywhere."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_cli"):
            raise ImportError(f"{name}: not imported where kernels are compiled (scripts/sm90.py)")
        return None


def _selected(argv: List[str]) -> Iterator[Tuple[str, tuple]]:
    """``(module, spec)`` of what ``argv`` names, in its order: module names, ``--all`` (every
    module's) and ``--spec MODULE:FUNCTION`` (a function returning specialisations, e.g. a
    test's own: module ``"test"``); every module's when it names nothing."""
    modules, i = [], 0
    while i < len(argv):
        if argv[i] == "--spec":
            if modules:
                yield from specializations(modules)
                modules = []
            module, function = argv[i + 1].split(":")
            yield from (("test", s) for s in getattr(importlib.import_module(module), function)())
            i += 2
            continue
        modules += kernel_modules() if argv[i] == "--all" else [argv[i]]
        i += 1
    if modules or not argv:
        yield from specializations(modules or None)


def _main(argv: List[str]):
    """In the child process: one JSON line per specialisation that ``argv`` names
    (:func:`_selected`)."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("0", ""), "compile in a plain process"
    sys.path[:0] = [REPO, TESTS]
    sys.meta_path.insert(0, _WithoutFairseq())
    for module, (label, kernel, signature, constexprs, num_warps) in _selected(argv):
        compiled = compile_sm90(kernel, signature, constexprs, num_warps)
        print(json.dumps(dict(module=module, label=label, warps=num_warps,
                              **disassemble(compiled.asm["cubin"])[0])), flush=True)


def report(args: List[str] = (), timeout: int = 600) -> List[dict]:
    """Compile the specialisations (``args`` as :func:`_main` takes them) in a child process and
    return one dict per specialisation: module, label, warps, registers, stack, local ops."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache  # (every run compiles: nothing from an earlier one)
        run = subprocess.run([sys.executable, "-m", "scripts.sm90", "--child", *args],
                             env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if run.returncode:
        raise RuntimeError(f"compiling for sm_90 failed:\n{run.stderr[-4000:]}")
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def spills(row: dict) -> bool:
    return row["stack"] > 0 or row["local ops"] > 0


def table(rows: List[dict]) -> str:
    """One line per specialisation: registers, stack, local loads/stores."""
    width = max([len(f"{r['module']} {r['label']}") for r in rows] + [10])
    lines = [f"{'specialisation':<{width}}  warps  regs  stack  LDL/STL"]
    for r in rows:
        lines.append(f"{r['module'] + ' ' + r['label']:<{width}}  {r['warps']:>5}  "
                     f"{r['registers']:>4}  {r['stack']:>5}  {r['local ops']:>7}"
                     + ("  SPILLS" if spills(r) else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _main(sys.argv[2:])
    else:
        print(table(report(sys.argv[1:])))

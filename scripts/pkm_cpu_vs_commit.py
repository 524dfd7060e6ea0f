"""The PKM layer on the CPU: a commit's layer files (``fairseq_attnzoo/modules/pkm.py``, its
``pkm_search.py`` and ``pkm_values.py`` where the commit has them, and its kernel files, whose
names the layer calls) against this checkout's, in one
process, alternating (the layer's forward + backward, same weights, same
input; PyTorch value read and search, as on a CPU). For a quiet machine: the ratio is what
counts, and only in one run.

    python -m scripts.pkm_cpu_vs_commit 7605095 --tokens 4096 --repeats 10

The other modules (precision, constants, ...) are this checkout's for both: a commit whose
layer files need other versions of them does not load here.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time

import torch

import fairseq_attnzoo.modules as package
from fairseq_attnzoo.modules import pkm as ours


#: the layer's files, each importing the ones before it: its kernels' (their names changed with
#: the layer) and the layer's own (before the split of issue 65: pkm.py alone)
LAYER_FILES = ("pkm_triton", "pkm_search_triton", "pkm_search", "pkm_values", "pkm")


def load(commit: str):
    """The layer's files of ``commit`` as modules of the package (their relative imports), each
    importing the commit's versions of the others; ``modules/pkm.py`` of it is returned."""
    saved = {}
    try:
        for name in LAYER_FILES:
            found = subprocess.run(["git", "show", f"{commit}:fairseq_attnzoo/modules/{name}.py"],
                                   capture_output=True, text=True)
            if found.returncode and name != "pkm":  # a file the commit does not have
                continue
            found.check_returncode()
            then = importlib.util.module_from_spec(importlib.util.spec_from_loader(
                f"{package.__name__}._{name}_{commit}", loader=None))
            then.__package__ = package.__name__
            # while it loads, the commit's file is the one the next file's ``from .name`` or
            # ``from . import name`` finds (the module and the package's attribute)
            full = f"{package.__name__}.{name}"
            saved.setdefault(name, sys.modules.get(full))
            sys.modules[full] = then
            setattr(package, name, then)
            exec(compile(found.stdout, f"{commit}:{name}.py", "exec"), then.__dict__)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(f"{package.__name__}.{name}", None)
                delattr(package, name)
            else:
                sys.modules[f"{package.__name__}.{name}"] = module
                setattr(package, name, module)
    return then


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commit", help="the commit whose pkm.py is today's code")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10, help="steps of each, alternating")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    a = p.parse_args(argv)
    modules = {a.commit: load(a.commit), "this checkout": ours}
    for dtype in ({"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in a.dtypes):
        layers = {}
        for name, module in modules.items():  # the paper's memory: 512² slots, 4 heads, knn 32
            torch.manual_seed(0)
            layers[name] = module.ProductKeyMemory(
                512, 512, n_keys=512, heads=4, knn=32, k_dim=256, kernel="torch",
                search_kernel="torch").to(dtype)
        layers["this checkout"].load_state_dict(layers[a.commit].state_dict())
        x = torch.randn(a.tokens // 128, 128, 512, generator=torch.Generator().manual_seed(1))
        x = x.to(dtype).requires_grad_()

        def step(m):
            m.zero_grad(set_to_none=True)
            x.grad = None
            t0 = time.perf_counter()
            m(x).float().sum().backward()
            return time.perf_counter() - t0

        for m in layers.values():  # a warm step each
            step(m)
        times = {name: [] for name in layers}
        for i in range(a.repeats):
            for name in (list(layers) if i % 2 == 0 else list(layers)[::-1]):
                times[name].append(step(layers[name]))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        print(f"{dtype}, {a.tokens} tokens, {torch.get_num_threads()} threads: {a.commit} "
              f"{ms[a.commit]:.1f} ms, this checkout {ms['this checkout']:.1f} ms a step "
              f"(ratio {ms['this checkout'] / ms[a.commit]:.3f})", flush=True)


if __name__ == "__main__":
    main()

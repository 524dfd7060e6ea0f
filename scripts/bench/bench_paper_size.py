#!/usr/bin/env python
"""End-to-end ``fairseq-train`` at the sizes people train: every arch against its stock baseline.

For each group, precision and arch, the baseline and the arch are trained alternately (baseline,
arch, arch, baseline, ...) for the same number of updates with the same flags and seed; each run
reports training tokens/s (median of fairseq's ``wps`` over the ``train_inner`` intervals after the
first, so start-up and compilation are left out), peak GPU memory (``torch.cuda.max_memory_
allocated`` of the training process) and the valid loss reached at the last update. The table
gives medians over the repeats and the ratios to the baseline; every row is written to ``--out``
as soon as it is measured, so a cut-off run keeps what it finished. ``--baseline bracket`` halves
the runs for a short GPU loan: the baseline runs once before a group's archs and once after them,
the rows use the first run, and a note gives the drift between the two. ``--seeds A B`` gives
the repeats seeds in turn; with ``--precisions fp16 bf16`` a last table then says whether each
arch's valid loss in bf16 is within the run-to-run noise of its fp16 loss (the issue's target).
Instead of timed rows, ``--count-ops`` counts the aten ops (kernel launches, host syncs) an update
dispatches and ``--host-time`` times the host's share of an update (forward, backward, optimizer
and trainer); ``--size host`` is the base models' depth at a width where a CPU's arithmetic is
small, the CPU's proxy of a GPU step that waits for the host.

Groups (``--size base``; ``--size tiny`` shrinks every model for a CPU dry run of the harness):

* ``mt``: transformer-base translation (6+6 layers, d 512, FFN 2048, 8 heads, ``--max-tokens
  8192``): ``transformer`` vs the Synthesizer, AOP, collab and PKM archs.
* ``lm``: a 12-layer d 512 ``transformer_lm`` vs ``transformer_lm_pkm`` and
  ``transformer_lm_memplus`` with 262,144 memory slots (``--pkm-n-keys 512``), blocks of 512.
* ``span``: ``adaptive_span_lm`` at the adaptive-span paper's small enwik8 configuration against
  fairseq's installed ``examples/adaptive_span`` (``scripts.bench.bench_adaptive_span_vs_fairseq``).

Precisions: ``fp16`` (``--fp16``), ``bf16`` (``--bf16``: fairseq's bf16 path, reachable on GPUs
through the plugin's compat entry ``fairseq_bf16_without_tpu``), ``amp``, ``fp32``.

Examples::

    python -m scripts.bench.bench_paper_size --size base --device cuda --precisions fp16 bf16 \\
        --data-mt data/libreoffice/bin --data-lm data/wiki-gensim/bin --out results/paper_size.md
    python -m scripts.bench.bench_paper_size --size tiny --device cpu --updates 6 --repeats 1   # dry run

(run from the repository root: ``scripts`` is a package; the training runs are child processes of
the same modules, started in the repository root).
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from scripts.bench.benchlib import PEAK_TAG, json_log_lines, peak_cuda_gib
from scripts.demo.config import REPO, USER_DIR

MODULE = "scripts.bench.bench_paper_size"  # runs itself (--run-train) as a child: python -m MODULE

MT_ARCHS = ["transformer_synth_dense", "transformer_synth_random",
            "transformer_synth_factorized_random", "transformer_aop", "transformer_aop_h16",
            "transformer_collab", "transformer_pkm"]
LM_ARCHS = ["transformer_lm_pkm", "transformer_lm_memplus"]
BASELINE = {"mt": "transformer", "lm": "transformer_lm"}

MT_BASE = ("--task translation --share-decoder-input-output-embed --optimizer adam "
           "--adam-betas (0.9,0.98) --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
           "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout 0.1 "
           "--max-tokens 8192 --skip-invalid-size-inputs-valid-test")
#: --decoder-normalize-before: the zoo LMs are fairseq's pre-norm LM (base_lm_architecture, as
#: transformer_lm_big/_gpt), but the bare ``transformer_lm`` arch name skips that function and
#: builds a post-norm model without the final layer norm: the flag gives the baseline the same
#: layout (a no-op for the zoo archs)
LM_BASE = ("--task language_modeling --sample-break-mode none --tokens-per-sample 512 "
           "--decoder-normalize-before "
           "--decoder-layers 12 --decoder-embed-dim 512 --decoder-ffn-embed-dim 2048 "
           "--decoder-attention-heads 8 --optimizer adam --adam-betas (0.9,0.98) --lr 5e-4 "
           "--lr-scheduler inverse_sqrt --warmup-updates 4000 --criterion cross_entropy "
           "--dropout 0.1 --max-tokens 8192")
#: method flags (zoo archs only; the stock baselines do not know them)
METHOD = {"mt": "", "lm": "--pkm-n-keys 512"}
#: --size tiny: the same runs with every model shrunk (a CPU dry run of the harness)
TINY_MT = ("--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 "
           "--encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --encoder-attention-heads 4 "
           "--decoder-attention-heads 4 --max-tokens 1024")
TINY_LM = ("--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 "
           "--decoder-attention-heads 4 --tokens-per-sample 64 --max-tokens 1024")
# (AOP: at d 64 the FFN-matched memory has no slots left, so --aop-slots is set)
TINY_METHOD = "--pkm-n-keys 16 --pkm-knn 4 --pkm-k-dim 16 --aop-slots 16"
#: --size host: the base models' depth, heads and op sequence at a width (d 32: 8 heads of 4)
#: and batch (96 tokens) where a step's arithmetic is small beside what the host spends on it
#: (--host-time; the PKM memory smaller: the ops per step do not depend on its size)
HOST_MT = ("--encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 "
           "--decoder-ffn-embed-dim 64 --max-tokens 96")
HOST_LM = ("--decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --tokens-per-sample 48 "
           "--max-tokens 96")
HOST_METHOD = "--pkm-n-keys 32 --pkm-k-dim 16 --aop-slots 48 --synth-max-len 64"
PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"], "amp": ["--amp"]}
#: the adaptive-span paper's small enwik8 model (Sukhbaatar et al. 2019, Table/appendix: 12
#: layers, d 512, 8 heads, FFN 2048, span 8192, block 512, batch 64)
SPAN_PAPER_SMALL = ["--layers", "12", "--dim", "512", "--heads", "8", "--ffn", "2048",
                    "--span", "8192", "--block", "512", "--batch", "64"]
SPAN_TINY = ["--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128", "--span", "64",
             "--block", "32", "--batch", "4"]

#: set by --profile for a child run: "PATH:WAIT:ACTIVE" (write the profile table to PATH)
PROFILE_ENV = "ATTNZOO_BENCH_PROFILE"
#: set by --count-ops for a child run: "PATH:WAIT:ACTIVE" (write the op counts to PATH as JSON)
COUNT_ENV = "ATTNZOO_BENCH_COUNT_OPS"
#: set by --host-time for a child run: "PATH:WAIT:ACTIVE" (write the step times to PATH as JSON)
HOST_TIME_ENV = "ATTNZOO_BENCH_HOST_TIME"
#: set by --no-cudnn-sdpa for every child run: torch's cuDNN attention backend switched off
NO_CUDNN_SDPA_ENV = "ATTNZOO_BENCH_NO_CUDNN_SDPA"
#: ops that make the host wait for the device on CUDA, whatever device the count runs on: a
#: value read back (``.item()``, ``bool(t)``, ``float(t)``, ``torch.equal``), or an output whose
#: size the host must learn from the data (``nonzero``, ``unique*``, ``masked_select``;
#: ``bincount``, which reads its input's maximum). Each one drains the GPU's queue. Not seen by a
#: count on the CPU: ``.tolist()``, ``.numpy()`` and ``.cpu()``, which dispatch nothing there
HOST_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select",
                 "unique_consecutive", "_unique", "_unique2", "unique_dim",
                 "unique_dim_consecutive", "bincount", "histc"}


#: aten ops that are not views to autograd but launch no kernel on CUDA: allocations without a
#: fill, and ``_unsafe_view`` (the reshape of a matrix product's output)
NO_KERNEL_OPS = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty",
                 "new_empty_strided"}


def launches_kernel(func) -> bool:
    """Whether the aten op ``func`` launches at least one kernel on CUDA: not a view, not in
    :data:`NO_KERNEL_OPS`."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL_OPS


def host_sync(func, args, kwargs) -> bool:
    """Whether the aten op ``func(*args, **kwargs)`` synchronises with the device on CUDA:
    :data:`HOST_SYNC_OPS`, indexing with a boolean mask (a ``nonzero`` inside ATen), and
    ``repeat_interleave`` without ``output_size``."""
    import torch

    name = func.overloadpacket.__name__
    if name in HOST_SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        index = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in index)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    return False


def _self_time(event, cuda: bool) -> float:
    """An op's self time in µs on the device (CUDA: kernels; else CPU), across torch versions."""
    names = (("self_device_time_total", "self_cuda_time_total") if cuda
             else ("self_cpu_time_total",))
    return next((float(getattr(event, n)) for n in names if hasattr(event, n)), 0.0)


def _is_op(event, cuda: bool) -> bool:
    """An operator row of the table. Left out: ``record_function`` ranges (fairseq's "forward",
    "train_step-N", the optimizer's "Adam.step", ``ProfilerStep*``), whose device time spans every
    kernel inside them, and (CUDA) the kernel events themselves, whose time is already the self
    device time of the op that launched them."""
    if getattr(event, "is_user_annotation", False) or event.key.startswith("ProfilerStep"):
        return False
    return not cuda or str(getattr(event, "device_type", "CPU")).endswith("CPU")


def profile_table(events, steps: int, cuda: bool, rows: int = 15,
                  wall_ms: Optional[float] = None) -> str:
    """Top ops by self time (``torch.profiler`` key averages) as a markdown table: calls and ms
    per training step, and the share of the ops' total self time. ``wall_ms``: the measured
    (synchronised) wall time of a step, printed beside the ops' total: on a GPU the difference
    is time the device waited for the host."""
    timed = [(e.key, e.count, _self_time(e, cuda)) for e in events if _is_op(e, cuda)]
    total = sum(t for _, _, t in timed) or 1.0
    head = f"total self {'CUDA' if cuda else 'CPU'} time of the ops per step: {total / steps / 1e3:.2f} ms"
    if wall_ms is not None:
        head += f"; wall time per step: {wall_ms:.2f} ms"
    out = [head, "", "| op | calls/step | ms/step | share |", "|---|---|---|---|"]
    for key, count, t in sorted(timed, key=lambda r: -r[2])[:rows]:
        out.append(f"| `{key[:80]}` | {count / steps:g} | {t / steps / 1e3:.3f} | "
                   f"{100 * t / total:.1f} % |")
    return "\n".join(out)


def _profile_train_steps(spec: str):
    """Wrap ``Trainer.train_step`` in ``torch.profiler``: skip WAIT updates (start-up, cache
    warm-up), warm the profiler up one, record ACTIVE; write :func:`profile_table` to PATH."""
    import torch
    from fairseq.trainer import Trainer

    path, wait, active = spec.rsplit(":", 2)
    wait, active = int(wait), int(active)
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    walls = []  # wall seconds of every step; the recorded ones are the last ``active``

    def write(prof):
        wall_ms = 1e3 * statistics.median(walls[-active:]) if len(walls) >= active else None
        with open(path, "w") as f:
            f.write(profile_table(prof.key_averages(), active, cuda, wall_ms=wall_ms) + "\n")

    prof = torch.profiler.profile(
        activities=activities, on_trace_ready=write,
        schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1))
    step = Trainer.train_step

    def profiled_step(self, samples, raise_oom=False):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step(self, samples, raise_oom)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        prof.step()
        return out

    prof.start()
    Trainer.train_step = profiled_step
    return prof


class HostTensors:
    """Which tensors of a run on the CPU would stay on the host in the same run on a GPU, so that
    reading them back is no device sync: the outputs of tensor factories called without a device
    (``torch.tensor``, ``torch.arange``, ...: torch fills in the CPU before dispatch, so they are
    seen where they are called), shapes turned into tensors (fairseq's positional embedding), and
    whatever is computed from such tensors only. Everything else (parameters, batches, their
    products) would live on the GPU."""

    #: torch functions that make a tensor from nothing: on the host unless given a device
    FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand",
                 "randn", "randint", "linspace", "eye", "_shape_as_tensor"}

    def __init__(self):
        self.tensors = {}  # id -> weak reference (a WeakSet would compare tensors with ==)

    def __contains__(self, t) -> bool:
        ref = self.tensors.get(id(t))
        return ref is not None and ref() is t

    def add(self, tree):
        import weakref

        for t in self._leaves(tree):
            self.tensors[id(t)] = weakref.ref(t, lambda _, key=id(t): self.tensors.pop(key, None))

    @staticmethod
    def _leaves(tree):
        import torch
        from torch.utils._pytree import tree_leaves

        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    def counting(self, on_op):
        """A context in which every aten op runs as usual and is reported as ``on_op(func,
        sync)``, ``sync``: whether it would make the host wait for the device on CUDA
        (:func:`host_sync`, unless every input stays on the host)."""
        import contextlib

        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        host = self

        class Factories(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if getattr(func, "__name__", None) in host.FACTORIES and kwargs.get("device") is None:
                    host.add(out)
                return out

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = host._leaves((args, kwargs))
                on_host = bool(inputs) and all(t in host for t in inputs)
                out = func(*args, **kwargs)
                if on_host:
                    host.add(out)
                on_op(func, not on_host and host_sync(func, args, kwargs))
                return out

        stack = contextlib.ExitStack()
        stack.enter_context(Factories())
        stack.enter_context(Ops())
        return stack


def _caller() -> str:
    """``package/file.py:line`` of the innermost frame in fairseq or this plugin that led here."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        for package in ("fairseq_attnzoo/", "fairseq/", "fairseq_cli/"):
            if f"/{package}" in path:
                return f"{package}{path.rsplit('/' + package, 1)[1]}:{frame.lineno}"
    return "?"


def sublayer_of(module: str) -> str:
    """The sublayer a module path (from the model's class name) belongs to: ``encoder.self_attn``
    for anything inside an encoder layer's ``self_attn`` (all layers together), ``decoder.layer``
    for a decoder layer's own ops (residuals, norms, dropout), ``encoder.embed_tokens`` outside the
    layers, a root module's class name for its own ops (the model's, the criterion's)."""
    root, *parts = module.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[:i] + (parts[i + 2:i + 3] or ["layer"]))
    return ".".join(parts[:2]) or root


class ModuleAttribution:
    """Which module each op of a training step runs for, in the forward and in the backward: a
    context whose :meth:`current` is the path of the innermost module whose forward is running
    (``TransformerModel.encoder.layers.0.fc1``), or, in the backward, of the module whose forward
    made the autograd node being run (each module's new nodes are tagged when its forward
    returns, innermost first); ``trainer`` outside of both, the node's class for a node no module
    made (``AccumulateGrad``)."""

    TAG = "attnzoo_module"

    def __init__(self):
        import weakref

        self.names = weakref.WeakKeyDictionary()
        self.running = []  # (path, first autograd sequence number) of each forward running

    def _name(self, module):
        if module not in self.names:
            root = type(module).__name__
            for path, sub in module.named_modules():
                self.names.setdefault(sub, f"{root}.{path}" if path else root)
        return self.names[module]

    def current(self) -> str:
        import torch

        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get(self.TAG, type(node).__name__)
        return self.running[-1][0] if self.running else "trainer"

    def _enter(self, module, args):
        import torch

        self.running.append((self._name(module), torch._C._autograd._get_sequence_nr()))

    def _exit(self, module, args, output):
        import torch

        name, first = self.running.pop()
        nodes = [t.grad_fn for t in HostTensors._leaves(output)]
        seen = set()
        while nodes:  # the nodes this forward made: those no module inside it claimed are its
            node = nodes.pop()
            if node is None or node in seen or node._sequence_nr() < first:
                continue
            seen.add(node)
            node.metadata.setdefault(self.TAG, name)
            nodes.extend(n for n, _ in node.next_functions)

    def __enter__(self):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        self.hooks = [register_module_forward_pre_hook(self._enter),
                      register_module_forward_hook(self._exit)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def _as_on_cuda():
    """Make a CPU run dispatch what CUDA dispatches where the two differ by choice: the
    product-key search in one chunk of all tokens (the CPU splits it into cache-sized chunks, ~20
    ops each), Synthesizer's tables through the fused kernel."""
    from fairseq_attnzoo.modules import pkm, synthesizer

    pkm._SCORE_CHUNK = 1 << 62
    synthesizer.AUTO_SDPA_DEVICES.add("cpu")


class StepPhases:
    """The phase a training step is in -- ``forward`` (the task's train_step: model and
    criterion), ``backward``, or ``rest`` (optimizer, clipping, the trainer) -- and the host
    seconds each phase took in every measured update (``updates``: one dict per update)."""

    def __init__(self):
        self.name, self.updates, self._since = "rest", [], None

    def enter(self, name):
        now = time.perf_counter()
        if self._since is not None:  # the time since the last change was the old phase's
            spent = self.updates[-1]
            spent[self.name] = spent.get(self.name, 0.0) + now - self._since
        self.name, self._since = name, now

    def start(self):
        self.updates.append({})
        self.enter("rest")

    def stop(self):
        self.enter("rest")
        self._since = None


def _measure_train_steps(spec: str, phases: StepPhases, around, report):
    """Patch ``Trainer.train_step`` so that the ACTIVE updates after WAIT (``spec`` =
    "PATH:WAIT:ACTIVE") run inside the context ``around()``, with ``phases`` following the step
    through its forward, backward and the rest; after the last, ``report(active)`` is written to
    PATH as JSON."""
    from fairseq.trainer import Trainer

    _as_on_cuda()
    path, wait, active = spec.rsplit(":", 2)
    wait, active = int(wait), int(active)
    calls = [0]

    def in_phase(fn, name, after):
        def run(*args, **kwargs):
            phases.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                phases.enter(after)
        return run

    step = Trainer.train_step

    def measured_step(self, samples, raise_oom=False):
        calls[0] += 1
        if not wait < calls[0] <= wait + active:
            return step(self, samples, raise_oom)
        task, optimizer = self.task, self.optimizer
        task.train_step = in_phase(type(task).train_step.__get__(task), "forward", "rest")
        optimizer.backward = in_phase(type(optimizer).backward.__get__(optimizer), "backward",
                                      "forward")
        try:
            with around():
                phases.start()
                out = step(self, samples, raise_oom)
                phases.stop()
        finally:
            del task.train_step, optimizer.backward
        if calls[0] == wait + active:
            with open(path, "w") as f:
                json.dump(report(active), f)
        return out

    Trainer.train_step = measured_step


def _count_train_steps(spec: str):
    """Count the aten ops ``Trainer.train_step`` dispatches (through a ``TorchDispatchMode``, below
    autograd: :meth:`HostTensors.counting`) over ACTIVE updates after WAIT, split into the
    forward (model and criterion), the backward and the rest (optimizer, gradient clipping, the
    trainer), and the kernel launches by phase and sublayer (:class:`ModuleAttribution`); write
    them to PATH."""
    import contextlib
    from collections import Counter

    counts, views, phases = Counter(), [0], StepPhases()
    by_phase = Counter()  # phase -> ops
    syncs = Counter()  # (phase, op) -> host syncs it would be on CUDA
    launches = Counter()  # (phase, sublayer) -> ops that launch a kernel on CUDA
    host = HostTensors()
    modules = ModuleAttribution()

    def count(func, sync):
        counts[func.overloadpacket.__name__] += 1
        by_phase[phases.name] += 1
        views[0] += func.is_view
        if launches_kernel(func):
            launches[phases.name, sublayer_of(modules.current())] += 1
        if sync:
            syncs[phases.name, f"{func.overloadpacket.__name__} ({_caller()})"] += 1

    @contextlib.contextmanager
    def around():
        with modules, host.counting(count):
            yield

    def report(active):
        return {"ops": sum(counts.values()) / active, "views": views[0] / active,
                "launches/update": sum(launches.values()) / active,
                **{k: by_phase[k] / active for k in ("forward", "backward", "rest")},
                "host syncs": sum(syncs.values()) / active,
                "syncs": {f"{p}:{n}": c / active for (p, n), c in sorted(syncs.items())},
                "top": [(n, c / active) for n, c in counts.most_common(8)],
                "launches": {f"{p}:{m}": c / active for (p, m), c in sorted(launches.items())}}

    _measure_train_steps(spec, phases, around, report)


def _time_train_steps(spec: str):
    """The host's wall time of each of ACTIVE updates after WAIT, split into the forward, the
    backward and the rest: medians in milliseconds, written to PATH."""
    import contextlib

    phases = StepPhases()

    def report(active):
        ms = {k: 1000 * statistics.median(u.get(k, 0.0) for u in phases.updates)
              for k in ("forward", "backward", "rest")}
        return {"update": 1000 * statistics.median(sum(u.values()) for u in phases.updates),
                **ms}

    _measure_train_steps(spec, phases, contextlib.nullcontext, report)


def run_train_here(argv):
    """``fairseq-train argv`` in this process, then print the peak CUDA memory it allocated
    (under ``ATTNZOO_BENCH_PROFILE``: with its steps profiled)."""
    import torch
    from fairseq_cli import train

    if os.environ.get(NO_CUDNN_SDPA_ENV) == "1":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if os.environ.get(COUNT_ENV):
        _count_train_steps(os.environ[COUNT_ENV])
    if os.environ.get(HOST_TIME_ENV):
        _time_train_steps(os.environ[HOST_TIME_ENV])
    spec = os.environ.get(PROFILE_ENV)
    prof = _profile_train_steps(spec) if spec else None
    sys.argv = ["fairseq-train"] + argv
    try:
        train.cli_main()
    finally:
        if prof is not None:
            prof.stop()
        if torch.cuda.is_available():
            print(f"{PEAK_TAG} {torch.cuda.max_memory_allocated()}", flush=True)


def split_variant(spec: str):
    """``ARCH`` or a variant ``ARCH:--flag=value:...`` (``--variant``) -> (ARCH, [flags])."""
    arch, *flags = spec.split(":")
    return arch, flags


def train_command(group, spec, data, args, save_dir, seed=None):
    arch, variant_flags = split_variant(spec)
    flags = shlex.split(MT_BASE if group == "mt" else LM_BASE)
    from fairseq_attnzoo.models.registry import own_flags  # (the arch's methods' flags only)

    if arch != BASELINE[group]:
        flags += own_flags(arch, shlex.split(METHOD[group])) + variant_flags
    if args.size != "base":
        shrunk = {"tiny": (TINY_MT, TINY_LM, TINY_METHOD), "host": (HOST_MT, HOST_LM, HOST_METHOD)}
        mt, lm, method = shrunk[args.size]
        flags += shlex.split(mt if group == "mt" else lm)
        if arch != BASELINE[group]:
            flags += own_flags(arch, shlex.split(method))
    interval = max(1, args.updates // 5)
    cmd = [sys.executable, "-m", MODULE, "--run-train", data, "--user-dir", USER_DIR,
           "--arch", arch, "--max-update", str(args.updates), "--seed",
           str(args.seed if seed is None else seed),
           "--save-dir", save_dir, "--no-save", "--log-format", "json", "--log-interval",
           str(interval), "--num-workers", "2", "--max-valid-steps", str(args.valid_steps)]
    cmd += flags + PRECISION_FLAGS[args._precision]
    if args.device == "cpu":
        cmd.append("--cpu")
    return cmd + shlex.split(args.extra)


def one_run(group, arch, data, args, env=None, seed=None):
    """One ``fairseq-train`` run (``seed``: default ``--seed``): its tokens/s, peak GiB, valid
    loss, wall seconds and seed, or ``{"error": last line}``."""
    env = {**(env or {}), **({NO_CUDNN_SDPA_ENV: "1"} if args.no_cudnn_sdpa else {})}
    seed = args.seed if seed is None else seed
    with tempfile.TemporaryDirectory() as tmp:
        cmd = train_command(group, arch, data, args, tmp, seed)
        t0 = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout,
                             cwd=REPO, env={**os.environ, **env})
        text = out.stdout + out.stderr
    if out.returncode != 0:
        return {"error": text.strip().splitlines()[-1][:300] if text.strip() else "failed"}
    inner = json_log_lines(text, "train_inner")
    valid = json_log_lines(text, "valid")
    wps = [float(r["wps"]) for r in inner[1:]] or [float(r["wps"]) for r in inner]
    return {"tokens/s": statistics.median(wps) if wps else float("nan"),
            "peak GiB": peak_cuda_gib(text),
            "valid loss": float(valid[-1]["valid_loss"]) if valid else float("nan"),
            "wall s": time.time() - t0, "seed": seed}


def repeat_seed(args, i: int) -> int:
    """The seed of repeat ``i``: ``--seeds`` in turn (both the baseline's and the arch's run of a
    repeat), else ``--seed``."""
    return args.seeds[i % len(args.seeds)] if args.seeds else args.seed


AGREEMENT_COLUMNS = ["group", "arch", "precision", "valid loss by seed", "mean",
                     "reference valid loss by seed", "reference mean", "difference", "noise",
                     "within the noise"]


def reference_precision(precisions) -> str:
    """What the other precisions' losses are judged against: fp16 (the issue's target: bf16
    within the noise of ``--fp16``), else the first one given (on the CPU, which has no fp16
    training: fp32)."""
    return "fp16" if "fp16" in precisions else precisions[0]


def agreement_rows(losses, reference="fp16"):
    """The target "every family's loss within the run-to-run noise of ``--fp16``": for each arch
    and precision other than ``reference``, the valid losses by seed against the reference's at
    the same updates. The noise is the larger spread (max − min over the seeds) of the two
    precisions, so it needs at least two seeds of each; the verdict is whether the means differ
    by no more."""
    rows = []
    for (group, arch, precision), by_seed in losses.items():
        ref = losses.get((group, arch, reference))
        if precision == reference or ref is None:
            continue
        row = {"group": group, "arch": arch, "precision": precision,
               "valid loss by seed": _by_seed(by_seed), "mean": statistics.mean(by_seed.values()),
               "reference valid loss by seed": _by_seed(ref),
               "reference mean": statistics.mean(ref.values())}
        row["difference"] = row["mean"] - row["reference mean"]
        if min(len(by_seed), len(ref)) < 2:
            row.update(noise="", **{"within the noise": "needs 2 seeds of each (--seeds)"})
        else:
            row["noise"] = max(max(v.values()) - min(v.values()) for v in (by_seed, ref))
            row["within the noise"] = "yes" if abs(row["difference"]) <= row["noise"] else "no"
        rows.append(row)
    return rows


def _by_seed(by_seed) -> str:
    return ", ".join(f"{loss:.3f} (seed {seed})" for seed, loss in sorted(by_seed.items()))


def median_of(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else float("nan")


def note_losses(args, group, arch, runs):
    """Keep the valid loss of each of ``arch``'s timed ``runs`` by seed, for the agreement
    table (:func:`agreement_rows`)."""
    for r in runs:
        if not math.isnan(r.get("valid loss", math.nan)):
            args._losses.setdefault((group, arch, args._precision), {})[
                r.get("seed", args.seed)] = r["valid loss"]


def bench_pair(group, arch, data, args, base=None):
    """Alternate baseline and arch ``--repeats`` times; one table row. ``base``: baseline runs
    already made (``--baseline bracket``): only the arch runs."""
    baseline = BASELINE[group]
    cand = []
    if base is None:
        base = []
        for i in range(args.repeats):
            order = [(baseline, base), (arch, cand)]
            for name, sink in (order if i % 2 == 0 else order[::-1]):
                sink.append(one_run(group, name, data, args, seed=repeat_seed(args, i)))
    else:
        cand = [one_run(group, arch, data, args, seed=repeat_seed(args, i))
                for i in range(args.repeats)]
    note_losses(args, group, baseline, base)
    note_losses(args, group, arch, cand)
    errors = [r["error"] for r in base + cand if "error" in r]
    row = {"group": group, "precision": args._precision, "arch": arch, "baseline": baseline}
    if errors:
        row["error"] = errors[0]
        return row
    for key in ("tokens/s", "peak GiB", "valid loss"):
        row[key] = median_of(cand, key)
        row[f"baseline {key}"] = median_of(base, key)
    row["speed ratio"] = row["tokens/s"] / row["baseline tokens/s"]
    row["memory ratio"] = row["peak GiB"] / row["baseline peak GiB"]
    return row


COLUMNS = ["group", "precision", "arch", "tokens/s", "baseline tokens/s", "speed ratio",
           "peak GiB", "baseline peak GiB", "memory ratio", "valid loss", "baseline valid loss"]


def bracket_note(group, first, last) -> str:
    """``--baseline bracket``: the closing baseline run against the opening one (the rows above
    used the opening run; a drift beyond the run-to-run noise makes their ratios suspect). With
    ``--seeds`` the closing run takes the second seed: the same batches in another order."""
    if "error" in last or "error" in first[0]:
        return f"\n({group}: closing baseline run failed: {last.get('error', '')})\n"
    a, b = first[0]["tokens/s"], last["tokens/s"]
    return (f"\n({group}, {BASELINE[group]}: baseline tokens/s {a:,.0f} before the rows above, "
            f"{b:,.0f} after them: drift {100 * (b - a) / a:+.1f} %)\n")


def format_row(row):
    if "error" in row:
        return f"| {row['group']} | {row['precision']} | {row['arch']} | failed: {row['error']} |"
    cells = []
    for c in COLUMNS:
        v = row.get(c, "")
        cells.append(f"{v:.3f}" if isinstance(v, float) and "ratio" in c else
                     f"{v:,.0f}" if isinstance(v, float) and "tokens" in c else
                     f"{v:.2f}" if isinstance(v, float) and "GiB" in c else
                     f"{v:.3f}" if isinstance(v, float) else str(v))
    return "| " + " | ".join(cells) + " |"


def _short_run(group, arch, data, args, env_name, wait, active):
    """A short run of ``arch`` (``wait`` + 1 + ``active`` updates, no validation) whose child
    writes a file under ``env_name``: that file's text, or why there is none."""
    short = argparse.Namespace(**{**vars(args), "updates": wait + 1 + active,
                                  "extra": args.extra + " --disable-validation"})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        result = one_run(group, arch, data, short, env={env_name: f"{path}:{wait}:{active}"})
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
    return f"nothing written ({result.get('error', 'too few updates?')})"


def profile_run(group, arch, data, args, emit):
    """One more, short run of ``arch`` under ``torch.profiler`` (after ``--profile-wait`` updates,
    ``--profile-steps`` recorded, no validation); its top-ops table goes into the report."""
    wait, active = args.profile_wait, args.profile_steps
    table = _short_run(group, arch, data, args, PROFILE_ENV, wait, active)
    emit(f"\n#### Profile: {group}, {args._precision}, {arch} ({active} updates after {wait})\n")
    emit(table)


COUNT_COLUMNS = ["group", "precision", "arch", "ops/update", "of which views",
                 "kernel launches/update (on CUDA)",
                 "host syncs/update (on CUDA)", "forward", "backward", "optimizer + trainer",
                 "most dispatched ops (per update)", "host syncs by phase and op"]


HOST_COLUMNS = ["group", "precision", "arch", "host ms/update", "forward", "backward",
                "optimizer + trainer", "baseline host ms/update", "speed ratio if host-bound"]


def host_time(group, arch, data, args):
    """``--host-time``: the medians in ms of one short run's updates (total, forward, backward,
    rest), or ``{"error": why}``."""
    text = _short_run(group, arch, data, args, HOST_TIME_ENV, args.profile_wait,
                      args.profile_steps)
    try:
        return json.loads(text)
    except ValueError:
        return {"error": text[:300]}


def host_time_row(group, precision, arch, ms, base) -> str:
    """A table row of :data:`HOST_COLUMNS`: ``arch``'s host times ``ms`` against the baseline's
    ``base`` (the baseline's time over the arch's: the speed ratio of a step that waits for the
    host)."""
    if "error" in ms or "error" in base:
        why = ms.get("error") or base.get("error")
        return f"| {group} | {precision} | {arch} | failed: {why} |"
    return (f"| {group} | {precision} | {arch} | {ms['update']:.2f} | {ms['forward']:.2f} | "
            f"{ms['backward']:.2f} | {ms['rest']:.2f} | {base['update']:.2f} | "
            f"{base['update'] / ms['update']:.3f} |")


def count_row(group, arch, data, args):
    """The ops ``arch`` dispatches per update (``--count-ops``): a host-cost measure that does not
    depend on the machine. On a GPU that waits for the host, each op that
    :func:`launches_kernel` costs at least one launch and each host sync (:func:`host_sync`)
    drains the queue. Returns the row and
    the kernel launches by (phase, sublayer) ({} when the run failed)."""
    text = _short_run(group, arch, data, args, COUNT_ENV, args.profile_wait, args.profile_steps)
    try:
        c = json.loads(text)
    except ValueError:
        return f"| {group} | {args._precision} | {arch} | failed: {text[:300]} |", {}
    top = ", ".join(f"{n} {v:g}" for n, v in c["top"][:5])
    syncs = ", ".join(f"{k} {v:g}" for k, v in c["syncs"].items())
    return (f"| {group} | {args._precision} | {arch} | {c['ops']:,.0f} | {c['views']:,.0f} | "
            f"{c['launches/update']:,.0f} | "
            f"{c['host syncs']:g} | {c['forward']:,.0f} | {c['backward']:,.0f} | "
            f"{c['rest']:,.0f} | {top} | {syncs} |"), c["launches"]


SUBLAYER_COLUMNS = ["arch", "sublayer", "forward", "backward", "baseline forward",
                    "baseline backward", "difference"]


def sublayer_rows(launches, baseline):
    """The sublayers whose kernel launches per update (:func:`launches_kernel`;
    ``phase:sublayer`` -> count, from :func:`count_row`) differ from the baseline's, as table
    rows without the arch: (sublayer, forward, backward, baseline forward, baseline backward,
    difference), then the total."""
    def split(counts):
        out = {}
        for key, n in counts.items():
            phase, sublayer = key.split(":", 1)
            if phase in ("forward", "backward"):
                out.setdefault(sublayer, {"forward": 0, "backward": 0})[phase] += n
        return out

    ours, base = split(launches), split(baseline)
    zero = {"forward": 0, "backward": 0}
    rows, total = [], 0
    for sublayer in sorted(set(ours) | set(base)):
        a, b = ours.get(sublayer, zero), base.get(sublayer, zero)
        if a != b:
            diff = a["forward"] + a["backward"] - b["forward"] - b["backward"]
            total += diff
            rows.append((sublayer, a["forward"], a["backward"], b["forward"], b["backward"], diff))
    return rows + [("all", "", "", "", "", total)]


def bench_span(args, emit):
    """Our adaptive_span_lm vs fairseq's examples/adaptive_span at the paper-small config, in each
    precision (tokens/s over the train_inner intervals and valid bpc by fairseq-eval-lm)."""
    sizes = SPAN_PAPER_SMALL if args.size == "base" else SPAN_TINY
    emit("\n| precision | model | updates | train tokens/s | speed ratio | peak GiB | memory ratio "
         "| valid bpc | bpc diff |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for precision in args.precisions:
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, "span.json")
            cmd = [sys.executable, "-m", "scripts.bench.bench_adaptive_span_vs_fairseq",
                   "--data", args.data_lm, "--work", tmp, "--device", args.device, "--updates",
                   str(args.updates), "--segments", "2", "--json", out_json] + sizes
            if args.device == "cuda":
                # ours fused (the CUDA default) and op by op: before/after; and ours with
                # fairseq's port's attention (no renormalisation, paper eq. 3 differs): its
                # early-training bpc gap is the attention function's, not the kernel's
                cmd += ["--also-explicit", "--also-no-renorm"]
            cmd += [f"--extra={flag}" for flag in PRECISION_FLAGS[precision]]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=args.run_timeout * 4, cwd=REPO)
            if out.returncode != 0 or not os.path.exists(out_json):
                text = (out.stdout + out.stderr).strip().splitlines() or ["failed"]
                emit(f"| {precision} | adaptive_span_lm vs examples/adaptive_span | failed: "
                     f"{text[-1][:300]} |")
                continue
            with open(out_json) as f:
                rows = json.load(f)["rows"]
        for r in rows:
            bpc = next(v for k, v in r.items() if k.endswith("bpc (eval-lm)"))
            emit(f"| {precision} | {r['model']} | {r['updates']} | {r['train tokens/s']:,.0f} | "
                 f"{r['speed ratio']:.3f} | {r['peak GiB']:.2f} | {r['memory ratio']:.3f} | "
                 f"{bpc:.4f} | {r['bpc diff']:+.4f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-train"]:
        return run_train_here(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["base", "tiny", "host"], default="base",
                   help="base: the sizes people train; tiny: every model shrunk (a dry run); "
                   "host: base depth and heads at width 32 and 96-token batches (--host-time)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--groups", nargs="+", default=["mt", "lm", "span"],
                   choices=["mt", "lm", "span"])
    p.add_argument("--precisions", nargs="+", default=["fp16", "bf16"],
                   choices=list(PRECISION_FLAGS))
    p.add_argument("--archs", nargs="*", default=None, help="only these candidate archs")
    p.add_argument("--data-mt", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--data-lm", default=os.path.join(REPO, "data/wiki-gensim/bin"))
    p.add_argument("--updates", type=int, default=300, help="updates per run (default 300)")
    p.add_argument("--repeats", type=int, default=2, help="runs per arch and baseline")
    p.add_argument("--baseline", choices=["pair", "bracket"], default="pair",
                   help="pair: the baseline runs beside every arch (alternating); bracket: once "
                   "before a group's archs and once after them (the drift is reported), half the "
                   "runs -- for a short GPU loan")
    p.add_argument("--valid-steps", type=int, default=50, help="--max-valid-steps of each run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one seed per repeat in turn (the baseline's and the arch's run of a "
                   "repeat share it): with two precisions or more and two seeds or more, a last "
                   "table says whether each arch's valid loss in each precision is within the "
                   "run-to-run noise of fp16's (without fp16: the first precision's) (default: "
                   "--seed for every repeat)")
    p.add_argument("--run-timeout", type=int, default=1800, help="seconds per training run")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="switch torch's cuDNN attention backend off in every run, baseline and "
                   "archs alike (torch.backends.cuda.enable_cudnn_sdp(False)): on Hopper torch "
                   "may pick it for SDPA, and it builds a graph for every new shape")
    p.add_argument("--extra", default="", help="more fairseq-train flags for every run")
    p.add_argument("--variant", action="append", default=[], metavar="ARCH:--FLAG=VALUE[:...]",
                   help="one more candidate row: ARCH (of the groups run) with these flags, e.g. "
                   "transformer_synth_random:--synth-table-kernel=table (repeatable; not "
                   "filtered by --archs)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs of each group and precision, profile one short run "
                   "of the baseline and of each arch (torch.profiler: top ops by self device time)")
    p.add_argument("--profile-only", action="store_true",
                   help="only the profiles of --profile (no timed rows): for a second call after "
                   "the timed rows were taken")
    p.add_argument("--count-ops", action="store_true",
                   help="instead of timed rows: the aten ops (and the host syncs they would be on "
                   "CUDA) each arch and the baseline dispatch per update, counted over --profile-steps updates after "
                   "--profile-wait (runs on any device; the host's share of a GPU step)")
    p.add_argument("--host-time", action="store_true",
                   help="instead of timed rows: the host's wall time per update (median over "
                   "--profile-steps updates after --profile-wait), split into forward, backward "
                   "and optimizer + trainer, against the baseline's (run before and after the "
                   "archs): where a GPU waits for the host, the baseline's time over the arch's is "
                   "the speed ratio. On the CPU use --size host (the base models' depth and "
                   "heads at a width where the arithmetic is small) and --precisions fp32 (the "
                   "CPU's bf16 kernels are slow arithmetic); on a GPU, --size base")
    p.add_argument("--profile-wait", type=int, default=5, help="updates before profiling")
    p.add_argument("--profile-steps", type=int, default=3, help="updates profiled")
    p.add_argument("--out", default=os.path.join(REPO, "results", "paper_size.md"))
    args = p.parse_args(argv)
    args._losses = {}  # (group, arch, precision) -> {seed: valid loss} of the timed runs
    for v in args.variant:
        arch, flags = split_variant(v)
        if arch not in MT_ARCHS + LM_ARCHS or not flags or not all(
                f.startswith("--") for f in flags):
            p.error(f"--variant {v!r}: give ARCH:--flag=value[:...] with ARCH one of "
                    f"{', '.join(MT_ARCHS + LM_ARCHS)}")
    args.data_mt, args.data_lm = os.path.abspath(args.data_mt), os.path.abspath(args.data_lm)
    for group, data in (("mt", args.data_mt), ("lm", args.data_lm), ("span", args.data_lm)):
        if group in args.groups and not os.path.isdir(data):
            p.error(f"--data-{'mt' if group == 'mt' else 'lm'} {data} does not exist: run "
                    "`make data` (or pass the binarised data directory)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        def emit(line):
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        def emit_head(columns):
            emit("\n| " + " | ".join(columns) + " |")
            emit("|" + "---|" * len(columns))

        emit(f"\n`{' '.join(shlex.quote(a) for a in ['python', '-m', MODULE] + argv)}`")
        timed = not (args.profile_only or args.count_ops or args.host_time)  # timed rows
        if timed:  # their table
            emit_head(COLUMNS)
        for precision in args.precisions:
            args._precision = precision
            for group, archs, data in (("mt", MT_ARCHS, args.data_mt),
                                       ("lm", LM_ARCHS, args.data_lm)):
                if group not in args.groups:
                    continue
                chosen = [a for a in archs if args.archs is None or a in args.archs]
                chosen += [v for v in args.variant if split_variant(v)[0] in archs]
                if args.profile_only:
                    for arch in [BASELINE[group]] + chosen:
                        profile_run(group, arch, data, args, emit)
                    continue
                if args.count_ops:
                    emit_head(COUNT_COLUMNS)
                    launches = {}
                    for arch in [BASELINE[group]] + chosen:
                        row, launches[arch] = count_row(group, arch, data, args)
                        emit(row)
                    emit(f"\nKernel launches per update by sublayer (ops that launch one on "
                         f"CUDA: not views, not bare allocations), all layers together, where "
                         f"an arch differs from `{BASELINE[group]}` ({group}, {precision}):")
                    emit_head(SUBLAYER_COLUMNS)
                    for arch in chosen:
                        if launches[arch] and launches[BASELINE[group]]:
                            for row in sublayer_rows(launches[arch], launches[BASELINE[group]]):
                                emit(f"| {arch} | " + " | ".join(
                                    f"{v:+,.0f}" if i == 5 else
                                    f"{v:,.0f}" if isinstance(v, float) else str(v)
                                    for i, v in enumerate(row)) + " |")
                    continue
                if args.host_time:
                    emit_head(HOST_COLUMNS)
                    first = host_time(group, BASELINE[group], data, args)
                    emit(host_time_row(group, precision, BASELINE[group], first, first))
                    for arch in chosen:
                        ms = host_time(group, arch, data, args)
                        emit(host_time_row(group, precision, arch, ms, first))
                    last = host_time(group, BASELINE[group], data, args)
                    if "error" not in first and "error" not in last:
                        a, b = first["update"], last["update"]
                        emit(f"\n({group}, {BASELINE[group]}: {a:.2f} ms an update before the "
                             f"rows above, {b:.2f} after them: drift {100 * (b - a) / a:+.1f} %)")
                    continue
                base = None
                if args.baseline == "bracket":
                    base = [one_run(group, BASELINE[group], data, args,
                                    seed=repeat_seed(args, 0))]
                    if "error" in base[0]:  # every row would fail the same way: say it once
                        emit(f"| {group} | {precision} | {BASELINE[group]} (baseline) | failed: "
                             f"{base[0]['error']} |")
                        continue
                for arch in chosen:
                    emit(format_row(bench_pair(group, arch, data, args, base)))
                if base is not None:
                    # (with --seeds: the next seed, so that the baseline's loss has a noise)
                    last = one_run(group, BASELINE[group], data, args, seed=repeat_seed(args, 1))
                    note_losses(args, group, BASELINE[group], [last])
                    emit(bracket_note(group, base, last))
                if args.profile:
                    for arch in [BASELINE[group]] + chosen:
                        profile_run(group, arch, data, args, emit)
                    emit_head(COLUMNS)  # the next rows' header
        if "span" in args.groups and timed:
            bench_span(args, emit)
        reference = reference_precision(args.precisions)
        rows = agreement_rows(args._losses, reference)
        if rows:
            emit(f"\nValid loss after {args.updates} updates against {reference}'s, by seed "
                 "(noise: the larger spread over the seeds of the two precisions):")
            emit_head(AGREEMENT_COLUMNS)
            for row in rows:
                emit("| " + " | ".join(f"{row[c]:+.3f}" if c == "difference" else
                                       f"{row[c]:.3f}" if isinstance(row[c], float) else
                                       str(row[c]) for c in AGREEMENT_COLUMNS) + " |")


if __name__ == "__main__":
    main()

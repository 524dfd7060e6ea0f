"""Benchmark harness shared by every method (``make bench``; not a test).

A *sublayer case* times forward+backward of one module against a baseline module of the same
shapes, in the same process, alternating candidate and baseline over several repeats, and reports
medians and the ratio. Cases are registered from ``scripts/bench/cases/<method>.py``::

    from scripts.bench.benchlib import SublayerCase, register_case

    register_case(SublayerCase(
        group="ffn", name="aop1 vs ffn", note="tokens 4096, d 512",
        candidate=lambda: (AOPModule(...), (x,)),   # -> (module, inputs)
        baseline=lambda: (FFN(...), (x,)),
    ))

The module is called as ``module(*inputs)``; the output (or its first element) is summed and
back-propagated. Extra columns (e.g. peak memory) can be given by ``extra=lambda: {...}``.
"""

import gc
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

CASES: List["SublayerCase"] = []


@dataclass
class SublayerCase:
    group: str
    name: str
    candidate: Callable[[], Tuple[torch.nn.Module, tuple]]
    baseline: Callable[[], Tuple[torch.nn.Module, tuple]]
    note: str = ""
    target: Optional[float] = None  # goal ratio (candidate / baseline), shown in the table
    forward_only: bool = False
    extra: Optional[Callable[[], Dict[str, Any]]] = None


def register_case(case: SublayerCase) -> SublayerCase:
    CASES.append(case)
    return case


def _step(module, inputs, forward_only):
    out = module(*inputs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if forward_only:
        return
    out.float().sum().backward()


def timer(fn: Callable[[], Any], device) -> Callable[[], float]:
    """A call of ``fn`` that returns its wall time in seconds (on CUDA: to the end of the work it
    queued)."""
    def run():
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return run


def module_timer(module, inputs, forward_only, device, autocast=None) -> Callable[[], float]:
    """:func:`timer` of one forward (no grad), or forward + backward of ``module(*inputs)``
    (``autocast``: a dtype, the forward under ``torch.autocast`` to it)."""
    def call():
        if autocast is not None:
            with torch.autocast(device.type, dtype=autocast):
                return plain()
        return plain()

    def plain():
        if forward_only:
            with torch.no_grad():
                _step(module, inputs, True)
        else:
            module.zero_grad(set_to_none=True)
            _step(module, inputs, False)

    return timer(call, device)


def time_pair(candidate, baseline, repeats: int = 10, warmup: int = 2) -> Tuple[float, float]:
    """Alternate candidate/baseline timings; return their medians in milliseconds."""
    for _ in range(warmup):
        candidate()
        baseline()
    c, b = [], []
    for i in range(repeats):
        # alternate the order too, so drift (thermal, other load) hits both equally
        if i % 2 == 0:
            c.append(candidate()); b.append(baseline())
        else:
            b.append(baseline()); c.append(candidate())
    return 1000 * statistics.median(c), 1000 * statistics.median(b)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_memory_mb(fn: Callable[[], Any], device) -> float:
    """Peak memory added by one call of ``fn``.

    CUDA: the allocator's peak. CPU (Linux): reset the resident high-water mark (VmHWM) through
    /proc/self/clear_refs, run, read it back; tensors this large are mmapped and returned to the OS
    when freed, so this is the allocator's true peak. (The profiler's memory events attribute a
    backward node's frees to its start time, which hides peaks.)"""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() / 2**20
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - base) / 1024


def run_case(case: SublayerCase, device, repeats: int, dtype=torch.float32) -> Dict[str, Any]:
    cm, cin = case.candidate()
    bm, bin_ = case.baseline()
    move = lambda m, xs: (m.to(device=device), tuple(
        x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
        if torch.is_tensor(x) else x for x in xs))
    cm, cin = move(cm, cin)
    bm, bin_ = move(bm, bin_)
    if dtype != torch.float32:
        cm, bm = cm.to(dtype), bm.to(dtype)
    ct, bt = time_pair(module_timer(cm, cin, case.forward_only, device),
                       module_timer(bm, bin_, case.forward_only, device), repeats=repeats)
    row = {"group": case.group, "case": case.name, "note": case.note,
           "candidate ms": ct, "baseline ms": bt, "ratio": ct / bt,
           "target": f"<= {case.target:.2f}" if case.target else ""}
    if case.extra is not None:
        row.update(case.extra())
    del cm, bm, cin, bin_
    gc.collect()
    return row


def checkout_plugin(checkout: str, flag: str) -> str:
    """``fairseq_attnzoo/`` of another checkout of this repository, for before/after runs of the
    same benchmark (``flag``: the option that named it, for the error)."""
    path = os.path.join(os.path.abspath(checkout), "fairseq_attnzoo")
    if not os.path.isdir(path):
        raise SystemExit(f"{flag} {checkout}: no fairseq_attnzoo/ folder there; give a checkout "
                         "of this repository (e.g. git worktree add DIR COMMIT)")
    return path


def with_user_dir(cmd: List[str], user_dir: str) -> List[str]:
    """A copy of the fairseq command line ``cmd`` with the value of its ``--user-dir``
    replaced."""
    i = cmd.index("--user-dir") + 1
    return cmd[:i] + [user_dir] + cmd[i + 1:]


#: a training child's last line on CUDA: ``PEAK_TAG <torch.cuda.max_memory_allocated()>``
PEAK_TAG = "ATTNZOO_PEAK_CUDA_BYTES"


def peak_cuda_gib(text: str) -> float:
    """The largest peak CUDA memory (GiB) the ``PEAK_TAG`` lines of a run's output report (a
    run in several segments prints one each), NaN when there is none (the CPU)."""
    peaks = [int(line.split()[1]) for line in text.splitlines() if line.startswith(PEAK_TAG)]
    return max(peaks) / 2**30 if peaks else float("nan")


def json_log_lines(text: str, tag: str) -> List[Dict[str, Any]]:
    """The JSON records of fairseq's ``--log-format json`` lines tagged ``tag`` (``train_inner``,
    ``valid``, ...) in a run's output, whichever logging format printed them: fairseq's CLI
    (``... | INFO | train_inner | {...}``), a root logger left unconfigured
    (``INFO:train_inner:{...}``) or the progress bar's ``[train_inner]``."""
    out = []
    for line in text.splitlines():
        if f"| {tag} | " in line or f"[{tag}]" in line or f"INFO:{tag}:" in line:
            i = line.find("{")
            if i >= 0:
                try:
                    out.append(json.loads(line[i:]))
                except json.JSONDecodeError:
                    pass
    return out


def format_table(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"

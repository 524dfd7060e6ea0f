"""The benchmark harness: one way to declare a row (scripts/bench/cases.py, of the kinds in
scripts/bench/rows.py), four levels: ``Kernel`` (a module against its baseline or a peer at named
shapes), ``Train`` (``fairseq-train`` of an arch against its stock baseline, timed on warm shapes),
``Decode`` (``fairseq-generate`` / ``fairseq-eval-lm`` of their checkpoints) and ``Quality`` (valid
loss at equal updates and seeds). Each row is a JSON line of ``--records`` (docs/benchmarks.jsonl),
rendered by ``python -m scripts.bench.tables`` in docs/performance.md (what each measures, why)."""

import argparse
import datetime
import fnmatch
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from scripts.bench.rows import REPO, USER_DIR, Decode, Kernel, Quality, Side, Train, sized


def _cases():  # the parent's alone: a child that imported the plugin before --user-dir
    from scripts.bench import cases  # would skip the compat table (test_bench_harness)
    return cases

RECORDS = os.path.join(REPO, "docs", "benchmarks.jsonl")
PEAKS_TAG = "ATTNZOO_BENCH_PEAKS"  # the training child's last line: per-update CUDA peaks
PROFILE_TAG = "ATTNZOO_BENCH_PROFILE"
SENTENCES_TAG = "ATTNZOO_BENCH_SENTENCES"  # and the sentences trained in each epoch
DECODE_TAG = "ATTNZOO_BENCH_DECODE"  # a decode child's warm pass
PLUGIN_TAG = "ATTNZOO_BENCH_PLUGIN"  # "off": the training child runs stock fairseq
MAX_DRIFT = 5.0  # % between a baseline's first and last run: more, and the row is "noisy"
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"], "amp": ["--amp"]}


# ---- records -------------------------------------------------------------------------------

#: environment variables that select kernels or devices: recorded, and a table never lets a run
#: under them replace the default row (scripts/bench/tables.py)
KERNEL_ENV = ("TORCH_", "ATTNZOO_", "CUDA_VISIBLE_DEVICES", "CUBLAS_", "CUDNN_", "NVIDIA_TF32",
              "TRITON_")


def kernel_env(env=os.environ) -> Dict[str, str]:
    """``env``'s kernel-selecting variables (not our tags; ``TORCH_CUDA_ARCH_LIST`` only builds)."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(KERNEL_ENV) and k not in (
        PEAKS_TAG, PROFILE_TAG, PLUGIN_TAG, SENTENCES_TAG, DECODE_TAG, "TORCH_CUDA_ARCH_LIST")}


def environment(device, gpus=1) -> Dict[str, Any]:
    import torch

    def git(*args):
        out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
        return out.stdout.strip()

    cuda = device.type == "cuda"
    name = (torch.cuda.get_device_name(device) if cuda
            else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    # (BENCH_COMMIT: the commit of a copied tree whose .git is absent or stale, e.g. on a lent GPU)
    commit = os.environ.get("BENCH_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if not os.environ.get("BENCH_COMMIT") and git("status", "--porcelain",
                                                   "--untracked-files=no"):
        commit += "+uncommitted"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "gpus": gpus if cuda else None,
            "visible gpus": torch.cuda.device_count() if cuda else None,
            "commit": commit, "kernel env": kernel_env()}


class Recorder:
    """Appends a JSON line per row to ``path`` as the row finishes (a run cut off keeps them)."""

    def __init__(self, path, env, argv, size, dtype):
        self.path, self.run = path, datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
        command = "python -m scripts.bench " + shlex.join(  # (where it wrote: not how to rerun)
            [x for i, x in enumerate(argv) if not x.startswith("--records")
             and (i == 0 or argv[i - 1] != "--records")])
        self.head = {**env, "run": self.run, "size": size, "dtype": dtype, "command": command}

    def __call__(self, case, row: Dict[str, Any], dtype=None):  # (a kernel shape's own dtype)
        record = {"case": f"{case.family}/{case.name}", "level": case.level, **self.head,
                  **({"dtype": dtype} if dtype else {}), "row": row}
        print(json.dumps(row), flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ---- kernel level --------------------------------------------------------------------------

def timed(call, device, n: int = 1) -> float:
    """Milliseconds of one ``call()``, the mean of ``n`` back to back (on CUDA: CUDA events around
    them, so the host's launch time overlaps the device's work as in training)."""
    import torch

    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return 1000 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def warm_shared(device):
    """Set up what any call needs once (allocator, BLAS, autograd) before either cold call."""
    import torch

    x = torch.ones(64, 64, device=device, requires_grad=True)
    (torch.nn.functional.linear(x, x).softmax(-1) @ x).sum().backward()


def peak_mib(call, device):
    """Peak CUDA memory (MiB) one call adds to what was allocated before it; None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def shape_text(p: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items())


def run_kernel(case: Kernel, p: dict, device, dtype, repeats, roofline,
               index: int = 0) -> Dict[str, Any]:
    """One shape: each side's first call (cold; which side goes first alternates with ``index``),
    then ``repeats`` samples of each, alternating, each sample a batch of calls long enough
    (>= 10 ms) for the clock."""
    row = {"shape": shape_text(p)}
    try:
        warm_shared(device)
        cand = case.candidate(p, device, dtype)
        calls = {"": cand}
        if case.baseline:
            calls["baseline "] = case.baseline(p, device, dtype)
        order = list(calls) if index % 2 == 0 else list(calls)[::-1]
        cold = {k: timed(calls[k], device) for k in order}
        batch = {k: max(1, int(10 / max(timed(c, device), 1e-3))) for k, c in calls.items()}
        warm = {k: [] for k in calls}
        for i in range(repeats):  # alternating, and the order too: drift hits both alike
            for k in (order if i % 2 == 0 else order[::-1]):
                warm[k].append(timed(calls[k], device, batch[k]))
    except ImportError as e:  # an optional peer
        return {**row, "skipped": f"not installed: {e.name}"}
    except RuntimeError as e:  # a kernel or backend this device or case does not have
        return {**row, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    for k in calls:
        row[f"{k}cold ms"] = cold[k]
        row[f"{k}ms"] = statistics.median(warm[k])
        row[f"{k}peak MiB"] = peak_mib(calls[k], device)
    if case.baseline:
        row["ratio"] = row["ms"] / row["baseline ms"]
    if case.work:
        kind, amount = case.work(p, dtype)
        rate = amount / row["ms"] / 1e6  # GB/s or GFLOP/s
        row["GB/s" if kind == "bytes" else "GFLOP/s"] = rate
        if roofline.get(kind):
            row["% roofline"] = 100 * rate / roofline[kind]
    return row


# ---- train and quality levels: fairseq-train children ---------------------------------------

def train_child(argv):
    """``fairseq-train argv`` in this process (``--_train``; ``child_setup`` first). Printed last:
    the CUDA peak of every update, read just before fairseq resets it (``PEAKS_TAG``), the
    sentences of each epoch; ``PROFILE_TAG`` "N:epoch" or "N:interval": N warm updates profiled."""
    import torch

    child_setup()
    from fairseq_cli import train

    peaks, reset = [], torch.cuda.reset_peak_memory_stats

    def read_then_reset(*a, **k):
        peaks.append(torch.cuda.max_memory_allocated())
        reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = read_then_reset
    sentences = count_sentences()
    n, warm = (os.environ.get(PROFILE_TAG) or "0:").split(":")
    finish = profile_updates(int(n), warm) if int(n) else (lambda: None)
    sys.argv = ["fairseq-train"] + argv
    try:
        train.cli_main()
        finish()
    finally:
        print(SENTENCES_TAG, json.dumps(sentences), flush=True)
        if torch.cuda.is_available():
            print(PEAKS_TAG, json.dumps(peaks or [torch.cuda.max_memory_allocated()]),
                  flush=True)


def child_setup():
    """Every child first: torch's loader told about argparse, and the plugin loaded as
    ``--user-dir`` loads it (fairseq's ``import_user_module``, which applies the compat table),
    before fairseq parses its arguments; ``PLUGIN_TAG`` "off": never imported."""
    import argparse as ap

    import torch

    torch.serialization.add_safe_globals([ap.Namespace])
    if os.environ.get(PLUGIN_TAG) != "off":
        from fairseq import utils

        utils.import_user_module(ap.Namespace(user_dir=USER_DIR))


def decode_child(tool: str, argv):
    """``fairseq-{tool} argv`` twice in this process (``--_decode``): the second (warm) pass timed
    by fairseq's own timer, its CUDA peak read; printed last (``DECODE_TAG``)."""
    import torch

    child_setup()
    from fairseq_cli import eval_lm, generate

    module = generate if tool == "generate" else eval_lm
    timers = []

    class Timer(module.StopwatchMeter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            timers.append(self)

    module.StopwatchMeter = Timer
    cuda = torch.cuda.is_available() and "--cpu" not in argv
    for warm in (False, True):
        if warm and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        sys.argv = [f"fairseq-{tool}"] + argv
        module.cli_main()
    print(DECODE_TAG, json.dumps({"tokens": timers[-1].n, "seconds": timers[-1].sum,
                                  "peak MiB": torch.cuda.max_memory_allocated() / 2**20
                                  if cuda else None}), flush=True)


def count_sentences() -> List[int]:
    """The sentences each epoch trains (as the trainer is handed them), filled in as it goes."""
    from fairseq.trainer import Trainer

    step, begin, counts = Trainer.train_step, Trainer.begin_epoch, []

    def begin_epoch(self, epoch):
        counts.append(0)
        return begin(self, epoch)

    def train_step(self, samples, raise_oom=False):
        counts[-1] += sum(int(s.get("nsentences", 0)) for s in samples if s)
        return step(self, samples, raise_oom)

    Trainer.train_step, Trainer.begin_epoch = train_step, begin_epoch
    return counts


def profile_updates(n: int, warm: str):
    """Profile ``n`` warm updates (from epoch 2's third, or after the first ``n``): the GPU's busy
    share of the wall time (well under 100 %: it waits for the host), the top ops by self device
    time (CPU: self CPU time) and, on CUDA, by the host's self time. Returns the check to call
    after training: a window it did not fill is an error (unstopped, the profiler crashed it)."""
    import torch
    from fairseq.trainer import Trainer

    step, begin, cuda = Trainer.train_step, Trainer.begin_epoch, torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state = {"calls": 0, "start": None if warm == "epoch" else n + 1, "t0": 0.0}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []))

    def begin_epoch(self, epoch):
        if epoch == 2 and state["start"] is None:
            state["start"] = state["calls"] + 3
        return begin(self, epoch)

    def train_step(self, samples, raise_oom=False):
        state["calls"] += 1
        if state["calls"] == state["start"]:
            sync()
            prof.start()
            state["t0"] = time.perf_counter()
        out = step(self, samples, raise_oom)
        if state["start"] and state["calls"] == state["start"] + n - 1:
            sync()
            wall, state["t0"] = time.perf_counter() - state["t0"], None  # (None: stopped)
            prof.stop()
            ops = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)
                   and not e.key.startswith("ProfilerStep")
                   and (not cuda or str(getattr(e, "device_type", "CPU")).endswith("CPU"))]

            def top(key):  # [op, calls, ms, % of the ops' total] per update, and the total
                total = sum(getattr(e, key, 0.0) for e in ops) or 1.0
                return total, [[e.key[:60], e.count / n, getattr(e, key, 0.0) / n / 1e3,
                                100 * getattr(e, key, 0.0) / total]
                               for e in sorted(ops, key=lambda e: -getattr(e, key, 0.0))[:10]]
            busy, device = top("self_device_time_total" if cuda else "self_cpu_time_total")
            print(PROFILE_TAG, json.dumps({
                "updates": n, "wall ms per update": 1e3 * wall / n,
                "busy %": 100 * busy / 1e6 / wall if cuda else None, "top": device,
                "host top": top("self_cpu_time_total")[1] if cuda else None}), flush=True)
        return out

    def finish():  # (t0: 0.0 before the window, a time in it, None after)
        if state["t0"] is not None:
            if state["t0"]:  # in the window: stop the profiler (running, it crashed the exit)
                prof.stop()
            raise SystemExit(f"--profile {n}: training ended before {n} warm updates were "
                             "profiled; lower --profile, or raise --epochs / --updates")

    Trainer.train_step, Trainer.begin_epoch = train_step, begin_epoch
    return finish


def fairseq_log(text: str, tag: str) -> List[dict]:
    """fairseq's ``--log-format json`` records tagged ``tag`` in a run's output."""
    out = []
    for line in text.splitlines():
        if f"| {tag} | " in line or f"INFO:{tag}:" in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                pass
    return out


def tagged(text, tag):
    lines = [line for line in text.splitlines() if line.startswith(tag + " ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def child(kind: str, argv: List[str], a, env=None) -> str:
    """A child (``--_train``, ``--_decode TOOL``): its output, or SystemExit with its tail."""
    cmd = [sys.executable, "-m", "scripts.bench.harness", kind, *argv] + (
        ["--cpu"] if a.device == "cpu" else
        ["--distributed-world-size", str(getattr(a, "gpus", 1))] if kind == "--_train" else [])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
                             [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{kind[3:]} failed ({out.returncode}): {shlex.join(cmd)}\n"
                         f"{text[-4000:]}")
    return text


def fairseq_train(flags: List[str], data: str, a, seed: int, stop: List[str], env=None,
                  save_dir=None) -> str:
    """One child ``fairseq-train`` (``save_dir``: its checkpoints there, else none)."""
    with tempfile.TemporaryDirectory() as tmp:
        save = (["--save-dir", save_dir, "--no-epoch-checkpoints"] if save_dir
                else ["--save-dir", tmp, "--no-save"])
        return child("--_train", [data, *flags, "--seed", str(seed), *save, "--log-format",
                                  "json", "--num-workers", "0", *stop], a, env)


def only(labelled: dict, a) -> dict:
    """The entries whose label has one of ``--only``'s strings (all without it; "" always)."""
    words = getattr(a, "only", None)
    return {k: v for k, v in labelled.items() if not (words and k) or any(w in k for w in words)}


def timed_run(side: Side, common: List[str], data, a, warm, seed,
              profile: int = 0) -> Dict[str, Any]:
    """One training run of ``side`` timed on warm shapes (module docstring): tokens/s (median of
    the log intervals; per GPU: divided by ``a.gpus``), the first pass (tokens/s, and its seconds
    beyond the warm rate), peak GiB; ``profile`` > 0: that many warm updates profiled."""
    stop = (["--max-epoch", str(1 + a.epochs), "--max-update", "100000000"] if warm == "epoch"
            else ["--max-update", str(a.updates)])
    env = dict(side.env)
    if profile:
        env[PROFILE_TAG] = f"{profile}:{warm}"
    if not side.plugin:
        env[PLUGIN_TAG] = "off"
    flags = common + shlex.split(sized(side.flags, a.size))
    if not side.plugin and (side.precision or a.precision) == "bf16":
        raise SystemExit("a plugin-off side cannot train in bf16: stock fairseq's --bf16 turns "
                         "on --tpu; give that side fp16 or fp32 (--precision)")
    text = fairseq_train(flags + ["--disable-validation", "--log-interval", str(a.log_interval)]
                         + PRECISIONS[side.precision or a.precision] + stop, data, a, seed, [], env)
    logs, done = fairseq_log(text, "train_inner"), 0
    for r in logs:  # updates and seconds of each interval
        r["n"], done = int(r["num_updates"]) - done, int(r["num_updates"])
        r["s"] = r["n"] * float(r["wpb"]) / max(float(r["wps"]), 1e-9)
    logs = [r for r in logs if float(r["wps"]) > 0]  # (fairseq gives its first update no rate)
    if warm == "epoch":
        cold = [r for r in logs if int(r["epoch"]) == 1]
        hot = [r for r in logs if int(r["epoch"]) > 1][1:]  # (the first holds epoch 1's tail)
    else:
        cold, hot = logs[:1], logs[1:]
    if not cold or not hot:
        raise SystemExit(f"{len(logs)} log intervals: too few to time warm shapes (raise "
                         "--epochs or --updates, or lower --log-interval)")
    warm_s = sum(r["s"] for r in hot) / sum(r["n"] for r in hot)
    first_warm = int(hot[0]["num_updates"]) - hot[0]["n"]
    peaks = tagged(text, PEAKS_TAG)
    gpus = getattr(a, "gpus", 1) if a.device != "cpu" else 1
    total = statistics.median(float(r["wps"]) for r in hot)
    return {"tokens/s": total / gpus, "total tokens/s": total,
            "warm updates": sum(r["n"] for r in hot),
            "sentences": (tagged(text, SENTENCES_TAG) or [None])[0],
            "first pass tokens/s": sum(r["n"] * float(r["wpb"]) for r in cold)
            / sum(r["s"] for r in cold) / gpus,
            "first pass extra s": sum(r["s"] for r in cold) - warm_s * sum(r["n"] for r in cold),
            # (one GPU: the child reads every update's peak; spawned workers cannot: n/a)
            "peak GiB": max(peaks[first_warm:] or peaks) / 2**30 if peaks and gpus == 1
            else None,
            "profile": tagged(text, PROFILE_TAG)}


def floor_of(case, a, device_name, precision):
    """(tokens/s, source) of the baseline's sanity floor on this device class, or None."""
    half = "fp32" if precision == "fp32" else "half"
    for cls, prec, tokens, source in _cases().FLOORS.get(case.floor, ()):
        if cls in device_name and prec == half and a.size == "paper":
            return tokens, source
    return None


def compare(cand: List[dict], base: List[dict], keys, peak: str) -> Dict[str, Any]:
    """A row: the medians of ``keys`` over the candidate's and the baseline's runs, the ratios, the
    baseline's drift between its first and last run (None after one) and whether it is noisy."""
    row: Dict[str, Any] = {}
    for runs, prefix in ((cand, ""), (base, "baseline ")):
        for key in keys:
            vals = [r[key] for r in runs if r.get(key) is not None]
            row[prefix + key] = statistics.median(vals) if vals else None
    row["speed ratio"] = row["tokens/s"] / row["baseline tokens/s"]
    row["memory ratio"] = (row[peak] / row["baseline " + peak]
                           if row[peak] and row["baseline " + peak] else None)
    b = [r["tokens/s"] for r in base]
    row["baseline drift %"] = 100 * (b[-1] - b[0]) / b[0] if len(b) > 1 else None
    row["noisy"] = bool(len(b) > 1 and abs(row["baseline drift %"]) > MAX_DRIFT)
    return row


def run_train(case: Train, a, device_name, record):
    """Baseline and candidates alternating (and their order), a record per candidate; a baseline
    below its floor gets one more run, ``--profile-below-floor`` warm updates profiled."""
    common = shlex.split(sized(case.common, a.size))
    base, cands = case.baseline, only(case.candidate, a)
    sides = {"baseline": base, **{f"candidate {k}": v for k, v in cands.items()}}
    data = a.data_mt if case.data == "mt" else a.data_lm
    runs: Dict[str, List[dict]] = {who: [] for who in sides}
    floor = floor_of(case, a, device_name, base.precision or a.precision)
    below = None  # the profile of a baseline below its floor
    for i in range(a.repeats):
        for who in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            runs[who].append(timed_run(sides[who], common, data, a, case.warm, a.seed,
                                       profile=a.profile))
            if who == "baseline" and i == 0:
                b = runs["baseline"][0]["tokens/s"]
                print(f"baseline: {b:,.0f} tokens/s warm; floor on this device: " + (
                    f"{floor[0]:,} ({floor[1]})" + (" BELOW: suspect" if b < floor[0] else "")
                    if floor else "none known"), flush=True)
                if floor and b < floor[0] and not a.profile and a.profile_below_floor:
                    below = timed_run(base, common, data, a, case.warm, a.seed,
                                      profile=a.profile_below_floor)["profile"]

    for label, side in cands.items():
        who = f"candidate {label}"
        row = {"run": label} if label else {}
        row["precision"] = side.precision or a.precision
        if (base.precision or a.precision) != row["precision"]:
            row["baseline precision"] = base.precision or a.precision
        several = a.gpus > 1 and a.device != "cpu"  # (then the total over the GPUs too)
        keys = ("tokens/s", "first pass tokens/s", "first pass extra s", "peak GiB", "sentences")
        row.update(compare(runs[who], runs["baseline"],
                           keys + ("total tokens/s",) * several, "peak GiB"))
        if several:
            row["gpus"] = a.gpus
        row["warm updates"], row["repeats"] = runs[who][0]["warm updates"], a.repeats
        row["plugin"] = "on" if side.plugin else "off"
        if side.env:
            row["env"] = dict(side.env)
        row["floor"] = (f"{floor[0]:,} ({floor[1]})" if floor
                        else "no floor known" if case.floor else None)
        row["suspect"] = bool(floor and row["baseline tokens/s"] < floor[0])
        profiles = {"baseline": runs["baseline"][0]["profile"] or below,
                    label or "candidate": runs[who][0]["profile"]}
        if any(profiles.values()):
            row["profile"] = {k: v for k, v in profiles.items() if v}
        record(case, row)


def run_decode(case: Decode, a, record):
    data = a.data_mt if case.data == "mt" else a.data_lm
    tool = "generate" if case.data == "mt" else "eval_lm"
    common = shlex.split(sized(case.common, a.size))
    updates = case.updates.get(a.size, case.updates["paper"])
    # (fairseq-generate and eval-lm have --fp16 but ignore --bf16: fp16 on CUDA, else fp32)
    precision = "fp16" if a.device != "cpu" and a.precision != "fp32" else "fp32"
    if precision != a.precision:
        print(f"decode: fairseq-{tool.replace('_', '-')} has no {a.precision} path; decoding in "
              f"{precision}", flush=True)
    sides, labels = {"baseline": case.baseline, **only(case.candidate, a)}, only(case.runs, a)
    runs = {(who, label): [] for who in sides for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for who, flags in sides.items():
            fairseq_train(common + shlex.split(sized(flags, a.size)) + PRECISIONS[a.precision],
                          data, a, a.seed, ["--max-update", str(updates), "--disable-validation",
                                            "--max-epoch", "1000000"], save_dir=f"{tmp}/{who}")
        for i in range(a.repeats):  # alternating: baseline, candidates, candidates, baseline
            for who in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                for label, flags in labels.items():
                    text = child("--_decode", [
                        tool, data, "--path", f"{tmp}/{who}/checkpoint_last.pt", "--gen-subset",
                        "test", "--quiet", "--num-workers", "0",
                        *shlex.split(sized(flags, a.size)), *PRECISIONS[precision]], a)
                    done = tagged(text, DECODE_TAG)
                    sent = re.findall(r"Translated ([\d,]+) s", text)
                    runs[who, label].append({
                        "tokens/s": done["tokens"] / done["seconds"], "peak MiB": done["peak MiB"],
                        "sentences/s": int(sent[-1].replace(",", "")) / done["seconds"]
                        if sent else None})

    for who in list(sides)[1:]:
        for label in labels:
            row = {"run": f"{who}, {label}", "precision": precision, "updates": updates}
            row.update(compare(runs[who, label], runs["baseline", label],
                               ("tokens/s", "sentences/s", "peak MiB"), "peak MiB"))
            row["repeats"] = a.repeats
            record(case, row)


def run_quality(case: Quality, a, record):
    runs = only(case.runs() if callable(case.runs) else case.runs, a)
    data = a.data_mt if case.data == "mt" else a.data_lm
    updates = case.updates.get(a.size, case.updates["paper"])
    common = shlex.split(sized(case.common, a.size))
    for i, seed in enumerate(a.seeds):
        for label in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            if case.cuda_only and case.cuda_only in label and a.device == "cpu":  # (a dry run)
                record(case, {"run": label, "seed": seed, "skipped": "needs CUDA"})
                continue
            flags = common + shlex.split(sized(runs[label], a.size)) + PRECISIONS[a.precision]
            t0 = time.time()
            text = fairseq_train(flags, data, a, seed, [
                "--max-update", str(updates), "--validate-interval", "100000000",
                "--log-interval", str(max(1, updates // 10))])
            valid = fairseq_log(text, "valid")[-1]
            inner = fairseq_log(text, "train_inner")

            def count(what):
                line = [ln for ln in text.splitlines() if f"num. {what} model params" in ln]
                return int(line[-1].split(": ")[1].split()[0].replace(",", "")) if line else None
            record(case, {
                "run": label, "precision": a.precision, "seed": seed, "updates": updates,
                "valid loss": float(valid["valid_loss"]),
                "valid bleu": float(valid["valid_bleu"]) if "valid_bleu" in valid else None,
                "first loss": float(inner[0]["loss"]) if inner else None,
                "overflows": text.count("gradient overflow detected"),
                "params": (count("shared") or 0) + (count("expert") or 0),
                "sparse value params": count("expert"),
                "usage": {k[6:]: float(v) for k, v in valid.items() if k.endswith("_usage")},
                "tokens/s": statistics.median(float(r["wps"]) for r in inner) if inner else None,
                "wall s": time.time() - t0})


# ---- the command line ------------------------------------------------------------------------

def processes(c, a) -> int:
    """The fairseq processes case ``c`` starts (kernel cases: none), for a visit's time budget."""
    sides = 1 + len(only(c.candidate, a)) if isinstance(c, (Train, Decode)) else 0
    if isinstance(c, Train):
        return (a.repeats or 2) * sides
    if isinstance(c, Decode):
        return sides + (a.repeats or 2) * sides * len(only(c.runs, a))
    if isinstance(c, Quality):
        return len(a.seeds) * len(only(c.runs() if callable(c.runs) else c.runs, a))
    return 0


def select(patterns: List[str]):
    def hit(c, p):
        return fnmatch.fnmatch(f"{c.family}/{c.name}", p) or p == c.family
    chosen = [c for c in _cases().CASES if any(hit(c, p) for p in patterns)]
    unknown = [p for p in patterns if not any(hit(c, p) for c in _cases().CASES)]
    if unknown:
        raise SystemExit(f"no case matches {', '.join(unknown)}: `python -m scripts.bench --list` "
                         "names them")
    return chosen


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_train"]:
        return train_child(argv[1:])
    if argv[:1] == ["--_decode"]:
        return decode_child(argv[1], argv[2:])
    p = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.split(
        "\n\n")[0], epilog="docs/performance.md: what each case measures, and the commands.")
    p.add_argument("cases", nargs="*", help="case names, families or patterns (aop, 'mt/*', "
                   "pkm/memory-lm): --list names them")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--count", action="store_true", help="print the fairseq processes each case "
                   "would start (with these flags) and exit")
    p.add_argument("--arch", help="time your own arch against the stock baseline of its task "
                   "(with --flags for it)")
    p.add_argument("--flags", default="", help="more fairseq-train flags for --arch's runs")
    p.add_argument("--size", choices=["paper", "tiny"], default="paper",
                   help="paper: the sizes people train; tiny: every case shrunk (a dry run)")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="kernel cases' dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16", help="train and "
                   "quality runs (default bf16, on the CPU too; a case's side may name its own)")
    p.add_argument("--gpus", type=int, default=1, help="train and quality: GPUs per run "
                   "(fairseq's --distributed-world-size; tokens/s is reported per GPU)")
    p.add_argument("--profile-below-floor", type=int, default=20, metavar="N", help="train: a "
                   "baseline below its floor gets one more run, N warm updates profiled (0: none)")
    p.add_argument("--repeats", type=int, default=None,
                   help="kernel: timed calls (default 20); train: alternating pairs (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="train: timed epochs after the first")
    p.add_argument("--updates", type=int, default=300,
                   help="train cases of one shape: updates per run (the first interval is cold)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="quality: one run per seed")
    p.add_argument("--seed", type=int, default=1, help="train: the seed of every run")
    p.add_argument("--only", nargs="+", help="only the candidates, runs and kernel shapes whose "
                   "label contains one of these strings")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="train: profile N warm updates of every run's first repeat (busy share, "
                   "top ops; in the record)")
    p.add_argument("--data-mt", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--data-lm", default=os.path.join(REPO, "data/wiki-gensim/bin"))
    p.add_argument("--records", default=RECORDS, help="append the records here ('' = nowhere)")
    a = p.parse_args(argv)
    if a.list:
        for c in _cases().CASES:
            print(f"{c.level:8} {c.family}/{c.name}  {c.note}")
        return 0
    if not a.cases and not a.arch:
        p.error("name the cases to run (--list), or --arch ARCH")
    cases = select(a.cases) + ([_cases().own_arch(a.arch, a.flags)] if a.arch else [])
    if a.count:
        return print("\n".join(f"{c.family}/{c.name}: {processes(c, a)} fairseq processes"
                                for c in cases)) or 0
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(a.device)
    a.dtype = a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cpu" and "fp16" in (a.precision, a.dtype):
        raise SystemExit("fp16 does not train on the CPU (fairseq's --fp16 needs CUDA): pass "
                         "--precision bf16 or fp32 with --device cpu")
    a.data_mt, a.data_lm = os.path.abspath(a.data_mt), os.path.abspath(a.data_lm)
    for c in cases:
        data = {"mt": a.data_mt, "lm": a.data_lm}.get(getattr(c, "data", ""))
        if data and not os.path.isdir(data):
            raise SystemExit(f"{c.family}/{c.name}: no binarised data in {data}: run `make data` "
                             f"or pass --data-{c.data}")
    env = environment(device, a.gpus)
    record = Recorder(a.records, env, argv, a.size, a.dtype)
    print(f"device {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, commit "
          f"{env['commit']}, size {a.size}", flush=True)
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    roofline: Dict[str, float] = {}
    for c in sorted(cases, key=lambda c: c.family != "device"):  # rooflines first
        print(f"\n== {c.level} {c.family}/{c.name}", flush=True)
        if isinstance(c, Kernel):
            shapes = only({shape_text(shape): shape for shape in c.shapes[a.size]}, a)
            for i, shape in enumerate(shapes.values()):  # (a shape may name its own dtype)
                torch.manual_seed(0)
                row = run_kernel(c, shape, device, dtypes[shape.get("dtype", a.dtype)],
                                 a.repeats or 20, roofline, i)
                if c.family == "device" and "GB/s" in row:
                    roofline["bytes"] = row["GB/s"]
                elif c.family == "device" and "GFLOP/s" in row:
                    roofline["flops"] = row["GFLOP/s"]
                record(c, row, shape.get("dtype"))
        elif isinstance(c, Train):
            a.repeats = a.repeats or 2
            run_train(c, a, env["device"], record)
        elif isinstance(c, Decode):
            a.repeats = a.repeats or 2
            run_decode(c, a, record)
        else:
            run_quality(c, a, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

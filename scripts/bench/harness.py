"""The benchmark harness: one way to declare a row (scripts/bench/cases.py), three levels.

``Kernel``  a sublayer or kernel, forward + backward (or forward) against its baseline or a peer at
            named shapes, alternating in one process: the first call (cold: compilation, plan
            building) and the median of the repeats (warm), the ratio, the peak CUDA memory of
            one call, and, for a case that counts its bytes or FLOPs, its share of the device's
            measured roofline (the ``device/copy`` and ``device/matmul`` rows of the same run).
``Train``   end-to-end ``fairseq-train`` of an arch against its stock baseline, same data and
            flags, alternating (baseline, arch, arch, baseline, ...) in one invocation. Speed is
            timed on warm shapes only: after one full pass over the batches (fairseq's epoch 1;
            a case whose batches all have one shape: after the first log interval), over the log
            intervals that follow, with ``--disable-validation --no-save``; the first pass is a
            column of its own. Peak memory is the largest per-update CUDA peak of the timed updates
            (fairseq resets the peak every update: the child reads it just before), "n/a" off
            CUDA. The baseline runs first and is printed beside its sanity floor (``FLOORS``).
``Quality`` ``fairseq-train`` runs at equal updates and seeds: the valid loss fairseq reports at
            the last update (base 2: bits per token), parameters, slot usage.

Each row is appended as a JSON line (device, torch and CUDA versions, commit, the exact command,
the figures) to ``--records`` (docs/benchmarks.jsonl); ``python -m scripts.bench.tables``
renders the tables of docs/performance.md from them. See docs/performance.md for the commands.
"""

import argparse
import datetime
import fnmatch
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(REPO, "fairseq_attnzoo")
RECORDS = os.path.join(REPO, "docs", "benchmarks.jsonl")
PEAKS_TAG = "ATTNZOO_BENCH_PEAKS"  # the training child's last line: per-update CUDA peaks
PROFILE_TAG = "ATTNZOO_BENCH_PROFILE"
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"], "amp": ["--amp"]}
Sized = Union[str, Dict[str, str]]  # flags, or flags per --size


def sized(value, size: str):
    return value.get(size, value.get("paper")) if isinstance(value, dict) else value


@dataclass
class Kernel:
    """``candidate(p, device, dtype)`` -> a call (one forward + backward); ``baseline`` the same
    for what it is compared with (None: no ratio). ``shapes[size]``: the parameter dicts ``p``,
    one row each. ``work(p, dtype)`` -> ("bytes" | "flops", count): the roofline column."""
    family: str
    name: str
    shapes: Dict[str, List[dict]]
    candidate: Callable
    baseline: Optional[Callable] = None
    work: Optional[Callable] = None
    note: str = ""
    level: str = "kernel"


@dataclass
class Train:
    """``runs``: (baseline flags, candidate flags), each a full set after ``common``; ``warm``:
    "epoch" (time epochs 2+) or "interval" (one shape: time after the first log interval);
    ``floor``: the key of the baseline's sanity floor in ``cases.FLOORS``."""
    family: str
    name: str
    data: str  # "mt" | "lm": --data-mt / --data-lm
    common: Sized
    baseline: Sized
    candidate: Sized
    warm: str = "epoch"
    floor: Optional[str] = None
    note: str = ""
    level: str = "train"


@dataclass
class Quality:
    """``runs``: label -> flags after ``common`` (or a callable giving that dict), trained for
    ``updates[size]`` updates with each seed; one record per run."""
    family: str
    name: str
    data: str
    common: Sized
    runs: Union[Dict[str, Sized], Callable]
    updates: Dict[str, int] = field(default_factory=lambda: {"paper": 1000, "tiny": 4})
    note: str = ""
    level: str = "quality"


# ---- records -------------------------------------------------------------------------------

def environment(device) -> Dict[str, Any]:
    import torch

    def git(*args):
        out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
        return out.stdout.strip()

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+uncommitted"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "commit": commit}


class Recorder:
    """Appends one JSON line per row to ``path`` as the row finishes (a run cut off by a time
    limit keeps the rows it finished)."""

    def __init__(self, path, env, argv, size, dtype):
        self.path, self.run = path, datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
        command = "python -m scripts.bench " + " ".join(shlex.quote(a) for a in argv)
        self.head = {**env, "run": self.run, "size": size, "dtype": dtype, "command": command}

    def __call__(self, case, row: Dict[str, Any]):
        record = {"case": f"{case.family}/{case.name}", "level": case.level, **self.head,
                  "row": row}
        print(json.dumps(row), flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ---- kernel level --------------------------------------------------------------------------

def timed(call, device) -> float:
    """Milliseconds of one ``call()`` (on CUDA: to the end of the work it queued)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    return 1000 * (time.perf_counter() - t0)


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


def fwd_bwd(module, *inputs, forward_only=False):
    """A call: ``module(*inputs)`` (its first output) summed and back-propagated, gradients
    cleared first (``forward_only``: under no_grad)."""
    import torch

    def call():
        if forward_only:
            with torch.no_grad():
                module(*inputs)
            return
        module.zero_grad(set_to_none=True)
        out = module(*inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).float().sum().backward()
    return call


def host_syncs(call) -> int:
    """How many ops of one ``call()`` would make the host wait for a GPU (scripts/bench/syncs.py;
    counted on any device)."""
    from scripts.bench.syncs import HostTensors

    n = [0]
    with HostTensors().counting(lambda func, sync: n.__setitem__(0, n[0] + sync)):
        call()
    return n[0]


def shape_text(p: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items())


def run_kernel(case: Kernel, p: dict, device, dtype, repeats, roofline) -> Dict[str, Any]:
    row = {"shape": shape_text(p)}
    try:
        cand = case.candidate(p, device, dtype)
        calls = {"": cand}
        if case.baseline:
            calls["baseline "] = case.baseline(p, device, dtype)
        cold = {k: timed(c, device) for k, c in calls.items()}
        for c in calls.values():
            c()
        warm = {k: [] for k in calls}
        for i in range(repeats):  # alternating, and the order too: drift hits both alike
            for k in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
                warm[k].append(timed(calls[k], device))
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
    row["host syncs"] = host_syncs(cand)
    return row


# ---- train and quality levels: fairseq-train children ---------------------------------------

def train_child(argv):
    """``fairseq-train argv`` in this process (``--_train``): on CUDA, the peak of every update is
    read just before fairseq resets it (once per update) and printed last (``PEAKS_TAG``); with
    ``PROFILE_TAG`` = N in the environment, the N updates after the first N are profiled."""
    import argparse as ap

    import torch

    torch.serialization.add_safe_globals([ap.Namespace])
    import fairseq_attnzoo  # noqa: F401  (the plugin's fairseq fixes, for the example too)
    from fairseq_cli import train

    peaks, reset = [], torch.cuda.reset_peak_memory_stats

    def read_then_reset(*a, **k):
        peaks.append(torch.cuda.max_memory_allocated())
        reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = read_then_reset
    if os.environ.get(PROFILE_TAG):
        profile_updates(int(os.environ[PROFILE_TAG]))
    sys.argv = ["fairseq-train"] + argv
    try:
        train.cli_main()
    finally:
        if torch.cuda.is_available():
            print(PEAKS_TAG, json.dumps(peaks or [torch.cuda.max_memory_allocated()]),
                  flush=True)


def profile_updates(n: int):
    """Profile the ``n`` updates after the first ``n``; print their top ops by self device time
    (CPU: self CPU time), per update: [op, calls, ms, % of the ops' total]."""
    import torch
    from fairseq.trainer import Trainer

    step, calls, cuda = Trainer.train_step, [0], torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)

    def train_step(self, samples, raise_oom=False):
        calls[0] += 1
        if calls[0] == n + 1:
            prof.start()
        out = step(self, samples, raise_oom)
        if calls[0] == 2 * n:
            prof.stop()
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            ops = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)
                   and not e.key.startswith("ProfilerStep")
                   and (not cuda or str(getattr(e, "device_type", "CPU")).endswith("CPU"))]
            ops.sort(key=lambda e: -getattr(e, key, 0.0))
            total = sum(getattr(e, key, 0.0) for e in ops) or 1.0
            print(PROFILE_TAG, json.dumps([[e.key[:60], e.count / n, getattr(e, key, 0.0) / n / 1e3,
                                            100 * getattr(e, key, 0.0) / total]
                                           for e in ops[:12]]), flush=True)
        return out

    Trainer.train_step = train_step


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


def fairseq_train(flags: List[str], data: str, a, seed: int, stop: List[str], env=None) -> str:
    """One child ``fairseq-train``; its output, or SystemExit with the tail of its log."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scripts.bench.harness", "--_train", data, *flags,
               "--seed", str(seed), "--save-dir", tmp, "--no-save", "--log-format", "json",
               "--num-workers", "0", *stop] + (["--cpu"] if a.device == "cpu" else [])
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"fairseq-train failed ({out.returncode}): {shlex.join(cmd)}\n"
                         f"{text[-4000:]}")
    return text


def precision_flags(a) -> List[str]:
    return PRECISIONS[a.precision]


def timed_run(flags, data, a, warm, seed) -> Dict[str, Any]:
    """One training run timed on warm shapes (module docstring): tokens/s (median of the log
    intervals), the first pass (tokens/s, and its seconds beyond the warm rate), peak GiB."""
    stop = (["--max-epoch", str(1 + a.epochs), "--max-update", "100000000"] if warm == "epoch"
            else ["--max-update", str(a.updates)])
    env = {PROFILE_TAG: str(a.profile)} if a.profile else {}
    text = fairseq_train(flags + ["--disable-validation", "--log-interval", str(a.log_interval)]
                         + precision_flags(a) + stop, data, a, seed, [], env)
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
    return {"tokens/s": statistics.median(float(r["wps"]) for r in hot),
            "warm updates": sum(r["n"] for r in hot),
            "first pass tokens/s": sum(r["n"] * float(r["wpb"]) for r in cold)
            / sum(r["s"] for r in cold),
            "first pass extra s": sum(r["s"] for r in cold) - warm_s * sum(r["n"] for r in cold),
            "peak GiB": max(peaks[first_warm:] or peaks) / 2**30 if peaks else None,
            "profile": tagged(text, PROFILE_TAG)}


def floor_of(case, a, device_name):
    """(tokens/s, source) of the baseline's sanity floor on this device class, or None."""
    from scripts.bench.cases import FLOORS

    half = "fp32" if a.precision == "fp32" else "half"
    for cls, prec, tokens, source in FLOORS.get(case.floor, ()):
        if cls in device_name and prec == half and a.size == "paper":
            return tokens, source
    return None


def run_train(case: Train, a, device_name, record):
    common = shlex.split(sized(case.common, a.size))
    flags = {"baseline": common + shlex.split(sized(case.baseline, a.size)),
             "candidate": common + shlex.split(sized(case.candidate, a.size))}
    data = a.data_mt if case.data == "mt" else a.data_lm
    runs: Dict[str, List[dict]] = {"baseline": [], "candidate": []}
    floor = floor_of(case, a, device_name)
    for i in range(a.repeats):  # baseline, candidate, candidate, baseline, ...
        for who in (["baseline", "candidate"] if i % 2 == 0 else ["candidate", "baseline"]):
            runs[who].append(timed_run(flags[who], data, a, case.warm, a.seed))
            if who == "baseline" and i == 0:
                b = runs["baseline"][0]["tokens/s"]
                print(f"baseline: {b:,.0f} tokens/s warm; floor on this device: " + (
                    f"{floor[0]:,} ({floor[1]})" + (" BELOW: suspect" if b < floor[0] else "")
                    if floor else "none known"), flush=True)

    def med(who, key):
        vals = [r[key] for r in runs[who] if r[key] is not None]
        return statistics.median(vals) if vals else None

    row = {"precision": a.precision}
    for who, prefix in (("candidate", ""), ("baseline", "baseline ")):
        for key in ("tokens/s", "first pass tokens/s", "first pass extra s", "peak GiB"):
            row[prefix + key] = med(who, key)
    row["speed ratio"] = row["tokens/s"] / row["baseline tokens/s"]
    row["memory ratio"] = (row["peak GiB"] / row["baseline peak GiB"]
                           if row["peak GiB"] and row["baseline peak GiB"] else None)
    b = [r["tokens/s"] for r in runs["baseline"]]
    row["baseline drift %"] = 100 * (b[-1] - b[0]) / b[0]
    row["warm updates"], row["repeats"] = runs["candidate"][0]["warm updates"], a.repeats
    row["floor"] = f"{floor[0]:,} ({floor[1]})" if floor else None
    row["suspect"] = bool(floor and row["baseline tokens/s"] < floor[0])
    profiles = {who: rs[0]["profile"] for who, rs in runs.items() if rs[0]["profile"]}
    if profiles:
        row["profile"] = profiles
    record(case, row)


def run_quality(case: Quality, a, record):
    runs = case.runs() if callable(case.runs) else case.runs
    if a.only:
        runs = {k: v for k, v in runs.items() if any(w in k for w in a.only)}
    data = a.data_mt if case.data == "mt" else a.data_lm
    updates = a.updates_override or case.updates.get(a.size, case.updates["paper"])
    common = shlex.split(sized(case.common, a.size))
    for i, seed in enumerate(a.seeds):
        for label in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            flags = common + shlex.split(sized(runs[label], a.size)) + precision_flags(a)
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

def select(patterns: List[str]):
    from scripts.bench.cases import CASES

    chosen = [c for c in CASES if any(fnmatch.fnmatch(f"{c.family}/{c.name}", p) or p == c.family
                                      for p in patterns)]
    unknown = [p for p in patterns if not any(
        fnmatch.fnmatch(f"{c.family}/{c.name}", p) or p == c.family for c in CASES)]
    if unknown:
        raise SystemExit(f"no case matches {', '.join(unknown)}: `python -m scripts.bench --list` "
                         "names them")
    return chosen


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_train"]:
        return train_child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.split(
        "\n\n")[0], epilog="docs/performance.md: what each case measures, and the commands.")
    p.add_argument("cases", nargs="*", help="case names, families or patterns (aop, 'mt/*', "
                   "pkm/memory-lm): --list names them")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--arch", help="time your own arch against the stock baseline of its task "
                   "(with --flags for it)")
    p.add_argument("--flags", default="", help="more fairseq-train flags for --arch's runs")
    p.add_argument("--size", choices=["paper", "tiny"], default="paper",
                   help="paper: the sizes people train; tiny: every case shrunk (a dry run)")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16",
                   help="kernel cases' dtype (default bf16; fp32 on the CPU)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16",
                   help="train and quality runs (the CPU trains fp32 whatever is asked)")
    p.add_argument("--repeats", type=int, default=None,
                   help="kernel: timed calls (default 20); train: alternating pairs (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="train: timed epochs after the first")
    p.add_argument("--updates", type=int, default=300,
                   help="train cases of one shape: updates per run (the first interval is cold)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--updates-override", type=int, default=None, metavar="N",
                   help="quality: train every run N updates instead of the case's")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="quality: one run per seed")
    p.add_argument("--seed", type=int, default=1, help="train: the seed of every run")
    p.add_argument("--only", nargs="+", help="only the quality runs and kernel shapes whose label "
                   "contains one of these strings")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="train: profile N updates after the first N of every run (top ops, in the record)")
    p.add_argument("--data-mt", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--data-lm", default=os.path.join(REPO, "data/wiki-gensim/bin"))
    p.add_argument("--records", default=RECORDS, help="append the records here ('' = nowhere)")
    a = p.parse_args(argv)
    from scripts.bench.cases import CASES, own_arch

    if a.list:
        for c in CASES:
            print(f"{c.level:8} {c.family}/{c.name}  {c.note}")
        return 0
    if not a.cases and not a.arch:
        p.error("name the cases to run (--list), or --arch ARCH")
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(a.device)
    if device.type == "cpu":  # (what runs there, recorded as such)
        a.dtype = a.precision = "fp32"
    a.data_mt, a.data_lm = os.path.abspath(a.data_mt), os.path.abspath(a.data_lm)
    cases = select(a.cases) + ([own_arch(a.arch, a.flags)] if a.arch else [])
    for c in cases:
        data = {"mt": a.data_mt, "lm": a.data_lm}.get(getattr(c, "data", ""))
        if data and not os.path.isdir(data):
            raise SystemExit(f"{c.family}/{c.name}: no binarised data in {data}: run `make data` "
                             f"or pass --data-{c.data}")
    env = environment(device)
    record = Recorder(a.records, env, argv, a.size, a.dtype)
    print(f"device {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, commit "
          f"{env['commit']}, size {a.size}", flush=True)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    roofline: Dict[str, float] = {}
    for c in sorted(cases, key=lambda c: c.family != "device"):  # rooflines first
        print(f"\n== {c.level} {c.family}/{c.name}", flush=True)
        if isinstance(c, Kernel):
            for shape in c.shapes[a.size]:
                if a.only and not any(w in shape_text(shape) for w in a.only):
                    continue
                torch.manual_seed(0)
                row = run_kernel(c, shape, device, dtype, a.repeats or 20, roofline)
                if c.family == "device" and "GB/s" in row:
                    roofline["bytes"] = row["GB/s"]
                elif c.family == "device" and "GFLOP/s" in row:
                    roofline["flops"] = row["GFLOP/s"]
                record(c, row)
        elif isinstance(c, Train):
            a.repeats = a.repeats or 2
            run_train(c, a, env["device"], record)
        else:
            run_quality(c, a, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

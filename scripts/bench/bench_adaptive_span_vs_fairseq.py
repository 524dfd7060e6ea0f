#!/usr/bin/env python
"""Side by side: our ``adaptive_span_lm`` vs fairseq's own ``examples/adaptive_span``.

Same data, same shrunken config, same optimizer settings, same number of updates, same machine,
trained in alternating segments (baseline, ours, ours, baseline, ...: each run resumes from its
``checkpoint_last.pt``) so that load drift on a shared machine hits both alike. Then both are
scored on the validation split with ``fairseq-eval-lm`` (each with its own task, the same number
of streams), which counts every predicted token once: bits per character.

Training speed: tokens/s over the ``train_inner`` log intervals (tokens / training time, from
fairseq's own ``wps``), excluding start-up, checkpointing and evaluation.

Notes on what differs by design (see docs/adaptive_span.md):
* fairseq's example does not renormalise the masked attention weights (the paper and the original
  code do; we do); with ``--also-no-renorm`` a third run trains ours with
  ``--adaptive-span-no-renorm`` to show the effect of that difference alone.
* fairseq's example predicts M-1 tokens per block (the last target is padding) and its logged
  ``loss`` divides by M; eval-lm below scores both the same way.

``--step-timing N`` times only the training step instead (fairseq's ``Trainer.train_step`` on
real batches: forward, backward, optimizer; no data loading, logging or evaluation): N steps after
10 warm-up steps, per run, in ``--step-rounds`` alternating rounds, median; ``--ours-code DIR``
adds a row with our plugin from another checkout (``DIR/fairseq_attnzoo``, e.g. ``git worktree add
DIR <commit>``) for before/after comparisons.

Example (the numbers in docs/adaptive_span.md)::

    OMP_NUM_THREADS=1 python -m scripts.bench.bench_adaptive_span_vs_fairseq --data data/wiki-gensim/bin
    python -m scripts.bench.bench_adaptive_span_vs_fairseq --device cuda --step-timing 100
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fairseq_example_dir() -> str:
    import fairseq

    path = os.path.join(os.path.dirname(fairseq.__file__), "examples", "adaptive_span")
    if not os.path.isdir(path):
        raise SystemExit(f"fairseq's examples/adaptive_span is not installed at {path}")
    return path


def fairseq_cli(name: str, plugin_patches: bool = False):
    """``fairseq-<name>`` (same entry point) in a Python that first allow-lists argparse.Namespace
    for torch >= 2.6's weights-only checkpoint loading: fairseq's example does not do it (our
    plugin does when fairseq loads it), so without this it cannot resume or evaluate its own checkpoints.
    ``plugin_patches``: enable our plugin first (``fairseq_attnzoo.enable()``), so that fairseq's example trains with the same
    fixes of fairseq as ours (fairseq_attnzoo/compat.py: --amp unscaled once, --bf16 without
    --tpu); only for commands that do not load our plugin through --user-dir themselves."""
    from scripts.bench.benchlib import PEAK_TAG

    code = ("import argparse, sys, torch; "
            "torch.serialization.add_safe_globals([argparse.Namespace]); "
            + ("import fairseq_attnzoo; fairseq_attnzoo.enable(); " if plugin_patches else "")
            + f"from fairseq_cli.{name} import cli_main; sys.argv[0] = 'fairseq-{name}'; cli_main()"
            # the peak CUDA memory of the process (the segments of a run: the largest)
            + f"; torch.cuda.is_available() and print('{PEAK_TAG}', "
            "torch.cuda.max_memory_allocated(), flush=True)")
    return [sys.executable, "-c", code]


def commands(a):
    """The two (three) training commands, without --max-update / --save-dir."""
    # every segment logs at least one train_inner record (its tokens/s), also a short one
    interval = max(1, min(10, a.updates // a.segments))
    common = [a.data] + (["--cpu"] if a.device == "cpu" else []) + list(a.extra) + [
              "--tokens-per-sample", str(a.block), "--batch-size", str(a.batch),
              "--lr", str(a.lr), "--lr-scheduler", "fixed", "--warmup-updates", str(a.warmup),
              "--seed", "1", "--num-workers", "0", "--disable-validation",
              "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", str(interval)]
    baseline = fairseq_cli("train", plugin_patches=True) + common + [
        "--user-dir", fairseq_example_dir(), "--task", "truncated_bptt_lm",
        "--arch", "adaptive_span",
        "--n-layer", str(a.layers), "--d-model", str(a.dim), "--n-head", str(a.heads),
        "--d-inner", str(a.ffn), "--attn-span", str(a.span), "--dropout", "0",
        "--emb-dropout", "0", "--adapt-span-ramp", "32", "--adapt-span-init", "0",
        "--aux-loss-scaler", str(a.span_loss), "--criterion", "adaptive_span_loss",
        "--optimizer", "adagrad_with_grad_clip", "--adagrad-clip", str(a.clip)]
    ours = fairseq_cli("train") + common + [
        "--user-dir", os.path.join(REPO, "fairseq_attnzoo"), "--task", "attnzoo_stream_lm",
        "--arch", "adaptive_span_lm_small", "--decoder-layers", str(a.layers),
        "--decoder-embed-dim", str(a.dim), "--decoder-attention-heads", str(a.heads),
        "--decoder-ffn-embed-dim", str(a.ffn), "--attn-span", str(a.span), "--dropout", "0",
        "--adaptive-span-ramp", "32", "--adaptive-span-init", "0",
        "--adaptive-span-loss", str(a.span_loss), "--criterion", "attnzoo_span_loss",
        "--no-layer-spans", "--optimizer", "adagrad_clip", "--grad-clip-per-tensor", str(a.clip)]
    runs = {"fairseq examples/adaptive_span": baseline, "attnzoo adaptive_span_lm": ours}
    if a.also_no_renorm:
        runs["attnzoo, --adaptive-span-no-renorm"] = ours + ["--adaptive-span-no-renorm"]
    if a.also_explicit:
        runs["attnzoo, --adaptive-span-kernel explicit"] = ours + ["--adaptive-span-kernel",
                                                                   "explicit"]
    if a.ours_code:
        from scripts.bench.benchlib import checkout_plugin, with_user_dir

        runs[f"attnzoo adaptive_span_lm ({a.ours_code})"] = with_user_dir(
            ours, checkout_plugin(a.ours_code, "--ours-code"))
    return runs


def user_dir(cmd):
    return cmd[cmd.index("--user-dir") + 1]


def eval_command(name, a, ckpt, train_cmd):
    if name.startswith("fairseq"):
        extra = ["--user-dir", fairseq_example_dir(), "--task", "truncated_bptt_lm"]
    else:
        extra = ["--user-dir", user_dir(train_cmd), "--task", "attnzoo_stream_lm"]
    return fairseq_cli("eval_lm") + [a.data, "--path", ckpt] + (
        ["--cpu"] if a.device == "cpu" else []) + ["--gen-subset",
            a.subset, "--batch-size", str(a.eval_batch), "--tokens-per-sample", str(a.block),
            "--num-workers", "0"] + extra


def run(cmd, env):
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr, time.time() - t0


def inner_logs(log: str):
    """The ``train_inner`` records of a run (fairseq's example, started through ``python -c``,
    logs them as ``INFO:train_inner:{...}``; ours through fairseq's CLI format)."""
    from scripts.bench.benchlib import json_log_lines

    return json_log_lines(log, "train_inner")


def time_steps(train_args, steps: int, warmup: int = 10) -> float:
    """Seconds per ``Trainer.train_step`` for the fairseq-train command line ``train_args`` (run in
    a fresh process: the two plugins are not imported together)."""
    import torch

    torch.serialization.add_safe_globals([argparse.Namespace])
    plugin = user_dir(train_args)
    sys.path[:] = [x for x in sys.path if os.path.abspath(x or ".") != REPO]  # fairseq adds it
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    args = options.parse_args_and_arch(options.get_training_parser(), train_args)
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    if "fairseq_attnzoo" in sys.modules:  # the plugin of that checkout, not another one
        loaded = os.path.dirname(os.path.abspath(sys.modules["fairseq_attnzoo"].__file__))
        if loaded != os.path.abspath(plugin):
            raise SystemExit(f"imported {loaded}, not {plugin}")
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    trainer = Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion))
    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    batches = [next(itr) for _ in range(warmup + steps)]
    cuda = torch.cuda.is_available() and not cfg.common.cpu
    with metrics.aggregate("train"):
        for b in batches[:warmup]:
            trainer.train_step([b])
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches[warmup:]:
            trainer.train_step([b])
        if cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def step_timing(a, runs, env):
    """Median seconds per training step of every run, over alternating rounds."""
    times = {name: [] for name in runs}
    for rnd in range(a.step_rounds):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--_time-steps", str(a.step_timing),
                   "--"] + runs[name][3:] + ["--max-update", "1000000", "--save-dir", a.work]
            out, _ = run(cmd, env)
            times[name].append(float(re.findall(r"STEP_SECONDS ([0-9.e-]+)", out)[-1]))
            print(f"[round {rnd + 1}/{a.step_rounds}] {name}: "
                  f"{times[name][-1] * 1000:.1f} ms/step", flush=True)
    rows = []
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        rows.append({"model": name, "ms/step (median)": med * 1000,
                     "train tokens/s": a.batch * a.block / med, "rounds": len(ts)})
    for r in rows:
        r["speed ratio"] = r["train tokens/s"] / rows[0]["train tokens/s"]
    return rows


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--_time-steps":  # worker of --step-timing
        print(f"STEP_SECONDS {time_steps(sys.argv[4:], int(sys.argv[2])):.6f}")
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(REPO, "data/wiki-gensim/bin"))
    p.add_argument("--work", default="/tmp/attnzoo-adaptive-span-vs-fairseq")
    p.add_argument("--updates", type=int, default=1000)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (default; 1 thread per run, see --threads) or cuda")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more fairseq-train flags for every run, e.g. --extra=--fp16")
    p.add_argument("--segments", type=int, default=4, help="alternation segments")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--span", type=int, default=512)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.07)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=0.03)
    p.add_argument("--span-loss", type=float, default=2e-6)
    p.add_argument("--subset", default="valid")
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    p.add_argument("--also-no-renorm", action="store_true",
                   help="also train ours without renormalising the masked weights (as fairseq's "
                   "example)")
    p.add_argument("--also-explicit", action="store_true",
                   help="also train ours with the op-by-op band attention (--adaptive-span-kernel "
                   "explicit; on CUDA the default is the fused path): before/after in one run")
    p.add_argument("--step-timing", type=int, default=0, metavar="N",
                   help="time N training steps per run (Trainer.train_step, no data loading, "
                   "logging or evaluation) instead of training and evaluating")
    p.add_argument("--step-rounds", type=int, default=3,
                   help="alternating rounds of --step-timing (median)")
    p.add_argument("--ours-code", default=None, metavar="DIR",
                   help="also run our plugin from another checkout DIR (before/after)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.data, "dict.txt")):
        raise SystemExit(f"no binarised data in {a.data}: run `python -m scripts.data.prepare_enwik8 "
                         "--gensim` first")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    runs = commands(a)
    shutil.rmtree(a.work, ignore_errors=True)
    from scripts.bench.benchlib import format_table, peak_cuda_gib

    if a.step_timing:
        rows = step_timing(a, runs, env)
        print(f"\nconfig: {a.layers} layers, d {a.dim}, {a.heads} heads, ffn {a.ffn}, S {a.span}, "
              f"block {a.block}, batch {a.batch}; {a.step_timing} steps after 10 warm-up, "
              f"device {a.device}, {a.threads} thread(s); data {a.data}\n")
        print(format_table(rows))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "rows": rows, "commands": runs}, f, indent=1)
        return
    logs = {name: [] for name in runs}
    outputs = {name: [] for name in runs}  # every segment's output (its PEAK_TAG line)
    names = list(runs)
    for seg in range(1, a.segments + 1):
        upto = a.updates * seg // a.segments
        order = names if seg % 2 else names[::-1]
        for name in order:
            save = os.path.join(a.work, re.sub(r"\W+", "_", name))
            print(f"[segment {seg}/{a.segments}] {name}: updates -> {upto}", flush=True)
            out, _ = run(runs[name] + ["--max-update", str(upto), "--save-dir", save], env)
            logs[name] += inner_logs(out)
            outputs[name].append(out)
    rows = []
    for name in names:
        save = os.path.join(a.work, re.sub(r"\W+", "_", name))
        out, _ = run(eval_command(name, a, os.path.join(save, "checkpoint_last.pt"), runs[name]),
                     env)
        m = re.search(r"Loss \(base 2\): ([0-9.]+)", out)
        ntok = re.search(r"Evaluated ([0-9,]+) tokens", out)
        tokens = sum(float(r["wpb"]) * 10 for r in logs[name])  # log interval 10 updates
        seconds = sum(float(r["wpb"]) * 10 / float(r["wps"]) for r in logs[name])
        last = logs[name][-1]
        rows.append({"model": name, "updates": int(last["num_updates"]),
                     "train tokens/s": tokens / seconds,
                     f"{a.subset} bpc (eval-lm)": float(m.group(1)) if m else float("nan"),
                     "scored tokens": ntok.group(1) if ntok else "?",
                     "last train loss (logged)": float(last["loss"]),
                     "avg span": float(last.get("avg_span", last.get("span_avg", "nan"))),
                     "peak GiB": peak_cuda_gib("\n".join(outputs[name]))})
    base = rows[0]
    for r in rows:
        r["speed ratio"] = r["train tokens/s"] / base["train tokens/s"]
        r["memory ratio"] = r["peak GiB"] / base["peak GiB"]
        r["bpc diff"] = r[f"{a.subset} bpc (eval-lm)"] - base[f"{a.subset} bpc (eval-lm)"]

    print(f"\nconfig: {a.layers} layers, d {a.dim}, {a.heads} heads, ffn {a.ffn}, S {a.span}, "
          f"block {a.block}, batch {a.batch}, lr {a.lr} (warmup {a.warmup}), clip {a.clip}, "
          f"lambda {a.span_loss}, {a.updates} updates in {a.segments} alternating segments, "
          f"{a.threads} thread(s); data {a.data}")
    print("(fairseq's avg span includes the ramp R=32; ours is z)\n")
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "commands": runs}, f, indent=1)


if __name__ == "__main__":
    main()

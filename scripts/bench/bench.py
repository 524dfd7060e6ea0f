#!/usr/bin/env python
"""Benchmarks (``make bench``): not tests, numbers for docs/.

1. Sublayer cases from ``scripts/bench/cases/*.py`` (forward+backward of a method's module vs the
   stock module it replaces, same shapes, alternating, median of repeats, ratio).
2. ``--train ARCH ...``: end-to-end ``fairseq-train`` words/s of each arch vs the stock
   ``transformer`` on the demo corpus at the demo size, alternating baseline and candidate runs.
   The demo's character LMs (``adaptive_span_lm_small``, ``all_attention_lm``: their demo flags,
   on the demo LM data) run against fairseq's stock ``transformer_lm`` at the same size (4 layers,
   d 128, 4 heads, FFN 512, blocks of 128 bytes without a cache, batch 8, same optimizer).
   ``--plugin DIR`` runs the candidates with the plugin of another checkout (before/after).

Examples::

    python -m scripts.bench.bench --cases synth --threads 2
    python -m scripts.bench.bench --no-cases --train transformer_aop transformer_synth_random
    python -m scripts.bench.bench --no-cases --train transformer_pkm adaptive_span_lm_small --plugin ../attnzoo-before

(run from the repository root: ``scripts`` is a package).
"""

import argparse
import glob
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from fairseq_attnzoo.cli.progress import add_progress_flag, configure_progress, progress
from scripts.bench import benchlib
from scripts.demo import config as demo
from scripts.demo.config import REPO

HERE = os.path.dirname(os.path.abspath(__file__))


def load_cases():
    for path in sorted(glob.glob(os.path.join(HERE, "cases", "*.py"))):
        name = os.path.splitext(os.path.basename(path))[0]
        if not name.startswith("_"):
            importlib.import_module(f"scripts.bench.cases.{name}")
    return benchlib.CASES


# fairseq's stock decoder-only model at the demo LMs' size and optimizer: their baseline
LM_BASELINE = ("--arch transformer_lm --task language_modeling --sample-break-mode none "
               "--tokens-per-sample 128 --batch-size 8 --decoder-layers 4 --decoder-embed-dim 128 "
               "--decoder-attention-heads 4 --decoder-ffn-embed-dim 512 --dropout 0 "
               "--criterion cross_entropy --optimizer adagrad_clip --lr 0.07 "
               "--lr-scheduler fixed --warmup-updates 100")


def train_command(arch, data, updates, save_dir, plugin=None):
    """The demo's fairseq-train command of ``arch`` (``transformer_lm``: :data:`LM_BASELINE`),
    short and without saving or validation; ``plugin``: our package from another checkout
    (:func:`benchlib.checkout_plugin`)."""
    quiet = ["--max-update", str(updates), "--no-save", "--disable-validation", "--log-format",
             "json", "--log-interval", str(updates), "--num-workers", "0", "--cpu", "--save-dir",
             save_dir, "--seed", "1"]
    lm_rows = demo.lm_rows()
    if arch in lm_rows:
        cmd = demo.lm_cmd(arch, lm_rows[arch], save_dir, updates, 1) + quiet
    elif arch == "transformer_lm":
        cmd = [demo.fairseq_bin("fairseq-train"), demo.LM_DATA, "--user-dir", demo.USER_DIR]
        cmd += shlex.split(LM_BASELINE) + quiet
    else:
        spec = demo.mt_rows().get(arch, {"flags": ""})
        cmd = [demo.fairseq_bin("fairseq-train"), data, "--user-dir", demo.USER_DIR, "--arch",
               spec.get("arch", arch), "--task", "translation"] + quiet
        cmd += shlex.split(demo.COMMON) + shlex.split(spec.get("flags", ""))
    return benchlib.with_user_dir(cmd, plugin) if plugin else cmd


def train_wps(arch, data, updates, save_dir, plugin=None):
    """Words (tokens) per second of one short fairseq-train run (demo size and flags)."""
    out = subprocess.run(train_command(arch, data, updates, save_dir, plugin), capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"fairseq-train failed for {arch}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    wps = [float(json.loads(l[l.index("{"):])["train_wps"])
           for l in out.stdout.splitlines() + out.stderr.splitlines() if '"train_wps"' in l]
    if not wps:
        raise SystemExit(f"no train_wps in the log of {arch}")
    return wps[-1]


def bench_train(archs, data, updates, repeats, plugin=None):
    lm_rows = demo.lm_rows()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            progress(total=len(archs) * repeats * 2, desc="fairseq-train", unit="run") as bar:
        for arch in archs:
            baseline = "transformer_lm" if arch in lm_rows else "transformer"
            base, cand = [], []
            for i in range(repeats):  # alternate so load drift hits both
                order = [(baseline, base, None), (arch, cand, plugin)]
                for name, sink, code in (order if i % 2 == 0 else order[::-1]):
                    bar.set_postfix_str(name)
                    sink.append(train_wps(name, data, updates, tmp, code))
                    bar.update()
            b, c = statistics.median(base), statistics.median(cand)
            rows.append({"arch": arch, "words/s": c, "baseline": baseline,
                         "baseline words/s": b, "ratio": c / b, "updates": updates,
                         "repeats": repeats})
            bar.write(benchlib.format_table(rows[-1:]), file=sys.stdout)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="only cases whose group or name contains one of "
                   "these comma-separated words (default: all)")
    p.add_argument("--no-cases", action="store_true", help="skip the sublayer cases")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    p.add_argument("--train", nargs="*", default=[], help="archs for end-to-end words/s")
    p.add_argument("--train-updates", type=int, default=60)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--plugin", default=None, metavar="DIR",
                   help="--train: run the candidates with fairseq_attnzoo/ of another checkout "
                   "DIR (e.g. `git worktree add DIR COMMIT`), for before/after tables")
    p.add_argument("--data", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--out", default=os.path.join(REPO, "results", "benchmarks.md"),
                   help="append the tables to this markdown file (default: results/benchmarks.md, "
                   "not tracked by git; '' = no file)")
    add_progress_flag(p)
    a = p.parse_args()
    configure_progress(a)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    header = (f"{time.strftime('%Y-%m-%d %H:%M')} | `python -m scripts.bench.bench {' '.join(sys.argv[1:])}`"
              f" | torch {torch.__version__} | device {device}"
              f"{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}"
              f" | threads {a.threads} | {a.dtype}")
    sections = []
    if not a.no_cases:
        words = [w for w in a.cases.split(",") if w]
        rows = []
        cases = [c for c in load_cases()
                 if not words or any(w in c.group or w in c.name for w in words)]
        with progress(cases, desc="sublayer cases", unit="case") as bar:
            for case in bar:
                bar.set_postfix_str(f"{case.group}: {case.name}")
                rows.append(benchlib.run_case(case, device, a.repeats, dtype))
        table = benchlib.format_table(rows)
        print(table)
        sections.append(("Sublayer forward+backward (median ms, candidate / baseline)", table))
    if a.train:
        lm_rows = demo.lm_rows()
        plugin = benchlib.checkout_plugin(a.plugin, "--plugin") if a.plugin else None
        needs = {demo.LM_DATA: "dict.txt"} if any(x in lm_rows for x in a.train) else {}
        if any(x not in lm_rows for x in a.train):
            needs[a.data] = "dict.de.txt"
        for path, name in needs.items():
            if not os.path.exists(os.path.join(path, name)):
                raise SystemExit(f"no binarised demo corpus in {path}: run `make data` first")
        table = benchlib.format_table(bench_train(a.train, a.data, a.train_updates,
                                                  a.train_repeats, plugin))
        print(table)
        title = "End-to-end fairseq-train words/s vs the stock model (demo size)"
        sections.append((title + (f", candidates from {a.plugin}" if a.plugin else ""), table))
    if a.out and sections:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "a") as f:
            f.write(f"\n## {header}\n\n")
            for title, table in sections:
                f.write(f"### {title}\n\n{table}\n")
        print(f"appended to {a.out}")


if __name__ == "__main__":
    main()

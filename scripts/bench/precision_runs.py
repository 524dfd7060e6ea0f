#!/usr/bin/env python
"""Every arch, a short real training run in each mixed-precision mode, then decode/score from it.

For each (arch, precision in --fp16 / --bf16 / --amp): ``fairseq-train`` for ``--updates`` updates
at the demo size on the demo data (translation archs: the LibreOffice de-en corpus, flags of
scripts/demo/config.py; LMs: the gensim Wikipedia extract, bytes), then ``fairseq-generate`` (BLEU on the
valid split, beam 5, same precision) or ``fairseq-eval-lm`` (valid bits per token, same precision).
Reported per run: the loss of the first and last logged interval, how often fp16 loss scaling hit
an overflow, the final loss scale, the score, and seconds. Runs go ``--jobs`` at a time (on one GPU
the small demo models leave it mostly idle; on CPU use 1).

Needs a GPU for --fp16/--bf16 (fairseq refuses them with --cpu). Example (docs/gpu.md)::

    python -m scripts.bench.precision_runs --jobs 8 --updates 100 --out docs/gpu_precision.md
"""

import argparse
import concurrent.futures as futures
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

from fairseq_attnzoo.cli.archs import task_of, zoo_archs
from scripts.bench import benchlib
from scripts.demo import config as demo
from scripts.demo.config import REPO

PRECISION_FLAGS = {"fp16": ["--fp16"], "bf16": ["--bf16"], "amp": ["--amp"]}
# the LMs of the extension point (language_modeling task) at the span LMs' demo size, on bytes
LM_SMALL = ("--task language_modeling --sample-break-mode none --tokens-per-sample 128 "
            "--max-tokens 2048 --decoder-layers 4 --decoder-embed-dim 128 --decoder-ffn-embed-dim "
            "512 --decoder-attention-heads 4 --dropout 0 --optimizer adam --adam-betas (0.9,0.98) "
            "--lr 0.001 --lr-scheduler inverse_sqrt --warmup-updates 50 --clip-norm 1.0")


def kind(arch):
    return {"translation": "mt", "language_modeling": "lm"}.get(task_of(arch), "stream")


def train_cmd(arch, precision, a, save):
    k = kind(arch)
    common = ["--user-dir", demo.USER_DIR, "--arch", arch, "--save-dir", save, "--max-update",
              str(a.updates), "--seed", "1", "--log-format", "json", "--log-interval",
              str(a.log_interval), "--num-workers", "0", "--no-epoch-checkpoints",
              "--disable-validation"] + PRECISION_FLAGS[precision]
    if a.device == "cpu":
        common.append("--cpu")
    if k == "mt":
        flags = shlex.split(demo.COMMON) + demo.method_flags(arch)
        cmd = [demo.fairseq_bin("fairseq-train"), a.data_mt, "--task", "translation"] + flags
    elif k == "lm":
        cmd = [demo.fairseq_bin("fairseq-train"), a.data_lm] + shlex.split(LM_SMALL) + \
            demo.method_flags(arch)
        if "synth" in arch:
            cmd += ["--synth-max-len", "128"]
    else:
        cmd = [demo.fairseq_bin("fairseq-train"), a.data_lm] + shlex.split(demo.LM_COMMON) + \
            demo.method_flags(arch)
    cmd += common
    opts = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--optimizer"]
    opt = opts[-1] if opts else "adam"  # the last --optimizer wins (argparse)
    if precision in ("fp16", "bf16") and opt in ("adagrad_clip", "pkm_adam"):
        cmd.append("--fp16-no-flatten-grads")  # per-tensor optimizers (docs/precision.md)
    return cmd


def eval_cmd(arch, precision, a, ckpt):
    k = kind(arch)
    prec = PRECISION_FLAGS[precision] if precision != "amp" else []
    dev = ["--cpu"] if a.device == "cpu" else []
    if k == "mt":
        return [demo.fairseq_bin("fairseq-generate"), a.data_mt, "--user-dir", demo.USER_DIR,
                "--path", ckpt, "--gen-subset", "valid", "--beam", "5", "--batch-size", "128",
                "--remove-bpe", "sentencepiece", "--max-len-a", "1.2", "--max-len-b", "10",
                "--scoring", "sacrebleu"] + prec + dev
    task = ["--task", "language_modeling", "--sample-break-mode", "none"] if k == "lm" else \
        ["--task", "attnzoo_stream_lm"]
    return [demo.fairseq_bin("fairseq-eval-lm"), a.data_lm, "--user-dir", demo.USER_DIR,
            "--path", ckpt, "--gen-subset", "valid", "--tokens-per-sample", "128",
            "--batch-size", "8", "--max-tokens", "4096"] + task + prec + dev


def run(cmd, log):
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    with open(log) as f:
        return p.returncode, f.read().splitlines(), time.time() - t0


def one(arch, precision, a):
    save = os.path.join(a.work, f"{arch}.{precision}")
    os.makedirs(save, exist_ok=True)
    row = {"arch": arch, "precision": precision}
    rc, lines, secs = run(train_cmd(arch, precision, a, save), os.path.join(save, "train.log"))
    inner = [json.loads(l[l.index("{"):]) for l in lines if "train_inner" in l and "{" in l]
    row["train s"] = secs
    row["overflows"] = sum("gradient overflow detected" in l for l in lines)
    if rc != 0 or not inner:
        row["status"] = f"train failed (exit {rc}): " + (lines[-1][-160:] if lines else "")
        return row
    row["loss first"] = float(inner[0]["loss"])
    row["loss last"] = float(inner[-1]["loss"])
    row["updates"] = int(inner[-1]["num_updates"])
    if "loss_scale" in inner[-1]:
        row["loss scale"] = float(inner[-1]["loss_scale"])
    ok = (row["updates"] == a.updates and math.isfinite(row["loss last"])
          and row["loss last"] < row["loss first"])
    ckpt = os.path.join(save, "checkpoint_last.pt")
    rc, lines, secs = run(eval_cmd(arch, precision, a, ckpt), os.path.join(save, "eval.log"))
    row["eval s"] = secs
    if rc != 0:
        row["status"] = f"eval failed (exit {rc}): " + (lines[-1][-160:] if lines else "")
        return row
    if kind(arch) == "mt":
        m = [re.search(r"BLEU = ([\d.]+)", l) for l in lines]
        m = [x for x in m if x]
        row["valid BLEU"] = float(m[-1].group(1)) if m else float("nan")
    else:
        m = [re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", l) for l in lines]
        m = [x for x in m if x]
        row["valid bits/token"] = float(m[-1].group(1)) if m else float("nan")
    row["status"] = "ok" if ok else "loss did not fall"
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="*", default=None, help="default: every registered zoo arch")
    p.add_argument("--precisions", nargs="*", default=list(PRECISION_FLAGS),
                   choices=list(PRECISION_FLAGS))
    p.add_argument("--updates", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--data-mt", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--data-lm", default=demo.LM_DATA)
    p.add_argument("--work", default=os.path.join(REPO, "work/precision"))
    p.add_argument("--out", default="", help="append the markdown table to this file")
    p.add_argument("--json", default="", help="write the rows as JSON here")
    a = p.parse_args()
    import fairseq_attnzoo  # noqa: F401  (registers the archs)

    for path in (a.data_mt, a.data_lm):
        if not os.path.isdir(path):
            raise SystemExit(f"no binarised data in {path}: run `make data` first")
    archs = a.archs or zoo_archs()
    jobs = [(arch, prec) for arch in archs for prec in a.precisions]
    print(f"{len(jobs)} runs, {a.jobs} at a time", flush=True)
    rows = []
    t0 = time.time()
    with futures.ThreadPoolExecutor(a.jobs) as pool:
        todo = {pool.submit(one, arch, prec, a): (arch, prec) for arch, prec in jobs}
        for i, fut in enumerate(futures.as_completed(todo), 1):
            row = fut.result()
            rows.append(row)
            print(f"[{i}/{len(jobs)} {time.time() - t0:.0f}s] " + json.dumps(row), flush=True)
    rows.sort(key=lambda r: (r["arch"], r["precision"]))
    table = benchlib.format_table(rows)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.out:
        import torch

        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(a.out, "a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')} | `python -m scripts.bench.precision_runs "
                    f"{' '.join(sys.argv[1:])}` | torch {torch.__version__} | {dev}\n\n{table}")
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        print(f"{len(bad)} of {len(rows)} runs not ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

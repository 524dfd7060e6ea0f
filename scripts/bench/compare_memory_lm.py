"""Dense LM vs ``transformer_lm_pkm`` (XLM's value recipe) vs ``transformer_lm_memplus`` (the
Memory+ value recipe) on the demo byte-level LM data, at equal updates and tokens.

Every run is a real ``fairseq-train`` (same model size, data order, seed, model optimizer and
schedule); the rows differ only in the FFN slots that hold a memory and in the value optimiser
(docs/pkm.md, "Measured"). Prints a markdown table (valid bits per byte = fairseq's valid loss,
which is in base 2 per token, and a token is a byte here; train tokens/s; parameters with the
value tables named) and writes it to ``--out``::

    python -m scripts.bench.compare_memory_lm --data data/wiki-gensim/bin --seeds 1 2 \\
        --lock /tmp/cpu.lock --out /tmp/compare.md

Data: ``python -m scripts.data.prepare_enwik8 --gensim`` (``make data``). Run from the repository
root (``scripts`` is a package).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.demo.config import LM_DATA, USER_DIR, fairseq_bin

COMMON = ["--task", "language_modeling", "--tokens-per-sample", "128",
          "--sample-break-mode", "none", "--batch-size", "8", "--decoder-layers", "6",
          "--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512",
          "--decoder-attention-heads", "4", "--dropout", "0", "--lr", "2e-3",
          "--adam-betas", "(0.9, 0.98)", "--lr-scheduler", "inverse_sqrt", "--warmup-updates",
          "100", "--clip-norm", "1.0", "--batch-size-valid", "8", "--max-valid-steps", "100", "--log-format", "json",
          "--log-interval", "100", "--no-save", "--num-workers", "0", "--cpu"]
#: the memory at demo size: 128² = 16,384 slots, 4 heads, k 16 (the preset: 1024², k 32)
MEMORY = ["--pkm-n-keys", "128", "--pkm-heads", "4", "--pkm-knn", "16"]
XLM_VALUES = ["--optimizer", "pkm_adam", "--pkm-values-lr", "1e-3", "--pkm-values-lr-schedule",
              "constant", "--pkm-values-betas", "(0.9, 0.999)", "--pkm-values-weight-decay", "0"]
MEMPLUS_VALUES = ["--optimizer", "pkm_adam", "--pkm-values-lr", "1e-3",
                  "--pkm-values-lr-schedule", "follow", "--pkm-values-betas", "(0.9, 0.95)",
                  "--pkm-values-weight-decay", "0.1"]
ROWS = {
    "dense (`attnzoo_lm`)": ["--arch", "attnzoo_lm", "--optimizer", "adam"],
    "`transformer_lm_pkm`, XLM value recipe": (
        ["--arch", "transformer_lm_pkm", "--pkm-k-dim", "64"] + MEMORY + XLM_VALUES),
    "`transformer_lm_memplus`, Memory+ value recipe": (
        ["--arch", "transformer_lm_memplus"] + MEMORY + MEMPLUS_VALUES),
}


def run(name, flags, args, seed):
    save = tempfile.mkdtemp(prefix="cmp_mem_")
    cmd = ([fairseq_bin("fairseq-train"), args.data,
            "--user-dir", args.user_dir] + COMMON + flags
           + ["--max-update", str(args.updates), "--validate-interval-updates",
              str(args.updates), "--seed", str(seed), "--save-dir", save])
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    shutil.rmtree(save, ignore_errors=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"{name} (seed {seed}) failed:\n{log[-3000:]}")
    wps = [float(json.loads(m)["wps"]) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
    wps = wps or [float(json.loads(m)["train_wps"])
                  for m in re.findall(r"\| train \| (\{.*\})", log)]
    valid = [json.loads(m) for m in re.findall(r"\| valid \| (\{.*\})", log)]
    shared = re.search(r"num\. shared model params: ([\d,]+)", log)
    expert = re.search(r"num\. expert model params: ([\d,]+)", log)
    as_int = lambda m: int(m.group(1).replace(",", "")) if m else 0  # noqa: E731
    out = {"bpb": float(valid[-1]["valid_loss"]), "tok_s": statistics.median(wps),
           "dense": as_int(shared), "values": as_int(expert), "wall": time.time() - start,
           "usage": {k[len("valid_"):]: v for k, v in valid[-1].items() if k.endswith("_usage")}}
    print(f"{name}, seed {seed}: {out}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", default=LM_DATA, help="fairseq-preprocess'd bytes")
    ap.add_argument("--user-dir", default=USER_DIR, help="the plugin's --user-dir")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run per row and seed")
    ap.add_argument("--updates", type=int, default=1000, help="--max-update of every run")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    ap.add_argument("--lock", default=None, help="run each fairseq-train under `flock LOCK`")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    results = {name: [run(name, flags, args, s) for s in args.seeds]
               for name, flags in ROWS.items()}
    seeds = " / ".join(str(s) for s in args.seeds)
    lines = [f"| model | dense params | value params | valid bpb, seed {seeds} | "
             f"train tokens/s, seed {seeds} | valid usage per layer (seed {args.seeds[0]}) |",
             "|---|---|---|---|---|---|"]
    for name, rs in results.items():
        usage = ", ".join(f"{k} {float(v):.2f}" for k, v in rs[0]["usage"].items()) or "–"
        lines.append(f"| {name} | {rs[0]['dense']:,} | {rs[0]['values']:,} | "
                     + " / ".join(f"{r['bpb']:.3f}" for r in rs) + " | "
                     + " / ".join(f"{r['tok_s']:.0f}" for r in rs) + f" | {usage} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()

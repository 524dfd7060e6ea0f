#!/usr/bin/env python3
"""Average the weights of the last N fairseq checkpoints (Vaswani et al. 2017: "the last 5
checkpoints"), for generation.

    attnzoo-average-checkpoints --inputs checkpoints/wmt14_en_de/ARCH --last 5 \\
        --output checkpoints/wmt14_en_de/ARCH/checkpoint.avg5.pt
    attnzoo-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

A directory input selects its update checkpoints ``checkpoint_<epoch>_<updates>.pt`` (from
``--save-interval-updates``) with the highest update counts, or, when there are none, its epoch
checkpoints ``checkpoint<epoch>.pt`` with the highest epochs. Floating-point tensors are averaged
(accumulated in float64, stored in their own dtype); integer tensors (e.g. BatchNorm's
``num_batches_tracked``) and everything else come from the newest checkpoint. The output is that
newest checkpoint with the averaged weights and without the optimizer state: it is for
fairseq-generate, not for resuming training.

Checkpoints are read with torch's safe (weights-only) loader; importing fairseq_attnzoo allow-lists
the ``argparse.Namespace`` that fairseq checkpoints contain.
"""
from __future__ import annotations

import argparse
import pickle
import re
import sys
from pathlib import Path

from fairseq_attnzoo.cli import command

UPDATE_CKPT = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")
EPOCH_CKPT = re.compile(r"^checkpoint(\d+)\.pt$")


def select_checkpoints(directory: Path, last: int) -> list[Path]:
    """The ``last`` newest update checkpoints of ``directory`` (else epoch checkpoints), oldest
    first."""
    files = [p for p in directory.iterdir() if p.is_file()]
    by_update = sorted((int(m.group(2)), p) for p in files if (m := UPDATE_CKPT.match(p.name)))
    if not by_update:
        by_update = sorted((int(m.group(1)), p) for p in files if (m := EPOCH_CKPT.match(p.name)))
    return [p for _, p in by_update[-last:]]


def average_states(states: list[dict]) -> dict:
    """Average ``state["model"]`` over ``states`` (oldest first); returns a new state dict."""
    import torch

    keys = list(states[-1]["model"].keys())
    for i, s in enumerate(states):
        if list(s["model"].keys()) != keys:
            diff = set(s["model"]) ^ set(keys)
            raise ValueError(f"checkpoint {i} has different parameters ({sorted(diff)[:3]}...): "
                             f"average checkpoints of one model only")
    model = {}
    for k in keys:
        newest = states[-1]["model"][k]
        if torch.is_tensor(newest) and newest.is_floating_point():
            acc = torch.zeros(newest.shape, dtype=torch.float64)
            for s in states:
                acc += s["model"][k].to(torch.float64)
            model[k] = (acc / len(states)).to(newest.dtype)
        else:
            model[k] = newest
    out = {k: v for k, v in states[-1].items() if k not in ("model", "last_optimizer_state")}
    out["model"] = model
    return out


@command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Average the weights of fairseq checkpoints.")
    p.add_argument("--inputs", nargs="+", required=True,
                   help="checkpoint files, or one directory (its newest --last checkpoints)")
    p.add_argument("--last", type=int, default=5,
                   help="with a directory: how many of its newest checkpoints (default 5)")
    p.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    args = p.parse_args(argv)

    import torch

    inputs = [Path(x) for x in args.inputs]
    if len(inputs) == 1 and inputs[0].is_dir():
        paths = select_checkpoints(inputs[0], args.last)
        if not paths:
            print(f"error: no checkpoint_<epoch>_<updates>.pt or checkpoint<epoch>.pt in "
                  f"{inputs[0]}", file=sys.stderr)
            return 2
        if len(paths) < args.last:
            print(f"warning: only {len(paths)} checkpoints in {inputs[0]}, averaging those",
                  file=sys.stderr)
    else:
        paths = inputs
        missing = [str(x) for x in paths if not x.is_file()]
        if missing:
            print(f"error: not a file: {' '.join(missing)}", file=sys.stderr)
            return 2
    print("averaging " + " ".join(x.name for x in paths), flush=True)
    try:
        averaged = average_states([torch.load(x, map_location="cpu", weights_only=True)
                                   for x in paths])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (pickle.UnpicklingError, RuntimeError, OSError) as e:
        why = " ".join(str(e).split())[:300]
        print(f"error: cannot load a checkpoint ({why})", file=sys.stderr)
        return 2
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(args.output) + ".tmp")
    torch.save(averaged, tmp)
    tmp.replace(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

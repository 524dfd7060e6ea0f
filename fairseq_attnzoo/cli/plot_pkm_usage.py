#!/usr/bin/env python
"""Key usage of the product-key memories of a trained checkpoint.

Runs the model over a data split and accumulates, for every memory layer, the softmax weight Z_i
each of the |K| = n_keys² slots received. Prints XLM's two diagnostics per layer -- memory
usage (fraction of slots with Z_i > 0) and KL(z ‖ uniform) -- and writes a PNG with, per layer, a
histogram of the slot weights and a heatmap of Z over the n_keys × n_keys product-key grid
(slot a·n_keys + b at row a, column b; bright rows/columns = sub-keys that dominate).
Memories that read one shared value pool (Memory+, ``--pkm-shared-values``) are reported per
layer and, summed over those layers, for the pool as a whole (``shared pool``).

    attnzoo-plot pkm-usage --path checkpoints/checkpoint_best.pt \\
        --data data-bin/wikitext-103 --subset valid --out pkm_usage.png
"""

import argparse
import os

import torch

from fairseq_attnzoo.cli import command, output_file, require

USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the plugin package


def load(path, data, user_dir, cpu):
    from fairseq import checkpoint_utils, utils

    utils.import_user_module(argparse.Namespace(user_dir=user_dir))
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data})
    model = models[0].eval()
    if not cpu and torch.cuda.is_available():
        model = model.cuda()
    return model, task


def memories(model):
    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    return {name: m for name, m in model.named_modules() if isinstance(m, ProductKeyMemory)}


@torch.no_grad()
def collect(model, task, subset, max_tokens, max_batches=None):
    """Z per memory layer: {module name: float64 tensor [n_keys²]}; also the number of tokens."""
    from fairseq import utils

    from fairseq_attnzoo.modules.pkm import slot_counts

    mems = memories(model)
    if not mems:
        raise SystemExit("this checkpoint has no product-key memory layer")
    device = next(model.parameters()).device
    counts = {n: torch.zeros(m.size, dtype=torch.float64, device=device) for n, m in mems.items()}
    for name, m in mems.items():
        def add(indices, weights, name=name, size=m.size):
            counts[name] += slot_counts(indices, weights, size)
        m.usage_callback = add
    task.load_dataset(subset)
    itr = task.get_batch_iterator(
        dataset=task.dataset(subset), max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)
    tokens = 0
    for i, sample in enumerate(itr):
        if max_batches is not None and i >= max_batches:
            break
        sample = utils.move_to_cuda(sample) if device.type == "cuda" else sample
        model(**sample["net_input"])
        tokens += int(sample["ntokens"])
    return {n: c.cpu() for n, c in counts.items()}, mems, tokens


def add_pools(counts, mems):
    """Add one entry per value table read by several memories: the sum of their Z (the pool's
    usage as a whole). Returns the extended ``counts`` and ``mems`` (the pool entry maps to its
    first memory, for the grid size)."""
    by_table = {}
    for name, m in mems.items():
        by_table.setdefault(id(m.values), []).append(name)
    counts, mems = dict(counts), dict(mems)
    for names in by_table.values():
        if len(names) > 1:
            pool = "shared pool" if len(by_table) == 1 else f"shared pool of {names[0]}"
            counts[pool] = sum(counts[n] for n in names)
            mems[pool] = mems[names[0]]
    return counts, mems


def plot(counts, mems, out):
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's root logger is verbose
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_attnzoo.modules.pkm import usage_stats

    fig, axes = plt.subplots(len(counts), 2, figsize=(11, 4.2 * len(counts)), squeeze=False)
    for row, (name, z) in enumerate(counts.items()):
        usage, kl = usage_stats(z)
        n = mems[name].n_keys
        ax = axes[row][0]
        used = z[z > 0]
        if used.numel():
            ax.hist(torch.log10(used).numpy(), bins=60, color="tab:blue")
        ax.set_xlabel("log10 slot weight Z_i (used slots)")
        ax.set_ylabel("slots")
        ax.set_title(f"{name}: usage {usage:.1%} of {z.numel():,}, KL {kl:.3f}")
        ax = axes[row][1]
        im = ax.imshow(torch.log10(z.view(n, n) + 1e-6).numpy(), cmap="viridis",
                       interpolation="nearest")
        ax.set_xlabel("second sub-key b")
        ax.set_ylabel("first sub-key a")
        ax.set_title("log10(Z + 1e-6) over the product-key grid")
        fig.colorbar(im, ax=ax, fraction=0.046).set_label("log10(Z + 1e-6)")
    fig.tight_layout()
    fig.savefig(output_file(out), dpi=110)


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="fairseq checkpoint")
    p.add_argument("--data", required=True, help="binarised data directory of the checkpoint's task")
    p.add_argument("--subset", default="valid")
    p.add_argument("--user-dir", default=USER_DIR)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-batches", type=int, default=None, help="stop early (default: all)")
    p.add_argument("--out", default="pkm_usage.png",
                   help="PNG path; missing folders are created (default: %(default)s)")
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    require("matplotlib")
    from fairseq_attnzoo.modules.pkm import usage_stats

    model, task = load(a.path, a.data, a.user_dir, a.cpu)
    counts, mems, tokens = collect(model, task, a.subset, a.max_tokens, a.max_batches)
    counts, mems = add_pools(counts, mems)
    print(f"{tokens:,} tokens of '{a.subset}'")
    for name, z in counts.items():
        usage, kl = usage_stats(z)
        print(f"{name}: |K| {z.numel():,}  usage {usage:.4f}  KL {kl:.4f}")
    plot(counts, mems, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

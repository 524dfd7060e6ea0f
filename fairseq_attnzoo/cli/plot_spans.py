#!/usr/bin/env python
"""Learned attention spans per layer and head from an adaptive-span / All-Attention checkpoint.

Reads ``decoder.layers.<i>.attn.mask.span`` (z / S per head) and the model's S from the checkpoint
(no data needed), prints a table and writes a PNG: one group of bars per layer, one bar per head
(heads sorted by span, as in the paper's Figure 3), with the maximum span S as a dashed line.
For dynamic spans (``--adaptive-span-dynamic``) the span depends on the input; the plot shows
S * sigmoid(b), the span of an input the predictor maps to zero.

    attnzoo-plot spans checkpoints/demo_span/checkpoint_best.pt --out spans.png
"""

import argparse
import os
import re

import torch

from fairseq_attnzoo.cli import command, require, save_figure


def load_spans(path: str):
    """-> (S, R, [per layer: tensor of z per head]) from a fairseq checkpoint."""
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    cfg = state.get("cfg") or {}
    model_cfg = cfg["model"] if "model" in cfg else state.get("args")
    s = int(getattr(model_cfg, "attn_span", None) or model_cfg["attn_span"])
    r = int(getattr(model_cfg, "adaptive_span_ramp", 32) or 32)
    layers = {}
    for name, t in state["model"].items():
        m = re.match(r".*layers\.(\d+)\.attn\.mask\.(span|span_proj\.bias)$", name)
        if m:
            ratio = t.float().clamp(0, 1) if m.group(2) == "span" else torch.sigmoid(t.float())
            layers[int(m.group(1))] = ratio * s
    if not layers:
        raise SystemExit(f"{path} has no adaptive-span parameters "
                         "(decoder.layers.*.attn.mask.span)")
    return s, r, [layers[i] for i in sorted(layers)]


def format_spans(spans) -> str:
    """One line per layer: mean, max and the sorted spans of its heads."""
    lines = []
    for i, z in enumerate(spans):
        zs = sorted(z.tolist())
        lines.append(f"layer {i:2d}: mean {sum(zs) / len(zs):8.1f}  max {zs[-1]:8.1f}  "
                     + " ".join(f"{v:.0f}" for v in zs))
    return "\n".join(lines)


def plot_spans(s: int, r: int, spans, out: str, title: str) -> str:
    """Bars of the learned span per head (sorted), one group per layer; S dashed. -> out"""
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = max(len(z) for z in spans)
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * heads * len(spans) + 2), 4))
    width = 0.8 / heads
    for i, z in enumerate(spans):
        for h, v in enumerate(sorted(z.tolist())):
            ax.bar(i - 0.4 + (h + 0.5) * width, v, width=width * 0.9, color=f"C{i % 10}")
    ax.axhline(s, color="gray", linestyle="--", linewidth=1, label=f"maximum span S = {s}")
    ax.set_xticks(range(len(spans)))
    ax.set_xticklabels([str(i) for i in range(len(spans))])
    ax.set_xlabel("layer (bars: heads, sorted)")
    ax.set_ylabel("learned span z (positions)")
    if max(float(z.max()) for z in spans) > 0:
        ax.set_yscale("symlog", linthresh=max(1.0, r))
    ax.set_title(title)
    ax.legend(loc="upper left")
    return save_figure(fig, out)


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--out", default=None, help="PNG path (default: <checkpoint dir>/spans.png)")
    p.add_argument("--title", default=None, help="default: Adaptive attention spans: <checkpoint file>")
    a = p.parse_args(argv)
    require("matplotlib")
    s, r, spans = load_spans(a.checkpoint)
    print(f"S = {s}, R = {r}; span z per head (positions), sorted:")
    print(format_spans(spans))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.checkpoint)), "spans.png")
    plot_spans(s, r, spans, out,
               a.title or f"Adaptive attention spans: {os.path.basename(a.checkpoint)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

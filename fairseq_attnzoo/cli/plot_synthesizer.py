#!/usr/bin/env python
"""Plot the synthesized self-attention of a trained Synthesizer checkpoint, next to the dot-product
attention of a vanilla checkpoint on the same sentence, and print the learned mixture weights.

    attnzoo-plot synthesizer --checkpoint ckpt/synth/checkpoint_best.pt \\
        --data data-bin/demo --sentence "▁the ▁cat ▁sat" [--target "..."] \\
        [--vanilla-checkpoint ckpt/base/checkpoint_best.pt] [--spm-model spm.model] --out-dir plots

Works for translation checkpoints (encoder and decoder self-attention; the decoder runs on
--target, or on the model's own greedy translation) and language models (decoder only).
Writes ``<out>/synth_<side>.png`` (layers x heads), ``<out>/vanilla_<side>.png`` and
``<out>/compare_<side>.png`` (head-averaged maps side by side, one row per layer).
"""

import argparse
import logging
import os
from typing import Dict, List, Optional, Tuple

import torch
from fairseq import checkpoint_utils
from fairseq.modules import MultiheadAttention

from fairseq_attnzoo.cli import command, output_file, require, save_figure
from fairseq_attnzoo.models.synthesizer import format_mixture_weights
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

Maps = Dict[str, List[torch.Tensor]]  # side -> per layer [H, Tq, Tk]


def load(path: str, data: str):
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data})
    model = models[0].eval()
    return model, cfg, task


def encode(task, text: str, spm_model: Optional[str], source: bool) -> torch.Tensor:
    if spm_model:
        import sentencepiece as spm

        text = " ".join(spm.SentencePieceProcessor(model_file=spm_model).encode(text, out_type=str))
    d = task.source_dictionary if source else task.target_dictionary
    return d.encode_line(text, add_if_not_exist=False, append_eos=True).long()


class Recorder:
    """Captures per-head self-attention weights of every layer during one forward pass."""

    def __init__(self, model):
        self.maps: Maps = {"encoder": [], "decoder": []}
        self.handles = []
        self.synth: List[Tuple[str, SynthesizerAttention]] = []
        for name, m in model.named_modules():
            if not name.endswith("self_attn"):
                continue
            side = "encoder" if ".encoder." in f".{name}" else "decoder"
            if isinstance(m, SynthesizerAttention):
                m.keep_attention = True
                self.synth.append((side, m))
            elif isinstance(m, MultiheadAttention):
                # fairseq's fused path returns head-averaged weights only; its own path gives
                # per-head weights (skip_embed_dim_check only routes around the fused call)
                m.skip_embed_dim_check = True
                self.handles.append(
                    m.register_forward_pre_hook(self._want_weights, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._record(side)))

    @staticmethod
    def _want_weights(module, args, kwargs):
        kwargs["need_weights"] = kwargs["need_head_weights"] = True
        return args, kwargs

    def _record(self, side):
        def hook(module, args, output):
            self.maps[side].append(output[1][:, 0].detach().float())  # [H, B, Tq, Tk] -> [H,Tq,Tk]
        return hook

    def collect(self) -> Maps:
        for side, m in self.synth:
            self.maps[side].append(m.last_attention[0].float())
        return {k: v for k, v in self.maps.items() if v}


def greedy_target(model, task, src: torch.Tensor, max_len: int = 200) -> torch.Tensor:
    from fairseq.sequence_generator import SequenceGenerator

    gen = SequenceGenerator([model], task.target_dictionary, beam_size=1,
                            max_len_b=min(max_len, model.max_decoder_positions() - 1))
    sample = {"net_input": {"src_tokens": src[None], "src_lengths": torch.tensor([len(src)])}}
    return gen.generate([model], sample)[0][0]["tokens"]


def run(model, task, src: torch.Tensor, tgt: Optional[torch.Tensor]) -> Maps:
    rec = Recorder(model)
    eos = task.target_dictionary.eos()
    with torch.no_grad():
        if hasattr(model, "encoder"):
            prev = torch.cat([tgt.new_tensor([eos]), tgt[:-1]])[None]
            model(src[None], torch.tensor([len(src)]), prev)
        else:
            model(torch.cat([src.new_tensor([eos]), src[:-1]])[None])
    maps = rec.collect()
    for h in rec.handles:
        h.remove()
    return maps


def plot_grid(maps: List[torch.Tensor], labels_q, labels_k, title: str, path: str):
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers, n_heads = len(maps), max(m.size(0) for m in maps)
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(2.2 * n_heads, 2.2 * n_layers),
                             squeeze=False)
    for i, m in enumerate(maps):
        for h in range(n_heads):
            ax = axes[i][h]
            ax.imshow(m[h].numpy(), cmap="viridis", vmin=0)
            ax.set_xticks([]), ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"layer {i}\nquery position", fontsize=8)
            if i == n_layers - 1:
                ax.set_xlabel("key position", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=100)
    plt.close(fig)


def plot_compare(synth: List[torch.Tensor], vanilla: List[torch.Tensor], labels_q, labels_k,
                 side: str, path: str):
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(synth), len(vanilla))
    fig, axes = plt.subplots(n, 2, figsize=(10, 4 * n), squeeze=False)
    for col, (name, maps) in enumerate((("synthesizer", synth), ("vanilla", vanilla))):
        for i in range(n):
            ax = axes[i][col]
            if i >= len(maps):
                ax.axis("off")
                continue
            im = ax.imshow(maps[i].mean(0).numpy(), cmap="viridis", vmin=0)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label("attention weight",
                                                                        fontsize=8)
            ax.set_title(f"{name} {side} layer {i} (mean over heads)", fontsize=9)
            ax.set_xlabel("key", fontsize=8)
            ax.set_ylabel("query", fontsize=8)
            if len(labels_k) <= 40:
                ax.set_xticks(range(len(labels_k)), labels_k, rotation=90, fontsize=7)
                ax.set_yticks(range(len(labels_q)), labels_q, fontsize=7)
    fig.tight_layout(w_pad=3)
    fig.savefig(output_file(path), dpi=100)
    plt.close(fig)


def mixture_log(train_log: str) -> Dict[str, List[Tuple[int, float]]]:
    """The logged mixture weights ``mix_<side><layer>_<component>`` (alpha of the first
    component; the model logs them while training) from a ``--log-format json`` train log:
    {name: [(update, alpha)]}."""
    import json

    out: Dict[str, List[Tuple[int, float]]] = {}
    with open(train_log) as f:
        for line in f:
            if "train_inner" not in line or '"mix_' not in line:
                continue
            stats = json.loads(line[line.index("{"):])
            for key, value in stats.items():
                if key.startswith("mix_"):
                    out.setdefault(key, []).append((int(stats["num_updates"]), float(value)))
    return out


def plot_mixture_log(curves: Dict[str, List[Tuple[int, float]]], out: str, title: str) -> str:
    """alpha of the first mixture component per layer over training. -> out"""
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, points in sorted(curves.items()):
        ax.plot([u for u, _ in points], [v for _, v in points], marker=".", label=name[4:])
    ax.axhline(0.5, color="grey", linewidth=0.5, linestyle=":")
    first = sorted(curves)[0].rsplit("_", 1)[-1] if curves else "first"
    ax.set_xlabel("update")
    ax.set_ylabel(f"mixture weight α of the {first} component")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, title="layer", title_fontsize=8)
    return save_figure(fig, out)


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="Synthesizer checkpoint (.pt)")
    p.add_argument("--data", required=True, help="the data-bin directory (dictionaries)")
    p.add_argument("--sentence", required=True, help="source sentence (LM: the text)")
    p.add_argument("--target", default=None, help="translation checkpoints: target sentence for "
                   "the decoder (default: the model's greedy translation)")
    p.add_argument("--spm-model", default=None, help="sentencepiece model to encode the raw text "
                   "(default: the text is already tokenized as in the data)")
    p.add_argument("--vanilla-checkpoint", default=None, help="a dot-product attention checkpoint "
                   "on the same data, plotted next to the synthesizer")
    p.add_argument("--out-dir", default="synth_plots")
    args = p.parse_args(argv)
    require("matplotlib")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    os.makedirs(args.out_dir, exist_ok=True)

    model, cfg, task = load(args.checkpoint, args.data)
    print("mixture weights (alpha per component, per layer):")
    print(format_mixture_weights(model))

    is_mt = hasattr(model, "encoder")
    src = encode(task, args.sentence, args.spm_model, source=True)
    tgt = None
    if is_mt:
        tgt = (encode(task, args.target, args.spm_model, source=False) if args.target
               else greedy_target(model, task, src))
    labels = {"encoder": [task.source_dictionary[i] for i in src]}
    dec_tokens = tgt if is_mt else src
    prev = [task.target_dictionary.eos()] + dec_tokens[:-1].tolist()
    labels["decoder"] = [task.target_dictionary[i] for i in prev]

    synth = run(model, task, src, tgt)
    vanilla: Maps = {}
    if args.vanilla_checkpoint:
        vmodel, _, vtask = load(args.vanilla_checkpoint, args.data)
        vanilla = run(vmodel, vtask, src, tgt)
    for side, maps in synth.items():
        lab = labels[side]
        path = os.path.join(args.out_dir, f"synth_{side}.png")
        plot_grid(maps, lab, lab, f"synthesizer {side} self-attention ({cfg.model.arch})", path)
        print(f"wrote {path}")
        if side in vanilla:
            path = os.path.join(args.out_dir, f"vanilla_{side}.png")
            plot_grid(vanilla[side], lab, lab, f"vanilla {side} self-attention", path)
            print(f"wrote {path}")
            path = os.path.join(args.out_dir, f"compare_{side}.png")
            plot_compare(maps, vanilla[side], lab, lab, side, path)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

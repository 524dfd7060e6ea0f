#!/usr/bin/env python3
"""Energy spectrum of the key/query products of a trained model (Cordonnier et al. 2020, Fig. 1).

For every attention layer with concatenated heads, the heads' key/query products are concatenated:

    P = [W_Q,1 W_K,1ᵀ, ..., W_Q,H W_K,Hᵀ]   (d x H·d)

and its principal components are computed (singular values σ_k of P; ``--center`` subtracts the
column mean first, i.e. classical PCA). The captured energy of the first k components,
Σ_{j<=k} σ_j² / Σ_j σ_j², is plotted against k, one curve per layer. Each W_Q,i W_K,iᵀ has rank
d_k, and W_Q = [W_Q,1 ... W_Q,H] alone is usually full rank (``--with-projections`` draws its
spectrum dashed); a steep product curve means that the heads use a shared, low-dimensional
query/key subspace, i.e. that collaborative heads with a small D̃k lose little.

For collaborative layers (``transformer_collab`` checkpoints) the products are
W̃Q diag(m_i) W̃Kᵀ and the same curve is drawn.

    attnzoo-plot qk-spectrum checkpoints/vanilla/checkpoint_best.pt -o qk_spectrum.png
"""

import argparse
import os
import re

from fairseq_attnzoo.cli import command, require, save_figure

ATTN = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(self_attn|encoder_attn)\.q_proj\.weight$")
THRESHOLDS = (0.9, 0.95, 0.99)


def product_gram(state, prefix: str, num_heads: int):
    """P Pᵀ [d, d] for the concatenated products (never forms the d x H·d matrix), and the
    query projection [d, Dk] for reference."""
    import torch

    wq = state[f"{prefix}.q_proj.weight"].double()
    wk = state[f"{prefix}.k_proj.weight"].double()
    mixing = state.get(f"{prefix}.mixing")
    if mixing is not None:  # collaborative: W_Q,i = W̃Q diag(m_i), W_K,i = W̃K
        m = mixing.double()
        A = wq.t()[None] * m[:, None, :]  # [H, d, D̃k]
        B = wk.t()[None].expand(m.size(0), -1, -1)
    else:
        dk = wq.size(0) // num_heads
        A = wq.view(num_heads, dk, -1).transpose(1, 2)  # W_Q,i [H, d, dk]
        B = wk.view(num_heads, dk, -1).transpose(1, 2)
    gram = torch.einsum("hdr,hrs,hes->de", A, B.transpose(1, 2) @ B, A)  # Σ_i T_i T_iᵀ
    return gram, wq.t()


def energy_curve(gram):
    """Cumulative captured energy from a Gram matrix P Pᵀ (eigenvalues = σ²)."""
    import torch

    ev = torch.linalg.eigvalsh(gram).flip(0).clamp(min=0)
    return (torch.cumsum(ev, 0) / ev.sum().clamp(min=1e-300)).numpy()


def spectra(state, model_cfg, center: bool = False):
    """{layer name: (product curve, W_Q curve)} in model order."""
    import torch

    out = {}
    keys = sorted((k for k in state if ATTN.match(k)),
                  key=lambda k: (k.split(".")[0] != "encoder", int(k.split(".")[2]),
                                 "encoder_attn" in k))
    for key in keys:
        prefix = key[: -len(".q_proj.weight")]
        side = prefix.split(".")[0]
        heads = int(getattr(model_cfg, f"{side}_attention_heads"))
        gram, wq = product_gram(state, prefix, heads)
        if center:  # PCA: centre the columns of P (P 1 / n is the mean column)
            n = heads * state[f"{prefix}.k_proj.weight"].size(1)
            mean = _product_col_sum(state, prefix, heads) / n
            gram = gram - n * torch.outer(mean, mean)
            wq = wq - wq.mean(1, keepdim=True)
        short = prefix.replace("layers.", "").replace("self_attn", "self").replace(
            "encoder_attn", "cross")
        out[short] = (energy_curve(gram), energy_curve(wq @ wq.t()))
    return out


def _product_col_sum(state, prefix, heads):
    # P 1 = Σ_i W_Q,i (W_K,iᵀ 1)
    import torch

    wq = state[f"{prefix}.q_proj.weight"].double()
    wk = state[f"{prefix}.k_proj.weight"].double()
    mixing = state.get(f"{prefix}.mixing")
    if mixing is not None:
        return wq.t() @ (mixing.double().sum(0) * wk.sum(1))
    dk = wq.size(0) // heads
    return torch.einsum("hrd,hr->d", wq.view(heads, dk, -1), wk.view(heads, dk, -1).sum(-1))


def components_for(curve, fraction: float) -> int:
    import numpy as np

    return int(np.searchsorted(curve, fraction - 1e-12) + 1)


def load_curves(path: str, center: bool = False):
    """{layer: (product curve, W_Q curve)} of a checkpoint (see :func:`spectra`); {} when it has
    no attention layer with q_proj/k_proj."""
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    cfg = state["cfg"]
    model_cfg = cfg["model"] if hasattr(cfg, "__getitem__") else cfg.model
    return spectra(state["model"], model_cfg, center=center)


def draw_curves(ax, curves, with_projections: bool = False, title: str = ""):
    """One captured-energy curve per layer on ``ax`` (dashed: concatenated W_Q)."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    for n, (name, (prod, wq)) in enumerate(curves.items()):
        color = cmap(n / max(1, len(curves) - 1))
        ax.plot(range(1, len(prod) + 1), prod, color=color, label=name)
        if with_projections:
            ax.plot(range(1, len(wq) + 1), wq, color=color, linestyle="--", linewidth=0.8)
    ax.axhline(0.95, color="grey", linewidth=0.5, linestyle=":")
    ax.set_xlabel("number of principal components")
    ax.set_ylabel("captured energy")
    ax.set_title(title or "key/query products [W_Q,i W_K,iᵀ]_i"
                 + (" (dashed: concat. W_Q)" if with_projections else ""), fontsize=10)
    ax.set_ylim(0, 1.01)
    ax.legend(fontsize=7, ncol=2, loc="lower right")


def format_table(curves) -> str:
    lines = ["| layer | " + " | ".join(f"PCs for {int(t * 100)}% energy" for t in THRESHOLDS)
             + " | d |", "|---|" + "---|" * (len(THRESHOLDS) + 1)]
    for name, (prod, _) in curves.items():
        lines.append(f"| {name} | " + " | ".join(str(components_for(prod, t)) for t in THRESHOLDS)
                     + f" | {len(prod)} |")
    return "\n".join(lines)


def plot_panels(panels, out: str, with_projections: bool = False) -> str:
    """Side-by-side spectra: ``panels`` = [(title, curves)], e.g. a model before and after its
    conversion to collaborative heads. -> out"""
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.4), squeeze=False,
                             sharey=True)
    for ax, (title, curves) in zip(axes[0], panels):
        draw_curves(ax, curves, with_projections, title)
    return save_figure(fig, out)


@command
def main(argv=None):
    p = argparse.ArgumentParser(description="Energy spectrum of concatenated key/query products "
                                "W_Q,i W_K,iᵀ per attention layer (paper Figure 1)")
    p.add_argument("checkpoint", help="fairseq checkpoint (transformer*, attnzoo_*, collab)")
    p.add_argument("-o", "--output", default="qk_spectrum.png", help="PNG path (default: %(default)s)")
    p.add_argument("--center", action="store_true", help="centre columns first (classical PCA)")
    p.add_argument("--with-projections", action="store_true",
                   help="also draw the spectrum of the concatenated W_Q (dashed)")
    args = p.parse_args(argv)
    require("matplotlib")
    if not os.path.isfile(args.checkpoint):
        p.error(f"checkpoint {args.checkpoint!r} not found: expected a fairseq .pt file")
    curves = load_curves(args.checkpoint, center=args.center)
    if not curves:
        p.error("no attention layers with q_proj/k_proj found: expected a transformer checkpoint")
    print(format_table(curves))
    plot_panels([("", curves)], args.output, args.with_projections)
    print(f"wrote {args.output}")
    return curves


if __name__ == "__main__":
    main()

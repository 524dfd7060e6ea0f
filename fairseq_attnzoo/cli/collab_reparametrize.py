#!/usr/bin/env python3
"""Re-parametrise a trained transformer into collaborative heads (arch ``transformer_collab``).

Input: a checkpoint of fairseq's ``transformer`` (any of its archs) or of ``attnzoo_transformer``
whose attention slots are stock (``mha``/``sdpa``). For every attention layer (encoder self,
decoder self, cross) the per-head key/query products are stacked into T [H, d, d],
T_i = W_Q,i W_K,iᵀ, and decomposed at rank D̃k (``--key-dim``):

    T_i ≈ W̃Q diag(m_i) W̃Kᵀ          (CP / PARAFAC; W̃Q: d x D̃k, M: H x D̃k, W̃K: d x D̃k)

* D̃k = H·d_k (the model's key dimension): the exact block construction (W̃Q, W̃K = the
  concatenated W_Q, W_K, block one-hot M): the converted model computes the same outputs.
* D̃k < H·d_k: CP by alternating least squares, started from the D̃k largest singular triplets
  over all heads. ``--solver als`` (default) runs the ALS updates on the per-head factors (the
  dense tensor is never formed: ~H·d·d_k·D̃k work per sweep); ``--solver tensorly`` runs
  ``tensorly.decomposition.parafac`` on the dense tensor from the same start (same iterates,
  ~8x slower at base size).

Biases: b_Q enters the logits of head i as b_Q,i W_K,iᵀ x_k, a key-only term: it becomes the
content bias (Linear d -> H). b_K only adds x_q-dependent constants over the keys, which cancel
in the softmax: it is dropped. Values and output projections are copied. The optimizer state is
dropped (its shapes no longer match); fine-tune with ``--finetune-from-model OUT``.

Example::

    attnzoo-collab-reparametrize checkpoints/vanilla/checkpoint_best.pt \\
        checkpoints/collab64/converted.pt --key-dim 64
    fairseq-generate DATA --user-dir fairseq_attnzoo --path checkpoints/collab64/converted.pt ...

It prints the ``fairseq-train`` command that fine-tunes the converted model: the checkpoint's own
data, task, model sizes, criterion, optimizer and schedule (every stored setting that differs from
the defaults), ``--arch transformer_collab`` and ``--finetune-from-model OUT`` (fairseq refuses
a missing OUT, where ``--restore-file`` would train from scratch), with ``--save-dir`` next to OUT
(``--finetune-save-dir`` to change it). Add e.g. ``--max-update N
--lr X`` to shorten the schedule (later flags win).
"""

import argparse
import os
import re
import time

from fairseq_attnzoo.cli import command
from fairseq_attnzoo.cli.progress import add_progress_flag, configure_progress

ATTN_KEY = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(self_attn|encoder_attn)\.q_proj\.weight$")
STOCK_ATTN = ("mha", "sdpa")  # concatenated heads with q_proj/k_proj/v_proj/out_proj
SLOT_FLAGS = ("encoder_self_attn", "decoder_self_attn", "cross_attn")
SUPPORTED_MODELS = ("transformer", "attnzoo_transformer")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0 or str(value) != text.strip():
        raise argparse.ArgumentTypeError(f"expected a positive integer (D̃k), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Convert a trained transformer checkpoint into transformer_collab "
        "(collaborative heads, Cordonnier et al. 2020) by CP decomposition.")
    p.add_argument("input", help="checkpoint of arch transformer* or attnzoo_transformer")
    p.add_argument("output", help="where to write the transformer_collab checkpoint")
    p.add_argument("--key-dim", type=positive_int, required=True, metavar="D̃k",
                   help="shared key/query dimension D̃k, 1 .. H·d_k (= d_model for fairseq models)")
    p.add_argument("--solver", choices=("als", "tensorly"), default="als",
                   help="CP solver: structured ALS on the per-head factors (fast) or "
                   "tensorly.decomposition.parafac on the dense tensor (default: als)")
    p.add_argument("--n-iter-max", type=int, default=50,
                   help="maximum ALS sweeps per layer (default: 50)")
    p.add_argument("--tol", type=float, default=1e-5,
                   help="stop when the relative error improves by less than this (default: 1e-5)")
    p.add_argument("--finetune-save-dir", default=None, metavar="DIR",
                   help="--save-dir of the printed fine-tune command (default: finetune/ in the "
                   "output's folder)")
    add_progress_flag(p)
    p.add_argument("--quiet", dest="no_progress", action="store_true",
                   help="same as --no-progress")
    return p


def _model_cfg(state):
    cfg = state.get("cfg")
    model_cfg = None if cfg is None else cfg.get("model") if hasattr(cfg, "get") else cfg.model
    return model_cfg


def _arch_of(model_cfg):
    return getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)


def check_supported(parser, model_cfg):
    """One-line parser.error unless the checkpoint is a (zoo) transformer with stock attention."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = _arch_of(model_cfg) if model_cfg is not None else None
    model = ARCH_MODEL_NAME_REGISTRY.get(arch, arch)
    if model not in SUPPORTED_MODELS:
        parser.error(f"unsupported arch {arch!r}: expected a checkpoint of fairseq's transformer "
                     "(any transformer_* arch) or attnzoo_transformer with stock attention")
    if model == "attnzoo_transformer":
        for flag in SLOT_FLAGS:
            names = set(str(getattr(model_cfg, flag, None) or "mha").split(","))
            if not names <= set(STOCK_ATTN):
                parser.error(f"unsupported --{flag.replace('_', '-')} {','.join(sorted(names))!r} "
                             f"in {arch!r}: expected concatenated heads ({'/'.join(STOCK_ATTN)})")
    return arch


def attention_layers(model_state, model_cfg):
    """[(prefix, num_heads)] of every attention module in the state dict, in model order."""
    out = []
    for key in model_state:
        m = ATTN_KEY.match(key)
        if m:
            side = m.group(1)
            heads = int(getattr(model_cfg, f"{side}_attention_heads"))
            out.append((key[: -len(".q_proj.weight")], heads))
    order = {"encoder": 0, "decoder": 1}
    out.sort(key=lambda x: (order[x[0].split(".")[0]], int(x[0].split(".")[2]),
                            x[0].endswith("encoder_attn")))
    return out


def decompose(wq, wk, num_heads: int, key_dim: int, solver: str, n_iter_max: int, tol: float):
    """CP factors (or None for the exact block construction) and the relative error of T."""
    from fairseq_attnzoo.modules.collab import balance_cp, cp_heads, cp_init_heads, head_projections

    if key_dim == wq.size(0):
        return None, 0.0, 0
    A, B = head_projections(wq.double(), wk.double(), num_heads)
    if solver == "als":
        cp = cp_heads(A, B, key_dim, n_iter_max=n_iter_max, tol=tol)
        return (cp.W_Q, cp.mixing, cp.W_K), cp.rel_error, cp.iterations
    import torch

    from fairseq_attnzoo.cli import require

    tl = require("tensorly")
    from tensorly.cp_tensor import CPTensor
    from tensorly.decomposition import parafac

    tl.set_backend("pytorch")
    T = A @ B.transpose(1, 2)  # [H, d, kdim]
    init = CPTensor((A.new_ones(key_dim), list(cp_init_heads(A, B, key_dim))))
    (weights, (M, P, C)), errors = parafac(T, key_dim, n_iter_max=n_iter_max, init=init, tol=tol,
                                           return_errors=True)
    M = M * weights[None, :]
    rel = float((T - torch.einsum("hr,jr,kr->hjk", M, P, C)).norm() / T.norm())
    M, P, C = balance_cp(M, P, C, A, B)
    return (P, M, C), rel, len(errors)


def convert(state, key_dim: int, solver: str = "als", n_iter_max: int = 50, tol: float = 1e-5,
            progress: bool = True, parser=None):
    """Convert a loaded checkpoint ``state`` (as from ``checkpoint_utils.load_checkpoint_to_cpu``)
    in place. Returns per-layer rows (name, heads, key dim, rel. error, sweeps, seconds)."""
    from fairseq_attnzoo.modules.collab import collab_state_from_mha

    parser = parser or build_parser()
    model_cfg = _model_cfg(state)
    check_supported(parser, model_cfg)
    model_state = state["model"]
    layers = attention_layers(model_state, model_cfg)
    if not layers:
        parser.error("no attention layers (…q_proj.weight) found in the checkpoint: expected a "
                     "transformer encoder-decoder state dict")
    full = min(model_state[f"{p}.q_proj.weight"].size(0) for p, _ in layers)
    if key_dim > full:
        parser.error(f"--key-dim {key_dim} is above the model's key dimension H·d_k = {full}: "
                     f"expected 1 <= D̃k <= {full}")
    rows = []
    from fairseq_attnzoo.cli.progress import progress as progress_bar

    it = progress_bar(layers, desc=f"CP rank {key_dim}", unit="layer") if progress else layers
    for prefix, heads in it:
        t0 = time.perf_counter()
        old = {k[len(prefix) + 1:]: v for k, v in model_state.items() if k.startswith(prefix + ".")}
        wq, wk = old["q_proj.weight"], old["k_proj.weight"]
        factors, rel, sweeps = decompose(wq, wk, heads, key_dim, solver, n_iter_max, tol)
        kw = {} if factors is None else dict(W_Q=factors[0], mixing=factors[1], W_K=factors[2])
        new = collab_state_from_mha({k: v.double() for k, v in old.items()}, heads, **kw)
        for k in old:
            del model_state[f"{prefix}.{k}"]
        for k, v in new.items():
            model_state[f"{prefix}.{k}"] = v.to(wq.dtype).contiguous()
        rows.append((prefix, heads, wq.size(0), rel, sweeps, time.perf_counter() - t0))
    _set_collab_cfg(model_cfg, key_dim)
    state["last_optimizer_state"] = None  # Adam moments of the old shapes; nothing to resume
    extra = state.get("extra_state") or {}
    extra.pop("ema", None)  # an EMA copy of the old parameters would not load either
    state["args"] = None
    return rows


def _set_collab_cfg(model_cfg, key_dim: int):
    from omegaconf import OmegaConf, open_dict
    from contextlib import ExitStack

    values = dict(_name="transformer_collab", arch="transformer_collab", encoder_self_attn="collab",
                  decoder_self_attn="collab", cross_attn="collab", collab_key_dim=key_dim,
                  collab_mixing_init="concatenate")
    with open_dict(model_cfg) if OmegaConf.is_config(model_cfg) else ExitStack():
        for k, v in values.items():
            setattr(model_cfg, k, v)


def count_params(model_state) -> int:
    """Parameters in a state dict, shared tensors (tied embeddings) once, as fairseq-train counts."""
    seen, total = set(), 0
    for name, t in model_state.items():
        if name.endswith(("_float_tensor", ".version")) or not t.is_floating_point():
            continue
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel()
    return total


def format_rows(rows, key_dim: int) -> str:
    lines = ["| layer | heads | Dk -> D̃k | rel. error of T | ALS sweeps | seconds |",
             "|---|---|---|---|---|---|"]
    for prefix, heads, dk_all, rel, sweeps, sec in rows:
        lines.append(f"| {prefix} | {heads} | {dk_all} -> {key_dim} | {rel:.4f} | {sweeps} | {sec:.2f} |")
    return "\n".join(lines)


@command
def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_progress(args)
    if args.n_iter_max < 0:
        parser.error(f"--n-iter-max must be >= 0, got {args.n_iter_max}")
    if not os.path.isfile(args.input):
        parser.error(f"input checkpoint {args.input!r} not found: expected a fairseq .pt file")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        parser.error("output must differ from input (the input checkpoint is kept)")
    t0 = time.perf_counter()
    import torch

    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(args.input)
    except Exception as e:  # not a checkpoint at all
        parser.error(f"cannot read {args.input!r} as a fairseq checkpoint ({type(e).__name__}): "
                     "expected a .pt file written by fairseq-train")
    before = count_params(state["model"])
    rows = convert(state, args.key_dim, args.solver, args.n_iter_max, args.tol,
                   progress=not args.no_progress, parser=parser)
    if OmegaConf.is_config(state.get("cfg")):
        state["cfg"] = OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    torch.save(state, args.output)
    total = time.perf_counter() - t0
    print(format_rows(rows, args.key_dim))
    errs = [r[3] for r in rows]
    print(f"converted {len(rows)} attention layers to D̃k = {args.key_dim} "
          f"(mean rel. error {sum(errs) / len(errs):.4f}, max {max(errs):.4f}) in {total:.1f} s "
          f"-> {args.output}")
    print(f"converted model params: {count_params(state['model']):,} (original {before:,})")
    print("fine-tune: " + finetune_command(state["cfg"], args.output, args.finetune_save_dir))
    return rows


def finetune_command(cfg, output: str, save_dir=None) -> str:
    """The complete ``fairseq-train`` command that fine-tunes the converted checkpoint ``output``
    with the settings stored in its ``cfg`` (see the module docstring)."""
    from fairseq_attnzoo.cli.train_command import format_command, training_command

    output = os.path.abspath(output)
    save_dir = save_dir or os.path.join(os.path.dirname(output), "finetune")
    # --finetune-from-model (not --restore-file): fairseq refuses a path that does not exist
    # instead of training a randomly initialised model, resets optimizer, schedule, meters and
    # data iterator itself, and a restarted run resumes from the save dir's checkpoint_last.pt
    extra = ["--save-dir", save_dir, "--finetune-from-model", output]
    return format_command("fairseq-train", training_command(cfg, "transformer_collab", extra))


def cli_main():
    """Console entry point (``main`` returns the per-layer rows for callers)."""
    main()
    return 0


if __name__ == "__main__":
    cli_main()

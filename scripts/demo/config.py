"""The demo size and the flags of every demo row, shared by the demo (scripts/demo/demo.py), its
picture report (scripts/demo/report.py) and the benchmark's precision cases
(scripts/bench/cases.py).

The rows come from the arch registry (:func:`fairseq_attnzoo.cli.archs.zoo_archs`): every zoo
translation arch (plus fairseq's stock ``transformer``) is an MT row, every stream-LM arch a
character-LM row. Each gets the shared demo size and, per method it uses (its sublayers, read
from the registry), the method's own flags at that size (:data:`METHOD_FLAGS`). Only the rows
that are experiments rather than archs (a conversion, a fine-tune, a control) are listed by hand
(:data:`DERIVED`).
"""

import os
import shlex
import sys
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(REPO, "fairseq_attnzoo")

# one model size for every MT arch: d 128, ffn 512, 4 heads, 2+2 layers, shared embeddings.
# Tuned for a short CPU budget on this corpus (measured, docs/demo_results.md): residual dropout 0
# (a 2-epoch run underfits; 0.1 cost ~3 valid ppl at 1,500 updates), Adam lr 2e-3 with post-norm
# (1e-3 and 4e-3 were clearly worse, pre-norm at 3e-3 slightly worse).
COMMON = ("--encoder-embed-dim 128 --encoder-ffn-embed-dim 512 --encoder-attention-heads 4 "
          "--encoder-layers 2 --decoder-embed-dim 128 --decoder-ffn-embed-dim 512 "
          "--decoder-attention-heads 4 --decoder-layers 2 --share-all-embeddings "
          "--dropout 0.0 --attention-dropout 0.1 --weight-decay 0.0001 "
          "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 "
          "--optimizer adam --adam-betas (0.9,0.98) --lr 0.002 --lr-scheduler inverse_sqrt "
          "--warmup-updates 300 --clip-norm 1.0 --max-tokens 1024 --max-source-positions 256 "
          "--max-target-positions 256 --skip-invalid-size-inputs-valid-test")

# method (a sublayer name or its prefix, or a stream-LM model family) -> its flags at demo size
# (each method's docs/ page explains them). AOP: exactly the FFN's 131,072 weights at d 128 /
# d_ff 512 (h_p d_pk = d, n_p = 384); PKM: 16,384 slots with sparse value updates.
METHOD_FLAGS = {
    "synth": "--synth-max-len 256",
    "aop": "--aop-heads 4 --aop-key-dim 32 --aop-value-dim 32 --aop-slots 384",
    "pkm": "--pkm-n-keys 128 --pkm-k-dim 64 --pkm-heads 4 --pkm-knn 16 --optimizer pkm_adam "
           "--pkm-values-lr 0.005",
    "collab": "--collab-key-dim 128",  # D~k = H d_k at this size
    "adaptive_span": "--decoder-ffn-embed-dim 512",
    "all_attention": "--persistent-memory-size 512 --no-layer-spans",
}

# rows that are experiments on top of an arch: a re-parametrised checkpoint, a fine-tune, a control
DERIVED = {
    "transformer_collab64": {"arch": "transformer_collab", "flags": "--collab-key-dim 64",
                             "notes": "collaborative heads from scratch, D~k 64 (half)"},
    # re-parametrise the vanilla checkpoint (CP decomposition), then fine-tune it
    "collab_convert64": {"from": "transformer", "notes": "vanilla converted to D~k 64, no fine-tune",
                         "convert": "-m fairseq_attnzoo.cli.collab_reparametrize {src} {out} "
                                    "--key-dim 64 --quiet"},
    "collab_convert32": {"from": "transformer", "notes": "vanilla converted to D~k 32, no fine-tune",
                         "convert": "-m fairseq_attnzoo.cli.collab_reparametrize {src} {out} "
                                    "--key-dim 32 --quiet"},
    "collab_convert64_ft": {"arch": "transformer_collab", "from": "collab_convert64",
                            "flags": "--collab-key-dim 64 --lr 0.0005 --warmup-updates 50",
                            "max_update": 300, "notes": "converted D~k 64 + 300 fine-tune updates"},
    # control for the fine-tune row: the vanilla model given the same 300 extra updates
    "transformer_cont300": {"arch": "transformer", "from": "transformer",
                            "flags": "--lr 0.0005 --warmup-updates 50", "max_update": 300,
                            "notes": "vanilla + the same 300 updates (control for the fine-tune)"},
}

# character LMs on the gensim Wikipedia extract (enwik8 format): a short run each, valid bpc
LM_DATA = os.path.join(REPO, "data/wiki-gensim/bin")
LM_COMMON = ("--task attnzoo_stream_lm --tokens-per-sample 128 --batch-size 8 --batch-size-valid 8 "
             "--decoder-layers 4 --decoder-embed-dim 128 --decoder-attention-heads 4 --attn-span 512 "
             "--dropout 0 --criterion attnzoo_span_loss --optimizer adagrad_clip --lr 0.07 "
             "--lr-scheduler fixed --warmup-updates 100")


def method_flags(arch: str) -> List[str]:
    """The demo-size flags of every method ``arch`` uses (from the registry)."""
    from fairseq_attnzoo.cli.archs import methods

    flags: List[str] = []
    for method in methods(arch):
        for key, value in METHOD_FLAGS.items():
            if method == key or method.startswith(key + "_"):
                flags += shlex.split(value)
                break
    return flags


def _notes(arch: str) -> str:
    from fairseq_attnzoo.cli.archs import methods
    from fairseq_attnzoo.models.sublayers import SUBLAYER_REGISTRY

    used = methods(arch)
    if not used:
        return "same model through the extension point"
    return "; ".join(SUBLAYER_REGISTRY[m].description.split(" (")[0] if m in SUBLAYER_REGISTRY
                     else m.replace("_", " ") for m in used)


def mt_rows() -> Dict[str, dict]:
    """name -> row spec of every MT row: fairseq's stock transformer, every zoo translation arch,
    then the derived rows."""
    from fairseq_attnzoo.cli.archs import zoo_archs

    rows = {"transformer": {"flags": "", "notes": "stock fairseq transformer (baseline)"}}
    for arch in zoo_archs(task="translation"):
        rows[arch] = {"flags": " ".join(shlex.quote(f) for f in method_flags(arch)),
                      "notes": _notes(arch)}
    rows.update(DERIVED)
    return rows


def lm_rows() -> Dict[str, dict]:
    """name -> row spec of every character-LM row (the stream-LM archs of the registry)."""
    from fairseq_attnzoo.cli.archs import zoo_archs

    return {arch: {"flags": " ".join(method_flags(arch)), "notes": _notes(arch)}
            for arch in zoo_archs(task="attnzoo_stream_lm")}


def fairseq_bin(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def train_cmd(arch, spec, data, save, max_update, seed, restore=None):
    cmd = [fairseq_bin("fairseq-train"), data, "--user-dir", USER_DIR, "--arch",
           spec.get("arch", arch), "--task", "translation", "--save-dir", save,
           "--max-update", str(max_update), "--seed", str(seed), "--log-format", "json",
           "--log-interval", "100", "--no-epoch-checkpoints", "--keep-last-epochs", "1",
           "--num-workers", "0", "--cpu", "--validate-interval-updates", str(max_update)]
    cmd += shlex.split(COMMON) + shlex.split(spec.get("flags", ""))
    if restore:  # fine-tune a derived checkpoint: fresh optimizer, schedule and data order
        cmd += ["--restore-file", restore, "--reset-optimizer", "--reset-dataloader",
                "--reset-meters", "--reset-lr-scheduler"]
    return cmd


def lm_cmd(arch, spec, save, max_update, seed):
    cmd = [fairseq_bin("fairseq-train"), LM_DATA, "--user-dir", USER_DIR, "--arch", arch, "--cpu",
           "--save-dir", save, "--max-update", str(max_update), "--seed", str(seed),
           "--log-format", "json", "--log-interval", "100", "--num-workers", "0",
           "--no-epoch-checkpoints", "--validate-interval-updates", str(max_update)]
    return cmd + shlex.split(LM_COMMON) + shlex.split(spec.get("flags", ""))


def make_command(archs, lm_archs) -> str:
    """The ``make demo`` command that trains these rows."""
    return f"make demo ARCHS=\"{' '.join(archs)}\" LM_ARCHS=\"{' '.join(lm_archs) or 'none'}\""

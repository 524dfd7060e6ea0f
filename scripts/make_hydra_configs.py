#!/usr/bin/env python
"""Generate the fairseq-hydra-train configs from the shell recipes (one source of truth).

Each recipe prints its fairseq-train command with ``DRY_RUN=1`` (for one GPU, everything else at
the recipe's defaults); the command is parsed with fairseq's own parser and converted with
fairseq's ``convert_namespace_to_omegaconf``, and the flags the recipe sets are written, section by
section, to ``examples/<recipe>/config/<name>.yaml``. The model's size keys are written too, so
that ``model.decoder_layers=4`` overrides them without hydra's ``+``.

    python -m scripts.make_hydra_configs            # (re)write every config (repository root)
    python -m scripts.make_hydra_configs --check    # exit 1 if a config differs from its recipe

The archs come from the registry (:func:`fairseq_attnzoo.cli.archs.zoo_archs`): every translation
arch (and fairseq's ``transformer``) for the WMT recipe, every language-modelling arch for the
WikiText-103 recipe.

Train with one (from the repository root)::

    fairseq-hydra-train --config-dir examples/wmt14_en_de/config --config-name transformer_synth_dense \\
        task.data=data/wmt14_en_de/bin
"""

import argparse
import os
import shlex
import subprocess
import sys
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENWIK8_CONFIGS = ("adaptive_span_small", "adaptive_span", "adaptive_span_large", "all_attention",
                  "all_attention_large")

# fairseq's config groups in the order they are written; a flag goes to the first that has it
SECTIONS = ("common", "distributed_training", "dataset", "optimization", "checkpoint", "task",
            "criterion", "optimizer", "lr_scheduler")
NAMED = {"task": "task", "criterion": "criterion", "optimizer": "optimizer",
         "lr_scheduler": "lr_scheduler"}
# where fairseq-hydra-train writes its log (hydra_train.log) and the composed config (.hydra/)
HYDRA_RUN_DIR = "${checkpoint.save_dir}/hydra/${now:%Y-%m-%d_%H-%M-%S}"
SIZES = ("encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_layers", "encoder_attention_heads",
         "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads")


def recipes() -> List[Tuple[str, str, List[str], Dict[str, str], int]]:
    """(config path, recipe, argv, environment, which printed command) for every config."""
    from fairseq_attnzoo.cli.archs import zoo_archs

    out = []
    for arch in ["transformer"] + zoo_archs(task="translation"):
        out.append((f"examples/wmt14_en_de/config/{arch}.yaml", "examples/wmt14_en_de/train.sh",
                    [arch], {}, 0))
    for name in ENWIK8_CONFIGS:
        out.append((f"examples/enwik8/config/{name}.yaml", "examples/enwik8/train.sh", [name], {},
                    0))
        if name != "adaptive_span_small" and name != "adaptive_span":  # those have no fine-tune
            out.append((f"examples/enwik8/config/{name}_finetune.yaml",
                        "examples/enwik8/train.sh", [name], {}, 1))
    for arch in zoo_archs(task="language_modeling"):
        out.append((f"examples/pkm_lm/config/{arch}.yaml", "examples/pkm_lm/run.sh", ["train"],
                    {"ARCH": arch}, 0))
    return out


def dry_run(recipe: str, argv: List[str], env: Dict[str, str], index: int) -> List[str]:
    """The ``index``-th fairseq-train command the recipe prints with DRY_RUN=1 (one GPU), as the
    argument list after the program, with repository paths made relative."""
    # PYTHON=python keeps the printed commands generic; PATH makes it this interpreter (the
    # recipes ask it for the registry's arch list)
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    full_env = dict(os.environ, DRY_RUN="1", GPUS="1", PYTHON="python", PATH=path, **env)
    for var in ("DATA", "SAVE", "FP16", "UPDATE_FREQ", "MAX_TOKENS", "MAX_UPDATE", "LR"):
        full_env.pop(var, None)  # the recipe's defaults, never the caller's settings
    r = subprocess.run(["bash", os.path.join(REPO, recipe), *argv], capture_output=True,
                       text=True, env=full_env, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{recipe} {' '.join(argv)} (DRY_RUN=1) failed: {r.stderr.strip()}")
    cmds = []
    for line in r.stdout.splitlines():
        words = shlex.split(line)
        for i, w in enumerate(words):
            if w in ("fairseq-train", "fairseq_cli.train"):
                cmds.append([x.replace(REPO + "/", "") for x in words[i + 1:]])
                break
    if len(cmds) <= index:
        raise SystemExit(f"{recipe} {' '.join(argv)} printed {len(cmds)} fairseq-train commands")
    return cmds[index]


def section_keys(args) -> Dict[str, Dict]:
    """{group: {key: type}} for this command (the registered dataclasses of its task, criterion,
    optimizer and lr scheduler)."""
    from dataclasses import fields

    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    out = {}
    for s in SECTIONS:
        if s == "task":
            dc = TASK_DATACLASS_REGISTRY.get(args.task)
        elif s in NAMED:
            dc = REGISTRIES[s]["dataclass_registry"].get(getattr(args, s))
        else:
            dc = FairseqConfig.__dataclass_fields__[s].type
        out[s] = {f.name: f.type for f in fields(dc)} if dc is not None else {}
    return out


def _typed(value, kind):
    """fairseq's parser leaves a few numbers as strings (fields whose default is an
    interpolation, e.g. ``batch_size_valid``): give them the dataclass type."""
    import typing

    if isinstance(value, str):
        for t in (kind, *typing.get_args(kind)):
            if t in (int, float):
                try:
                    return t(value)
                except ValueError:
                    pass
    return value


def to_config(argv: List[str]) -> Dict:
    """The flags of a fairseq-train command as a hydra config dict (only what the command sets,
    plus the model's size keys). fairseq's parser is generated from the same dataclasses, so the
    parsed values already have the config's types (``lr`` a list, ``adam_betas`` a string)."""
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)  # adds the arch's flags to ``parser``
    keys = section_keys(args)
    given = []  # dests in command-line order
    for word in argv:
        action = parser._option_string_actions.get(word.split("=")[0])
        if action is not None and action.dest not in given:
            given.append(action.dest)
    out: Dict[str, Dict] = {s: {} for s in SECTIONS}
    out["model"] = {"_name": args.arch}
    for group, attr in NAMED.items():
        out[group]["_name"] = getattr(args, attr)
    out["task"]["data"] = args.data
    for dest in given:
        if dest in ("arch", "task", "criterion", "optimizer", "lr_scheduler"):
            continue
        section = next((s for s in SECTIONS if dest in keys[s]), "model")
        value = getattr(args, dest)
        out[section][dest] = value if section == "model" else _typed(value, keys[section][dest])
    for key in SIZES:
        if hasattr(args, key) and key not in out["model"]:
            out["model"][key] = getattr(args, key)
    out = {k: v for k, v in out.items() if v}
    # stay in the directory it was started from (relative task.data, checkpoint.save_dir and
    # common.user_dir); hydra's own log and config copies go beside the checkpoints, not into an
    # outputs/ directory of wherever it was started (the repository)
    out["hydra"] = {"job": {"chdir": False}, "run": {"dir": HYDRA_RUN_DIR}}
    return out


def render(cfg: Dict, path: str, recipe: str, argv: List[str], env: Dict[str, str],
           index: int) -> str:
    from omegaconf import OmegaConf

    how = " ".join([f"{k}={v}" for k, v in env.items()] + [recipe] + argv)
    stage = " (its second, fine-tuning command)" if index else ""
    name = os.path.splitext(os.path.basename(path))[0]
    fp16 = cfg.get("common", {}).get("fp16") or cfg.get("common", {}).get("amp")
    cpu = "common.fp16=false common.cpu=true" if fp16 else "common.cpu=true"
    head = (f"# @package _group_\n"
            f"# Generated by scripts/make_hydra_configs.py from `{how}`{stage} for one GPU;\n"
            f"# edit the recipe and rerun the script instead of editing this file. From the repo root:\n"
            f"#   fairseq-hydra-train --config-dir {os.path.dirname(path)} --config-name {name}\n"
            f"# N GPUs: distributed_training.distributed_world_size=N optimization.update_freq=[U/N]\n"
            f"# CPU: {cpu} (slow; for trying a config on tiny data)\n"
            f"# hydra's log and config copy go to <checkpoint.save_dir>/hydra/<date>_<time>\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(cfg), sort_keys=False)


def generate() -> Dict[str, str]:
    """{config path: yaml text} for every config."""
    import logging

    import fairseq_attnzoo  # noqa: F401  (registers our archs, tasks, criterions, optimizers)

    log = logging.getLogger("fairseq")
    level = log.level
    log.setLevel(logging.WARNING)  # parsing logs nothing useful; restored for the caller
    try:
        out = {}
        for path, recipe, argv, env, index in recipes():
            cmd = dry_run(recipe, argv, env, index)
            out[path] = render(to_config(cmd), path, recipe, argv, env, index)
    finally:
        log.setLevel(level)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when a config is missing or differs from its recipe")
    a = p.parse_args(argv)
    configs = generate()
    stale = []
    for path, text in configs.items():
        full = os.path.join(REPO, path)
        try:
            with open(full) as f:
                old = f.read()
        except OSError:
            old = None
        if old == text:
            continue
        stale.append(path)
        if not a.check:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(text)
    if a.check:
        if stale:
            print(f"{len(stale)} config(s) differ from their recipes: {', '.join(stale)}; run "
                  "python -m scripts.make_hydra_configs", file=sys.stderr)
            return 1
        print(f"{len(configs)} configs agree with their recipes")
        return 0
    print(f"wrote {len(stale)} of {len(configs)} configs" + (f": {', '.join(stale)}" if stale
                                                             else " (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``attnzoo-archs``: every registered zoo arch, read from the registries (fairseq 0.12's ``--help``
does not show arch flags).

    attnzoo-archs                       one line per arch: task, sublayers, what the arch presets
    attnzoo-archs ARCH                  one arch: sublayer per slot and layer, every model flag with
                                        the default this arch gives it and its help (paper symbol)
    attnzoo-archs --list [--task T] [--method M]   names only (for scripts and recipes)
    attnzoo-archs --compat              the compatibility patches of fairseq/torch/numpy

The functions here (:func:`zoo_archs`, :func:`arch_config`, :func:`slot_plan`, :func:`methods`)
are the one source of arch lists for the recipes, the hydra configs, the demo and the benchmarks.
"""

import argparse
import difflib
import sys
import textwrap
from typing import Dict, List, Optional

from fairseq_attnzoo.cli import command

TASKS = ("translation", "language_modeling", "attnzoo_stream_lm")


def _registries():
    import fairseq_attnzoo  # noqa: F401  (registers the models and archs)
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY

    return ARCH_MODEL_REGISTRY, ARCH_MODEL_NAME_REGISTRY, ARCH_CONFIG_REGISTRY


def arch_config(arch: str) -> argparse.Namespace:
    """The model settings of ``arch`` when the user sets no flag (the arch function's defaults)."""
    _, _, configs = _registries()
    args = argparse.Namespace()
    configs[arch](args)
    return args


def slot_plan(arch: str) -> Dict[str, List[str]]:
    """{slot flag attribute: sublayer name per layer}; empty for models without slot flags."""
    from fairseq_attnzoo.models.sublayers import SLOT_FLAGS, layer_names

    args = arch_config(arch)
    return {attr: layer_names(args, attr) for attr in SLOT_FLAGS
            if getattr(args, attr, None) is not None}


def model_name(arch: str) -> str:
    return _registries()[1][arch]


def task_of(arch: str) -> str:
    return _registries()[0][arch].zoo_task


def methods(arch: str) -> List[str]:
    """The methods an arch uses: its non-stock sublayer names, or for models with their own layer
    stack (no slot flags) the model's name without the ``attnzoo_`` prefix and ``_lm`` suffix."""
    plan = slot_plan(arch)
    if not plan:
        name = model_name(arch)
        return [name[len("attnzoo_"):].replace("_lm", "") if name.startswith("attnzoo_") else name]
    from fairseq_attnzoo.models.sublayers import is_stock

    return sorted({n for names in plan.values() for n in names if not is_stock(n)})


def zoo_archs(task: Optional[str] = None, method: Optional[str] = None) -> List[str]:
    """Every registered arch of a zoo model, optionally only those of ``task`` and/or using the
    method ``method`` (a sublayer name such as ``pkm``, a prefix such as ``synth``, or
    ``adaptive_span`` / ``all_attention``); ``method="none"``: the stock-sublayer archs."""
    archs, _, _ = _registries()
    out = []
    for arch, cls in archs.items():
        if not getattr(cls, "zoo_task", None) or (task and cls.zoo_task != task):
            continue
        used = methods(arch)
        if method == "none" and used:
            continue
        if method and method != "none" and not any(m == method or m.startswith(method + "_")
                                                    for m in used):
            continue
        out.append(arch)
    return sorted(out)


def _runs(names: List[str]) -> str:
    """'synth_random' for one name everywhere, else 'ffn 0-1, pkm 2, ffn 3-5'."""
    if len(set(names)) == 1:
        return f"{names[0]} (all {len(names)} layers)"
    parts, start = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            span = str(start) if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{names[start]} {span}")
            start = i
    return ", ".join(parts)


def model_flags(model: str) -> List[argparse.Action]:
    from fairseq.models import MODEL_REGISTRY

    parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    MODEL_REGISTRY[model].add_args(parser)
    return [a for a in parser._actions if a.option_strings]


def _base_arch(model: str) -> Optional[str]:
    return model if model in _registries()[2] else None


def presets(arch: str) -> Dict[str, object]:
    """Model settings this arch sets differently from its model's base arch."""
    model = model_name(arch)
    base = _base_arch(model)
    mine = vars(arch_config(arch))
    if base is None or base == arch:
        return {}
    ref = vars(arch_config(base))
    return {k: v for k, v in mine.items() if k not in ref or ref[k] != v}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _value(v) -> str:
    return "(unset)" if v is None else str(v)


def _setting(dest: str, value, action: Optional[argparse.Action] = None) -> str:
    """How a user gives ``value`` to the flag of ``dest``: an on/off flag (``--rope`` /
    ``--no-rope``) by its name alone, any other as ``--flag VALUE``."""
    if isinstance(action, argparse.BooleanOptionalAction) and isinstance(value, bool):
        return action.option_strings[0 if value else 1]
    return f"{action.option_strings[-1] if action else _flag(dest)} {_value(value)}"


def _description(name: str, args: argparse.Namespace) -> str:
    """What sublayer ``name`` builds under the arch's settings ``args``: fairseq's stock attention
    and FFN change under the host options (``models/transformer.py``)."""
    from fairseq_attnzoo.models.sublayers import STOCK, SUBLAYER_REGISTRY
    from fairseq_attnzoo.models.transformer import _host, stock_host

    if name == STOCK["self_attn"] and not stock_host(args):
        changed = " and ".join(what for what, on in (
            ("rotary positions (--rope)", _host(args, "rope")),
            ("no biases (--no-proj-bias)", not _host(args, "proj_bias"))) if on)
        return (f"ZooMultiheadAttention (fairseq MultiheadAttention's parameters, with {changed}; "
                "fairseq's own has no rotary hook)")
    if name == STOCK["ffn"] and not _host(args, "proj_bias"):
        return "fairseq position-wise FFN fc1-act-fc2 without biases (--no-proj-bias)"
    return SUBLAYER_REGISTRY[name].description


def summary() -> str:
    from fairseq_attnzoo.models.sublayers import SLOT_FLAGS, STOCK

    lines = []
    for arch in zoo_archs():
        plan = slot_plan(arch)
        if plan:
            slots = "; ".join(f"{attr}: {_runs(n)}" for attr, n in plan.items()
                              if set(n) != {STOCK[SLOT_FLAGS[attr][0]]})
            slots = slots or "stock sublayers"
        else:
            slots = "its own layer stack (no slot flags)"
        pre = presets(arch)
        actions = {a.dest: a for a in model_flags(model_name(arch))}
        pre_text = " ".join(_setting(k, v, actions.get(k)) for k, v in pre.items()
                            if k not in SLOT_FLAGS)
        lines.append(f"{arch}  [{task_of(arch)}, model {model_name(arch)}]\n"
                     f"    sublayers: {slots}" + (f"\n    preset: {pre_text}" if pre_text else ""))
    lines.append("\n`attnzoo-archs ARCH` shows one arch with every flag, its default and help.")
    return "\n".join(lines)


def _method_dests(arch: str) -> List[str]:
    from dataclasses import fields

    from fairseq_attnzoo.models.sublayers import SUBLAYER_REGISTRY

    out = []
    for name in {n for names in slot_plan(arch).values() for n in names}:
        opts = SUBLAYER_REGISTRY[name].options
        if opts is not None:
            out += [f.name for f in fields(opts) if f.name not in out]
    return out


def _help(action: argparse.Action, width: int = 100) -> str:
    text = " ".join((action.help or "").split()).replace("%(default)s", "see value")
    return textwrap.fill(text, width, initial_indent="      ", subsequent_indent="      ")


def detail(arch: str) -> str:
    from fairseq_attnzoo.models.sublayers import SLOT_FLAGS

    model = model_name(arch)
    args = vars(arch_config(arch))
    lines = [f"{arch}: model {model}, task {task_of(arch)} (fairseq-train DATA --user-dir "
             f"fairseq_attnzoo --task {task_of(arch)} --arch {arch})", ""]
    plan = slot_plan(arch)
    lines.append("Sublayer per slot and layer:")
    if not plan:
        lines.append("  the model's own layer stack (no slot flags)")
    for attr, names in plan.items():
        slot, side, _ = SLOT_FLAGS[attr]
        descr = "; ".join(f"{n}: {_description(n, arch_config(arch))}"
                          for n in dict.fromkeys(names))
        lines.append(f"  {side} {slot} ({_flag(attr)}): {_runs(names)}")
        lines.append(f"      {descr}")
    actions = {a.dest: a for a in model_flags(model)}
    pre = presets(arch)
    groups = [("Preset by this arch (differs from " + str(_base_arch(model)) + ")",
               [d for d in actions if d in pre and d not in SLOT_FLAGS]),
              ("Method flags (help names the paper's symbol)",
               [d for d in _method_dests(arch) if d in actions and d not in pre]),
              ("Other model flags", [d for d in actions if d not in pre and d not in SLOT_FLAGS
                                     and d not in _method_dests(arch)])]
    for title, dests in groups:
        if not dests:
            continue
        lines += ["", f"{title}:"]
        for d in dests:
            a = actions[d]
            lines.append(f"  {_setting(d, args.get(d, a.default), a)}")
            if a.help:
                lines.append(_help(a))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnzoo-archs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n")[1])
    p.add_argument("arch", nargs="?", help="show this arch in detail")
    p.add_argument("--list", action="store_true", help="print arch names only, one a line")
    p.add_argument("--task", choices=TASKS, help="--list: only archs of this task")
    p.add_argument("--method", help="--list: only archs using this method (e.g. pkm, synth, aop, "
                   "collab, sdpa, adaptive_span, all_attention; 'none' = stock sublayers)")
    p.add_argument("--compat", action="store_true",
                   help="print the table of compatibility patches (fairseq_attnzoo.compat)")
    return p


@command
def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.compat:
        from fairseq_attnzoo import compat

        print(compat.describe())
        return 0
    if a.list or a.task or a.method:
        names = zoo_archs(a.task, a.method)
        if not names:
            p.error(f"no zoo arch matches --task {a.task} --method {a.method}: "
                    "`attnzoo-archs` lists them all")
        print("\n".join(names))
        return 0
    if a.arch:
        known = zoo_archs()
        if a.arch not in known:
            close = difflib.get_close_matches(a.arch, known, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            p.error(f"unknown zoo arch {a.arch!r}: {hint}`attnzoo-archs` lists all "
                    f"{len(known)}")
        print(detail(a.arch))
        return 0
    print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

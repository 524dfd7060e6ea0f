"""The ``fairseq-train`` command line that reproduces a checkpoint's stored configuration under
another arch (used by ``attnzoo-collab-reparametrize`` to print a fine-tune command that runs as
printed).

Every flag of fairseq's training parser (for the target arch, task, criterion, optimizer and
schedule) whose value in the checkpoint differs from the value the parser and the arch would fill
in by themselves is written out; the checkpoint section (save dir, restore file, resets) and the
distributed section (the machine's, not the model's) are left to the caller.
"""

import argparse
import os
import shlex
from typing import Any, Dict, List, Optional

# dests that belong to the run, not to the model: set by the caller or by the machine
_SKIP = {"data", "arch", "task", "criterion", "optimizer", "lr_scheduler", "user_dir", "_name"}


def _section_items(section) -> Dict[str, Any]:
    if section is None:
        return {}
    if isinstance(section, argparse.Namespace):
        return dict(vars(section))
    from omegaconf import OmegaConf

    if OmegaConf.is_config(section):
        return OmegaConf.to_container(section, resolve=True, enum_to_str=True)
    return dict(section) if hasattr(section, "items") else {}


def stored_values(cfg) -> Dict[str, Any]:
    """A checkpoint's ``cfg`` flattened to argparse dests (the model section last: it wins)."""
    sections = _section_items(cfg)
    out: Dict[str, Any] = {}
    for name, section in sections.items():
        if name != "model":
            out.update(_section_items(section))
    out.update(_section_items(sections.get("model")))
    return out


def _run_dests() -> set:
    from fairseq.dataclass.configs import CheckpointConfig, DistributedTrainingConfig

    return ({f for f in CheckpointConfig.__dataclass_fields__}
            | {f for f in DistributedTrainingConfig.__dataclass_fields__})


def _component(values: Dict[str, Any], cfg_sections: Dict[str, Any], name: str) -> Optional[str]:
    section = _section_items(cfg_sections.get(name))
    return section.get("_name") or values.get(name)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def _as_text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def training_command(cfg, arch: str, extra: List[str] = ()) -> List[str]:
    """``fairseq-train`` argv (without the program name) for ``arch`` with every setting stored in
    ``cfg`` (a checkpoint's ``cfg``), then ``extra``."""
    from fairseq import options

    values = stored_values(cfg)
    sections = _section_items(cfg)
    user_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = [str(values["data"]), "--user-dir", user_dir, "--arch", arch]
    for name in ("task", "criterion", "optimizer", "lr_scheduler"):
        component = _component(values, sections, name)
        if component:
            head += ["--" + name.replace("_", "-"), str(component)]
    parser = options.get_training_parser()
    defaults = options.parse_args_and_arch(parser, head)  # adds the component flags to parser
    skip = _SKIP | _run_dests()
    flags: List[str] = []
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in skip or dest not in values:
            continue
        value, default = values[dest], getattr(defaults, dest, None)
        if value is None or _same(value, default):
            continue
        option = next((o for o in action.option_strings if o.startswith("--")),
                      action.option_strings[0])
        if isinstance(action, argparse._StoreTrueAction):
            if value is True:
                flags.append(option)
        elif isinstance(action, argparse._StoreFalseAction):
            if value is False:
                flags.append(option)
        elif isinstance(action, argparse._StoreAction):
            flags += [option, _as_text(value)]
    return head + flags + list(extra)


def format_command(program: str, argv: List[str]) -> str:
    return " ".join(shlex.quote(x) for x in [program] + list(argv))

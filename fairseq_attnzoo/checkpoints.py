"""Reading a fairseq checkpoint's file without building its model: what it stores (its model and
task configs, its arch, its update, its validation result) and which model flags differ from this
run's. Read by the host's resume check (``models/transformer.py``), the one-line messages
(:mod:`.messages`), the end-of-run summary (``compat/run_end.py``) and the commands alike. This
module imports nothing else of ours (fairseq and torch only inside its functions)."""

import argparse
import os
from typing import Dict, List, Optional

#: the tasks whose checkpoints are language models (scored by fairseq-eval-lm, not -generate)
LM_TASKS = ("language_modeling", "attnzoo_stream_lm")


def cfg_get(cfg, key):
    """``key`` of a dict config, an argparse namespace or a dataclass (None where absent)."""
    return cfg.get(key, None) if hasattr(cfg, "get") else getattr(cfg, key, None)


def load_stored(path: str):
    """The fairseq checkpoint at ``path`` (its tensors memory-mapped, not read), or None when it
    does not load (missing, truncated, not a checkpoint)."""
    try:
        import torch

        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as e:  # not a zip file: no mmap (a truncated zip file stays refused)
            if "failed reading zip archive" in str(e):
                return None
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # unreadable: say nothing about it
        return None


def stored_section(state, section: str):
    """The ``model`` or ``task`` config of a loaded checkpoint (``cfg``, or the ``args`` of an
    older one), or None."""
    if not isinstance(state, dict):
        return None
    cfg = state.get("cfg") or {}
    part = cfg.get(section) if hasattr(cfg, "get") else None
    return part if part is not None else state.get("args")


def stored_arch(path: str):
    """The ``--arch`` a fairseq checkpoint was trained with, or None."""
    model = stored_section(load_stored(path), "model")
    if model is None:
        return None
    return cfg_get(model, "arch") or cfg_get(model, "_name")


def stored_update(state) -> Optional[int]:
    """The update a loaded checkpoint was saved after, or None."""
    try:
        return int(state["optimizer_history"][-1]["num_updates"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def stored_validation(state) -> Optional[tuple]:
    """(update, epoch, validation value) a loaded checkpoint was saved with, or None."""
    try:
        extra = state["extra_state"]
        value = extra["val_loss"]
        epoch = extra["train_iterator"]["epoch"]
    except (KeyError, TypeError):
        return None
    return (stored_update(state), epoch, value) if value is not None else None


def loading_checkpoints(folder: str, but: str) -> List[str]:
    """``name (update N)`` of each checkpoint in ``folder`` other than ``but`` that loads, the
    latest update first."""
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if not name.endswith(".pt") or os.path.abspath(path) == os.path.abspath(but):
            continue
        state = load_stored(path)
        if state is not None:
            found.append((stored_update(state) or 0, name))
    found.sort(key=lambda x: -x[0])
    return [f"{name} (update {update})" for update, name in found]


def model_flag_differences(stored, current, defaults: Optional[Dict[str, tuple]] = None):
    """``--flag X (checkpoint) vs Y (this run)`` for each model flag of the arch's model class
    whose value differs between the checkpoint's model config ``stored`` and this run's
    ``current`` (argparse namespaces or dict configs), in the parser's order. ``defaults``:
    ``{dest: (default, ...)}`` of options an older checkpoint may lack (read as the default)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    model_cls = ARCH_MODEL_REGISTRY.get(cfg_get(current, "arch") or cfg_get(current, "_name"))
    if model_cls is None or stored is None:
        return []
    parser = argparse.ArgumentParser(add_help=False)
    try:
        model_cls.add_args(parser)
    except Exception:  # an unusual model: nothing to compare
        return []
    out = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        before, now = cfg_get(stored, action.dest), cfg_get(current, action.dest)
        if before is None and action.dest in (defaults or {}):
            before = defaults[action.dest][0]
        if before != now:
            out.append(f"{action.option_strings[0]} {before} (checkpoint) vs {now} (this run)")
    return out

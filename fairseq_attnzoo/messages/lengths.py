"""The flags that bound the length of an example a model accepts, and the flag a message names
when fairseq skips or refuses a longer one (compat entries ``fairseq_skipped_examples``,
``fairseq_subset_score``, the console hook's ``hint_example_too_long``).

A builder whose module accepts at most N positions because of one of our flags notes it
(:func:`note_length_limit`, e.g. the Synthesizer's ``--synth-max-len``); a new model's build
forgets the limits noted before (:func:`forget_length_limits`). The limits are held like the other
hand-offs of a build (``models/sublayers.py``'s sharing scope, ``models/registry.py``'s checkpoint
build): in a context variable, so each thread and each task (a copied context) has its own, and
every change sets a new read-only mapping, so no two contexts ever share one to write into. This
module imports nothing else of ours."""

import contextvars
from types import MappingProxyType
from typing import Dict, List, Mapping

_NONE: Mapping[str, int] = MappingProxyType({})

#: flag -> value for the model built last in this thread / task (read-only; replaced, never edited)
_LENGTH_LIMITS: "contextvars.ContextVar[Mapping[str, int]]" = contextvars.ContextVar(
    "attnzoo_length_limits", default=_NONE)


def forget_length_limits():
    """A new model is being built: the limits noted so far were another model's."""
    _LENGTH_LIMITS.set(_NONE)


def note_length_limit(flag: str, value: int):
    """For a builder whose module accepts at most ``value`` positions because of ``flag``."""
    _LENGTH_LIMITS.set(MappingProxyType({**_LENGTH_LIMITS.get(), flag: int(value)}))


def length_limits() -> Dict[str, int]:
    """The limits noted for the model built last in this thread / task."""
    return dict(_LENGTH_LIMITS.get())


def position_numbers(x) -> List[float]:
    """The numbers in fairseq's ``max_positions`` (a number, or tuples / dicts of them)."""
    if isinstance(x, (tuple, list)):
        return [n for v in x for n in position_numbers(v)]
    if isinstance(x, dict):
        return [n for v in x.values() for n in position_numbers(v)]
    return [x] if isinstance(x, (int, float)) else []


def length_flags(max_positions) -> str:
    """The flag(s) that keep examples longer than ``max_positions`` (a number or fairseq's tuple
    of them): one of ours when it is the bound, else fairseq's position flags."""
    bound = min(position_numbers(max_positions), default=None)
    ours = [f"{flag} (now {value})" for flag, value in length_limits().items() if value == bound]
    if ours:
        return " and ".join(ours)
    return ("--max-source-positions/--max-target-positions (--tokens-per-sample for a language "
            "model)")

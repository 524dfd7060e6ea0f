"""The kinds of benchmark rows (cases.py declares them, harness.py runs them), and ``fwd_bwd``."""

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(REPO, "fairseq_attnzoo")
Sized = Union[str, Dict[str, str], Callable]  # flags, flags per --size, or a function of it


def sized(value, size: str):
    if callable(value):
        return value(size)
    return value.get(size, value.get("paper")) if isinstance(value, dict) else value


@dataclass
class Kernel:
    """``candidate(p, device, dtype)`` -> a call (one forward + backward); ``baseline`` the same
    for what it is compared with (None: no ratio). ``shapes[size]``: the parameter dicts ``p``,
    one row each. ``work(p, dtype)`` -> ("bytes" | "flops", count): the roofline column."""
    family: str
    name: str
    shapes: Dict[str, List[dict]]
    candidate: Callable
    baseline: Optional[Callable] = None
    work: Optional[Callable] = None
    note: str = ""
    level: str = "kernel"


@dataclass
class Side:
    """One side of a train row: flags after the case's ``common``; ``plugin`` False: stock fairseq
    (no import, no ``--user-dir``); ``env``: more environment (e.g. a kernel switch);
    ``precision``: this side's, instead of ``--precision``."""
    flags: Sized
    plugin: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    precision: Optional[str] = None

    @staticmethod
    def of(spec):
        return spec if isinstance(spec, Side) else Side(spec)


@dataclass
class Train:
    """``baseline``, ``candidate``: flags after ``common`` or Sides (several labelled candidates: a
    row each, against the same baseline runs); ``warm``: "epoch" (time epochs 2+) or "interval"
    (one shape: after the first log interval); ``floor``: the baseline's key in cases.FLOORS."""
    family: str
    name: str
    data: str  # "mt" | "lm": --data-mt / --data-lm
    common: Sized
    baseline: Union[Sized, Side]
    candidate: Union[Sized, Side, Dict[str, Union[Sized, Side]]]
    warm: str = "epoch"
    floor: Optional[str] = None
    note: str = ""
    level: str = "train"

    def __post_init__(self):  # flags become Sides, and one candidate the only one, unlabelled
        several = isinstance(self.candidate, dict) and "paper" not in self.candidate
        self.baseline, self.candidate = Side.of(self.baseline), (
            {k: Side.of(v) for k, v in self.candidate.items()} if several
            else {"": Side.of(self.candidate)})


@dataclass
class Quality:
    """``runs``: label -> flags after ``common`` (or a callable giving that dict), trained for
    ``updates[size]`` updates with each seed; one record per run."""
    family: str
    name: str
    data: str
    common: Sized
    runs: Union[Dict[str, Sized], Callable]
    updates: Dict[str, int] = field(default_factory=lambda: {"paper": 1000, "tiny": 4})
    note: str = ""
    level: str = "quality"
    #: runs whose label holds this need CUDA: on the CPU (a dry run) they are recorded as such
    cuda_only: str = ""


@dataclass
class Decode:
    """``fairseq-generate`` ("mt") or ``fairseq-eval-lm`` ("lm") of each candidate's checkpoint
    (``updates[size]`` updates) against the baseline's; a row per candidate and ``runs`` label
    (its decode flags), timed warm: a second pass in the process, by fairseq's own timer."""
    family: str
    name: str
    data: str
    common: Sized
    baseline: Sized
    candidate: Dict[str, Sized]
    runs: Dict[str, Sized]
    updates: Dict[str, int] = field(default_factory=lambda: {"paper": 1000, "tiny": 4})
    note: str = ""
    level: str = "decode"


def fwd_bwd(module, *inputs):
    """A call: ``module(*inputs)`` (first output) summed and back-propagated, grads cleared."""
    def call():
        module.zero_grad(set_to_none=True)
        out = module(*inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).float().sum().backward()
    return call

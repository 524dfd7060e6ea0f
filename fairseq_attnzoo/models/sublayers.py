"""The one extension point: a registry of per-layer sublayers.

Every transformer layer of a zoo model has up to three replaceable slots:

=============  ====================================  =============================================
slot           flags (one name, or one per layer)    stock implementation (name)
=============  ====================================  =============================================
self_attn      --encoder-self-attn / --decoder-self-attn   fairseq ``MultiheadAttention`` (``mha``)
cross_attn     --cross-attn                         fairseq ``MultiheadAttention`` (``mha``)
ffn            --encoder-ffn / --decoder-ffn        fairseq's fc1-ReLU-fc2 (``ffn``)
=============  ====================================  =============================================

A method adds a variant with one decorated builder::

    @register_sublayer("aop", slots=("ffn",), options=AOPConfig, tiny={"aop_heads": 2, ...})
    def build_aop(spec: SublayerSpec) -> nn.Module: ...

``options`` is a dataclass of the method's flags (help strings name the paper's symbols); its
fields become command-line flags of every zoo model, with the dataclass defaults filled in when an
arch preset does not set them. ``tiny`` shrinks the method's own sizes for the generic tests;
``tolerances`` loosens a named generic check where the method has a documented reason.

Sublayers that share parameters across layers (product-key memory's shared value pool) keep them
in ``spec.shared``: one dict for all sublayers built inside one :func:`sharing_scope` (the zoo
models open one per ``build_model``, so each model gets its own), a fresh dict outside of one.
"""

import argparse
import contextlib
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.nn as nn

SLOTS = ("self_attn", "cross_attn", "ffn")
STOCK = {"self_attn": "mha", "cross_attn": "mha", "ffn": "ffn"}


@dataclass
class SublayerSpec:
    """What a builder needs to know about the place its module goes."""

    slot: str  # self_attn | cross_attn | ffn
    side: str  # encoder | decoder
    layer_idx: int
    num_layers: int
    embed_dim: int
    num_heads: int
    ffn_dim: int
    attention_dropout: float
    activation_dropout: float
    causal: bool  # decoder self-attention
    kdim: int  # input dim of keys/values (encoder dim for cross-attention)
    args: Any  # the full model config / namespace (method flags live here)
    #: state shared by the sublayers of one model (cross-layer parameter sharing)
    shared: Dict[str, Any] = field(default_factory=lambda: current_shared())


_SCOPES: List[Dict[str, Any]] = []


@contextlib.contextmanager
def sharing_scope():
    """Sublayers whose specs are made inside this block share one ``spec.shared`` dict."""
    _SCOPES.append({})
    try:
        yield _SCOPES[-1]
    finally:
        _SCOPES.pop()


def current_shared() -> Dict[str, Any]:
    return _SCOPES[-1] if _SCOPES else {}


@dataclass
class SublayerEntry:
    name: str
    slots: Tuple[str, ...]
    builder: Optional[Callable[[SublayerSpec], nn.Module]]  # None: fairseq's stock module
    options: Optional[type]
    tiny: Dict[str, Any]
    description: str
    #: looser bounds for named checks of the generic tests, where the method is exact but a
    #: documented discrete effect moves the number (e.g. ``reduced_precision_step``: top-k reads)
    tolerances: Dict[str, float] = field(default_factory=dict)


SUBLAYER_REGISTRY: Dict[str, SublayerEntry] = {}


def register_sublayer(name: str, slots, options: Optional[type] = None,
                      tiny: Optional[Dict[str, Any]] = None, description: str = "",
                      tolerances: Optional[Dict[str, float]] = None):
    slots = tuple(slots)
    for s in slots:
        if s not in SLOTS:
            raise ValueError(f"unknown sublayer slot {s!r}; slots are {SLOTS}")

    def deco(fn):
        if name in SUBLAYER_REGISTRY and SUBLAYER_REGISTRY[name].builder is not fn:
            raise ValueError(f"sublayer {name!r} is registered twice")
        SUBLAYER_REGISTRY[name] = SublayerEntry(name, slots, fn, options, dict(tiny or {}),
                                                description or (fn.__doc__ or "").strip(),
                                                dict(tolerances or {}))
        return fn

    return deco


# fairseq's own modules, built by fairseq's layer classes
SUBLAYER_REGISTRY["mha"] = SublayerEntry(
    "mha", ("self_attn", "cross_attn"), None, None, {}, "fairseq MultiheadAttention (stock)")
SUBLAYER_REGISTRY["ffn"] = SublayerEntry(
    "ffn", ("ffn",), None, None, {}, "fairseq position-wise FFN fc1-act-fc2 (stock)")


def names_for(slot: str) -> List[str]:
    return sorted(n for n, e in SUBLAYER_REGISTRY.items() if slot in e.slots)


SLOT_FLAGS = {
    # attribute name -> (slot, side, layers attribute)
    "encoder_self_attn": ("self_attn", "encoder", "encoder_layers"),
    "decoder_self_attn": ("self_attn", "decoder", "decoder_layers"),
    "cross_attn": ("cross_attn", "decoder", "decoder_layers"),
    "encoder_ffn": ("ffn", "encoder", "encoder_layers"),
    "decoder_ffn": ("ffn", "decoder", "decoder_layers"),
}


def add_sublayer_args(parser: argparse.ArgumentParser, decoder_only: bool = False):
    """Slot flags plus every registered method's option flags (no defaults: presets set them)."""
    from fairseq.dataclass.utils import gen_parser_from_dataclass

    for attr, (slot, side, _) in SLOT_FLAGS.items():
        if decoder_only and (side == "encoder" or slot == "cross_attn"):
            continue
        parser.add_argument(
            "--" + attr.replace("_", "-"), type=str, metavar="NAME[,NAME...]",
            help=f"{side} {slot} module: one name for every layer or a comma-separated name per "
            f"layer; choices: {', '.join(names_for(slot))} (default: {STOCK[slot]})")
    seen = set()
    for entry in SUBLAYER_REGISTRY.values():
        if entry.options is not None and entry.options not in seen:
            seen.add(entry.options)
            gen_parser_from_dataclass(parser, entry.options(), delete_default=True)


def option_defaults() -> Dict[str, Any]:
    """Every method flag's dataclass default (the single place defaults live)."""
    out: Dict[str, Any] = {}
    for entry in SUBLAYER_REGISTRY.values():
        if entry.options is None:
            continue
        for f in fields(entry.options):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def fill_sublayer_defaults(args, decoder_only: bool = False):
    """Called at the end of every zoo arch function: stock slots, then method defaults."""
    for attr, (slot, side, _) in SLOT_FLAGS.items():
        if decoder_only and (side == "encoder" or slot == "cross_attn"):
            continue
        if getattr(args, attr, None) is None:
            setattr(args, attr, STOCK[slot])
    for name, value in option_defaults().items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def layer_names(args, attr: str) -> List[str]:
    """Resolve a slot flag to one validated name per layer; raises a one-line ValueError."""
    slot, side, layers_attr = SLOT_FLAGS[attr]
    n_layers = int(getattr(args, layers_attr))
    raw = getattr(args, attr, None) or STOCK[slot]
    names = [x.strip() for x in str(raw).split(",")]
    flag = "--" + attr.replace("_", "-")
    if len(names) == 1:
        names = names * n_layers
    elif len(names) != n_layers:
        raise ValueError(f"{flag} lists {len(names)} names but the {side} has {n_layers} layers: "
                         "give one name for all layers or exactly one per layer")
    for n in names:
        if n not in SUBLAYER_REGISTRY:
            raise ValueError(f"unknown {flag} name {n!r}; choose from: {', '.join(names_for(slot))}")
        if slot not in SUBLAYER_REGISTRY[n].slots:
            raise ValueError(f"{flag} {n!r} cannot be used as {slot} (it is a "
                             f"{'/'.join(SUBLAYER_REGISTRY[n].slots)} module); choose from: "
                             f"{', '.join(names_for(slot))}")
    return names


def validate_sublayer_args(args, decoder_only: bool = False) -> Dict[str, List[str]]:
    out = {}
    for attr, (slot, side, _) in SLOT_FLAGS.items():
        if decoder_only and (side == "encoder" or slot == "cross_attn"):
            continue
        out[attr] = layer_names(args, attr)
    return out


def build_sublayer(name: str, spec: SublayerSpec) -> nn.Module:
    entry = SUBLAYER_REGISTRY[name]
    assert entry.builder is not None, f"{name} is built by fairseq's own layer"
    return entry.builder(spec)


def tiny_overrides(names) -> Dict[str, Any]:
    """Method-specific size overrides that make a model cheap (used by the generic tests)."""
    out: Dict[str, Any] = {}
    for n in names:
        out.update(SUBLAYER_REGISTRY[n].tiny)
    return out

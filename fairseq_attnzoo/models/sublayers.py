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

    @register_sublayer("mine", slots=("self_attn",), options=MyConfig, tiny={"my_size": 8},
                       rope=True)
    def build_mine(spec: SublayerSpec) -> nn.Module: ...

What the host needs to know of a method it declares here too, never by its name in the host:
``slots`` (a self-attention-only method lists ``("self_attn",)``), ``rope`` (whether it rotates
queries and keys under the host's ``--rope``: :class:`SublayerEntry`) and ``incremental``
(whether it decodes token by token with fairseq's incremental state).

``options`` is a dataclass of the method's flags (help strings name the paper's symbols), the one
place their types, defaults and choices live; its fields become command-line flags of every zoo
model (a ``bool`` field ``x`` is ``--x`` / ``--no-x``, so a preset that turns it on can be turned
off). The builder reads them typed from ``spec.options``: an instance built once per model from the
model's config (:func:`build_options`: unset fields take the dataclass default, values are
converted to the field's type, the dataclass's ``validate()`` runs), so a bad value fails before
any module is built, in one line naming the flag. ``tiny`` shrinks the method's own sizes for the
generic tests;
``tolerances`` loosens a named generic check where the method has a documented reason.

Sublayers that share parameters across layers (product-key memory's shared value pool) keep them
in ``spec.shared``: one dict for all sublayers built inside one :func:`sharing_scope` (the zoo
models open one per ``build_model``, so each model gets its own), a fresh dict outside of one.
"""

import argparse
import contextlib
import contextvars
import enum
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch.nn as nn
from fairseq.dataclass.utils import gen_parser_from_dataclass

from ..messages.errors import ZooConfigError
from ..messages.lengths import forget_length_limits, note_length_limit  # noqa: F401 (builders)

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
    args: Any  # the full model config / namespace (untyped; every flag of the model)
    #: state shared by the sublayers of one model (cross-layer parameter sharing)
    shared: Dict[str, Any] = field(default_factory=lambda: current_shared())
    #: the method's typed options (an instance of its ``options`` dataclass, shared by the
    #: model's sublayers: read, never write), filled in by :func:`build_sublayer` when left
    #: None; None for methods without options
    options: Any = None


@dataclass
class _ModelScope:
    shared: Dict[str, Any] = field(default_factory=dict)
    options: Dict[type, Any] = field(default_factory=dict)  # options class -> built instance


#: the model being built in this thread / task (:func:`sharing_scope`), None outside a build
_SCOPE: "contextvars.ContextVar[Optional[_ModelScope]]" = contextvars.ContextVar(
    "attnzoo_model_scope", default=None)


@contextlib.contextmanager
def sharing_scope():
    """One model's build: the sublayers whose specs are made inside this block share one
    ``spec.shared`` dict and one options instance per method (built and validated once). Another
    thread's build, or a build nested in this one, has its own."""
    scope = _ModelScope()
    token = _SCOPE.set(scope)
    try:
        yield scope.shared
    finally:
        _SCOPE.reset(token)


def current_shared() -> Dict[str, Any]:
    scope = _SCOPE.get()
    return scope.shared if scope is not None else {}


#: a ``rope`` declaration: whether a self-attention rotates its queries and keys under --rope
#: (False: it forms no q.k product; True: its builder passes ``host_rope_theta(spec)``; a function
#: of the method's options: None where they rotate, else the change of options that would)
RopeDeclaration = Union[bool, Callable[[Any], Optional[str]]]


@dataclass
class SublayerEntry:
    """A registered method (or fairseq's stock module) and what it declares to the host."""

    name: str
    slots: Tuple[str, ...]  # the slots it may fill; ("self_attn",): self-attention only
    builder: Optional[Callable[[SublayerSpec], nn.Module]]  # None: fairseq's stock module
    options: Optional[type]
    tiny: Dict[str, Any]
    description: str
    #: looser bounds for named checks of the generic tests, where the method is exact but a
    #: documented discrete effect moves the number (e.g. ``reduced_precision_step``: top-k reads)
    tolerances: Dict[str, float] = field(default_factory=dict)
    #: the host's --rope: see :data:`RopeDeclaration` (the host refuses --rope for False)
    rope: RopeDeclaration = False
    #: decodes token by token with fairseq's incremental state (caches what later steps read,
    #: ``ctx.cache``); False: the host refuses a decoding step in one line instead of a wrong one
    incremental: bool = True

    @property
    def stock(self) -> bool:
        """fairseq's own module, built by fairseq's layer classes."""
        return self.builder is None

    def rope_fix(self, options) -> Optional[str]:
        """None when this method rotates under --rope with ``options``; else what would make it
        rotate ("" when nothing would: it forms no q.k product)."""
        if callable(self.rope):
            return self.rope(options)
        return None if self.rope else ""


SUBLAYER_REGISTRY: Dict[str, SublayerEntry] = {}


def register_sublayer(name: str, slots, options: Optional[type] = None,
                      tiny: Optional[Dict[str, Any]] = None, description: str = "",
                      tolerances: Optional[Dict[str, float]] = None,
                      rope: RopeDeclaration = False, incremental: bool = True):
    """Register the decorated ``builder(spec) -> nn.Module`` as sublayer ``name`` for ``slots``,
    with what it declares to the host (``rope``, ``incremental``: :class:`SublayerEntry`)."""
    slots = tuple(slots)
    for s in slots:
        if s not in SLOTS:
            raise ValueError(f"unknown sublayer slot {s!r}; slots are {SLOTS}")

    def deco(fn):
        if name in SUBLAYER_REGISTRY and SUBLAYER_REGISTRY[name].builder is not fn:
            raise ValueError(f"sublayer {name!r} is registered twice")
        SUBLAYER_REGISTRY[name] = SublayerEntry(name, slots, fn, options, dict(tiny or {}),
                                                description or (fn.__doc__ or "").strip(),
                                                dict(tolerances or {}), rope, incremental)
        return fn

    return deco


# fairseq's own modules, built by fairseq's layer classes (the attention is built as the shared
# base's under --rope: models/transformer.py's host_attention)
SUBLAYER_REGISTRY[STOCK["self_attn"]] = SublayerEntry(
    STOCK["self_attn"], ("self_attn", "cross_attn"), None, None, {},
    "fairseq MultiheadAttention (stock)", rope=True)
SUBLAYER_REGISTRY[STOCK["ffn"]] = SublayerEntry(
    STOCK["ffn"], ("ffn",), None, None, {}, "fairseq position-wise FFN fc1-act-fc2 (stock)")


def is_stock(name: str) -> bool:
    return SUBLAYER_REGISTRY[name].stock


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
    """Slot flags plus every registered method's option flags (no defaults: presets set them).

    A ``bool`` option becomes ``--x`` / ``--no-x`` (fairseq's own generator makes it a
    ``store_true`` flag, which cannot undo a preset that sets it); the other fields get fairseq's
    ``gen_parser_from_dataclass`` flags."""
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
            hints = typing.get_type_hints(entry.options)
            for f in option_fields(entry.options):
                if _field_type(f, hints)[0] is bool:
                    parser.add_argument(
                        flag_name(f.name), action=argparse.BooleanOptionalAction,
                        help=f.metadata.get("help"))
            # fairseq skips a flag that is already defined (the bool ones above)
            gen_parser_from_dataclass(parser, entry.options(), delete_default=True)


def flag_name(attr: str) -> str:
    """``my_size`` -> ``--my-size``."""
    return "--" + attr.replace("_", "-")


def option_fields(options_cls: type):
    """The flag fields of an options dataclass (fairseq's private ``_name`` left out)."""
    return [f for f in fields(options_cls) if not f.name.startswith("_")]


def _field_default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _field_type(f, hints: Optional[Dict[str, Any]] = None) -> Tuple[Any, bool]:
    """(base type, optional): ``Optional[int]`` -> (int, True); ``ChoiceEnum`` stays an Enum."""
    t = (hints or {}).get(f.name, f.type)
    args = typing.get_args(t)
    if typing.get_origin(t) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return t, False


def option_defaults() -> Dict[str, Any]:
    """Every method flag's dataclass default (the single place defaults live)."""
    out: Dict[str, Any] = {}
    for entry in SUBLAYER_REGISTRY.values():
        if entry.options is None:
            continue
        for f in option_fields(entry.options):
            out[f.name] = _field_default(f)
    return out


def to_bool(value, flag: str) -> bool:
    """A boolean flag's value: a bool, or the ``"true"``/``"false"`` strings of the string-choice
    flags older configs and checkpoints store."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{flag} must be true or false, got {value!r}")


def _convert(value, kind, flag: str):
    """One option value, as stored in a namespace or config (strings from YAML/old checkpoints
    included), converted to the field's type; one-line ValueError naming the flag."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):  # fairseq ChoiceEnum: keep a str
        value = value.value if isinstance(value, enum.Enum) else str(value)
        choices = [str(c.value) for c in kind]
        if value not in choices:
            raise ValueError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
        return value
    if kind is bool:
        return to_bool(value, flag)
    if kind in (int, float) and isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError:
            pass
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{flag} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag} must be a number, got {value!r}")
        return float(value)
    if kind is str:
        return str(value)
    return value


def build_options(options_cls: type, args) -> Any:
    """The method's options from a model config: each field the config's value if set (not None),
    else the dataclass default, converted to the field's type; then ``validate()`` if the
    dataclass defines one. Every error is one line naming the flag."""
    values = {}
    hints = typing.get_type_hints(options_cls)  # resolves string annotations too
    for f in option_fields(options_cls):
        value = getattr(args, f.name, None)
        kind, optional = _field_type(f, hints)
        if value is None:
            value = _field_default(f)
        if value is not None or not optional:
            value = _convert(value, kind, flag_name(f.name))
        values[f.name] = value
    options = options_cls(**values)
    validate = getattr(options, "validate", None)
    if callable(validate):
        validate()
    return options


def require(options, name: str, ok: bool, what: str):
    """For ``validate()``: ``--name must be <what>, got <value>`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{flag_name(name)} must be {what}, got {getattr(options, name)!r}")


def options_for(name: str, args) -> Any:
    """Sublayer ``name``'s options for the model being built: built once per model (per
    :func:`sharing_scope`), a fresh instance outside of one; None for methods without options."""
    cls = SUBLAYER_REGISTRY[name].options
    if cls is None:
        return None
    scope = _SCOPE.get()
    if scope is None:
        return build_options(cls, args)
    cache = scope.options
    if cls not in cache:
        cache[cls] = build_options(cls, args)
    return cache[cls]


def option_owners() -> Dict[str, List[str]]:
    """Every method flag (attribute name) -> the sublayers whose options dataclass holds it
    (several for a dataclass shared by a family of variants)."""
    owners: Dict[str, List[str]] = {}
    for entry in SUBLAYER_REGISTRY.values():
        if entry.options is not None:
            for f in option_fields(entry.options):
                owners.setdefault(f.name, []).append(entry.name)
    return owners


def given_options(args) -> List[str]:
    """The method flags a user set in ``args`` when it is a config nobody has filled yet: on the
    command line (our flags have no argparse default, so a flag not given is None) or as keys of
    a hydra model config. Empty for a config the arch function has already filled (every flag
    with a default holds it: a model built from parsed arguments, a stored checkpoint's config),
    where a value cannot tell the user's choice from a default. A namespace that carries
    ``_name`` is fairseq's copy of a parsed command line (``convert_namespace_to_omegaconf``:
    the model config a run builds from and stores in its checkpoints) and is never fresh, even
    from a checkpoint written before a flag existed."""
    if isinstance(args, argparse.Namespace) and getattr(args, "_name", None) is not None:
        return []
    defaults = option_defaults()
    if all(getattr(args, name, None) is not None for name, value in defaults.items()
           if value is not None):
        return []
    return [name for name in defaults if getattr(args, name, None) is not None]


def used_sublayers(args) -> List[str]:
    """The sublayer names of a filled config's slots, in slot order, each once."""
    out: List[str] = []
    for attr, (slot, _, layers_attr) in SLOT_FLAGS.items():
        if getattr(args, attr, None) is None or getattr(args, layers_attr, None) is None:
            continue
        for name in layer_names(args, attr):
            if name not in out:
                out.append(name)
    return out


def family(names: List[str]) -> str:
    """``["mine"]`` -> "mine"; sublayers sharing one options dataclass (``mine_a``, ``mine_b``)
    -> "mine*"."""
    if len(names) == 1:
        return names[0]
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix.rstrip("_")
    return f"{prefix}*" if prefix else "/".join(names)


def owner_label(names: List[str]) -> str:
    """``["mine"]`` -> "the mine sublayer"; a family -> "the mine* sublayers"."""
    return f"the {family(names)} sublayer{'s' if len(names) > 1 else ''}"


def and_list(items: List[str], conjunction: str = "and") -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def fill_sublayer_defaults(args, decoder_only: bool = False):
    """Called at the end of every zoo arch function: stock slots, then method defaults. First,
    an options dataclass's ``upgrade_stored(args)`` (if it defines one) may give a checkpoint's
    stored config that predates one of its flags the value that keeps the old behaviour."""
    for cls in dict.fromkeys(e.options for e in SUBLAYER_REGISTRY.values() if e.options):
        upgrade = getattr(cls, "upgrade_stored", None)
        if upgrade is not None:
            upgrade(args)
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
    """Every slot flag resolved to its per-layer names, and the options of every method used
    built (inside a :func:`sharing_scope`: once for the model) -- all errors before any module."""
    forget_length_limits()  # a new model: its builders note their own
    out = {}
    for attr, (slot, side, _) in SLOT_FLAGS.items():
        if decoder_only and (side == "encoder" or slot == "cross_attn"):
            continue
        out[attr] = layer_names(args, attr)
    for name in sorted({n for names in out.values() for n in names}):
        options_for(name, args)
    return out


def build_sublayer(name: str, spec: SublayerSpec) -> nn.Module:
    entry = SUBLAYER_REGISTRY[name]
    assert entry.builder is not None, f"{name} is built by fairseq's own layer"
    # users meet this as layer_names' one-line error on the slot flag
    assert spec.slot in entry.slots, f"{name} is a {'/'.join(entry.slots)} module, not {spec.slot}"
    if spec.options is None:
        spec.options = options_for(name, spec.args)
    if spec.slot != "ffn" and spec.embed_dim % spec.num_heads:  # (the module names its args)
        raise ZooConfigError(f"--{spec.side}-embed-dim {spec.embed_dim} is not divisible by "
                             f"--{spec.side}-attention-heads {spec.num_heads}: choose heads that "
                             "divide it")
    return entry.builder(spec)


def tiny_overrides(names) -> Dict[str, Any]:
    """Method-specific size overrides that make a model cheap (used by the generic tests)."""
    out: Dict[str, Any] = {}
    for n in names:
        out.update(SUBLAYER_REGISTRY[n].tiny)
    return out


class FlagErrors:
    """Mixin for the class a builder makes of a plain module: the errors that module raises in
    its own argument names (``size``), of the types in :attr:`flag_errors`, are raised again
    as the one line naming the flags that set those arguments (``--my-size``)."""

    #: exception type -> the flag-worded line for one of them
    flag_errors: Dict[type, Callable[[Exception], str]] = {}

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except tuple(self.flag_errors) as e:  # (evaluated only when something was raised)
            raise ZooConfigError(self.flag_errors[type(e)](e)) from None

"""One registry for the archs of every zoo model, and for what the generic tests need to know.

A zoo model (``attnzoo_transformer``, ``attnzoo_lm``, ``attnzoo_adaptive_span_lm``, ...) declares
its *base arch function* once with :func:`register_base_arch`: it fills every option the user and
the arch left unset with the model's defaults (a dataclass's, fairseq's). Every arch is then a
preset over that base, registered with :func:`register_arch`::

    register_arch("attnzoo_lm", "transformer_lm_aop", decoder_ffn="aop")
    register_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm_large", decoder_layers=24, ...)

Test hooks live here too, declared where the model or arch is registered: ``tiny`` (size
overrides on top of the sweep's tiny sizes) and ``test`` (a dict of :class:`ArchTests` fields:
extra flags, fairseq-eval-lm flags, tolerances). The generic tests read them with
:func:`arch_tests`; sublayers add their own tiny sizes through ``register_sublayer(tiny=...)``.
"""

import contextvars
from argparse import Namespace
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from fairseq.models import (ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY,
                            register_model_architecture)

from .. import compat
from ..messages.errors import ZooConfigError
from ..messages.lengths import forget_length_limits
from .sublayers import (and_list, family, flag_name, given_options, option_owners, owner_label,
                        used_sublayers)


@dataclass(frozen=True)
class ArchTests:
    """How the generic tests build and run an arch (empty: the sweep's defaults)."""

    #: size overrides applied after the sweep's tiny sizes (e.g. a small span S)
    tiny: Mapping[str, Any] = field(default_factory=dict)
    #: extra flags for building and training (e.g. the criterion the model's task needs)
    flags: Tuple[str, ...] = ()
    #: flags of fairseq-eval-lm for an LM (None: ``--tokens-per-sample 24``)
    eval_flags: Optional[Tuple[str, ...]] = None
    #: extra flags for fairseq-train runs only
    train_flags: Tuple[str, ...] = ()
    #: per-check tolerances that differ from the sweep's (name -> max abs difference)
    tolerances: Mapping[str, float] = field(default_factory=dict)

    def over(self, base: "ArchTests") -> "ArchTests":
        """These hooks on top of ``base`` (a model's): dicts merged, flags appended."""
        return replace(base, tiny={**base.tiny, **self.tiny}, flags=base.flags + self.flags,
                       eval_flags=base.eval_flags if self.eval_flags is None else self.eval_flags,
                       train_flags=base.train_flags + self.train_flags,
                       tolerances={**base.tolerances, **self.tolerances})


#: model name -> base arch function
BASE_ARCHS: Dict[str, Callable] = {}
#: arch name -> test hooks (the model's hooks with the arch's on top)
ARCH_TESTS: Dict[str, ArchTests] = {}


def _hooks(where: str, tiny: Optional[Mapping[str, Any]], test: Optional[Mapping[str, Any]]):
    test = dict(test or {})
    names = {f.name for f in fields(ArchTests)} - {"tiny"}
    unknown = sorted(set(test) - names)
    if unknown:
        raise ValueError(f"{where}: unknown test hooks {unknown}; known: {sorted(names)}")
    for key in ("flags", "train_flags", "eval_flags"):
        if test.get(key) is not None:
            test[key] = tuple(test[key])
    return ArchTests(tiny=dict(tiny or {}), **test)


def fill_unset(args, values: Mapping[str, Any]):
    """Set the options of ``args`` that are missing or None (user's choices win)."""
    for key, value in values.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def register_base_arch(model: str, base: Callable, tiny: Optional[Mapping[str, Any]] = None,
                       test: Optional[Mapping[str, Any]] = None) -> Callable:
    """Declare ``base(args)`` the base arch function of ``model`` (also registered as the arch
    named like the model); ``tiny``/``test``: test hooks of every arch of the model."""
    if model in BASE_ARCHS:
        raise ValueError(f"model {model!r} already has a base arch ({BASE_ARCHS[model].__name__})")
    BASE_ARCHS[model] = base
    ARCH_TESTS[model] = _hooks(model, tiny, test)
    register_model_architecture(model, model)(_refusing_unused_flags(model, base))
    return base


@dataclass(frozen=True)
class Derived:
    """A preset value computed from the config once the model's defaults are filled (e.g. a size
    that follows d_model, a per-layer list that follows the layer count); used only when the user
    (or the checkpoint being loaded) left the option unset."""

    fn: Callable[[Any], Any]
    what: str = "derived"  # how it is computed, for listings ("d_model / 2")

    def __repr__(self):
        return f"<{self.what}>"


def register_arch(model: str, name: str, post: Optional[Callable] = None,
                  tiny: Optional[Mapping[str, Any]] = None,
                  test: Optional[Mapping[str, Any]] = None, **preset) -> Callable:
    """Register an arch of a zoo model: ``preset`` overrides defaults the user did not set, then
    the model's base arch fills the rest; the optional ``post(args)`` runs after all defaults are
    filled (e.g. to derive dependent limits or check a combination). A preset value may be a
    :class:`Derived`, computed after the model's defaults. ``tiny``/``test``: this arch's test
    hooks, on top of the model's (see :class:`ArchTests`)."""
    if model not in BASE_ARCHS:
        raise ValueError(f"model {model!r} has no base arch: register it with register_base_arch "
                         f"first (known: {', '.join(sorted(BASE_ARCHS))})")
    base = BASE_ARCHS[model]

    fixed = {k: v for k, v in preset.items() if not isinstance(v, Derived)}
    derived = {k: v.fn for k, v in preset.items() if isinstance(v, Derived)}

    def arch(args):
        later = {k: fn for k, fn in derived.items() if getattr(args, k, None) is None}
        fill_unset(args, fixed)
        base(args)
        for key, fn in later.items():
            setattr(args, key, fn(args))
        if post is not None:
            post(args)

    arch.__name__ = name
    arch.__doc__ = f"{name}: {preset or 'the model defaults'}"
    ARCH_TESTS[name] = _hooks(name, tiny, test).over(ARCH_TESTS[model])
    register_model_architecture(model, name)(_refusing_unused_flags(name, arch))
    return arch


# ---- flags of sublayers the model does not use ---------------------------------------------------

_ARCH_SUBLAYERS: Dict[str, Tuple[str, ...]] = {}


def arch_sublayers(arch: str) -> Tuple[str, ...]:
    """The sublayers ``arch`` builds when the user sets no flag (cached)."""
    if arch not in _ARCH_SUBLAYERS:
        args = Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        _ARCH_SUBLAYERS[arch] = tuple(used_sublayers(args))
    return _ARCH_SUBLAYERS[arch]


def _archs_with(sublayers, like: str):
    """Archs of ``like``'s model whose default sublayers include one of ``sublayers``."""
    model = ARCH_MODEL_REGISTRY[like]
    return [a for a, cls in ARCH_MODEL_REGISTRY.items()
            if cls is model and a in ARCH_TESTS and set(arch_sublayers(a)) & set(sublayers)]


# ---- models built from a checkpoint (compat entry fairseq_model_from_checkpoint) ----------------

#: whether the model being built in this thread / task is a checkpoint's
_CHECKPOINT_BUILD: "contextvars.ContextVar[bool]" = contextvars.ContextVar(
    "attnzoo_from_checkpoint", default=False)


def building_from_checkpoint() -> bool:
    """Whether the model being built is a stored checkpoint's (``load_model_ensemble_and_task``,
    fairseq-generate, -eval-lm, our commands): its config is not the user's command line, so
    checks of the flags a user gave (:func:`check_flag_owners`) do not apply. False when the
    entry ``fairseq_model_from_checkpoint`` is not applied."""
    return _CHECKPOINT_BUILD.get()


def noting_origin(build_model):
    """``fairseq.models.build_model`` that notes ``from_checkpoint`` for
    :func:`building_from_checkpoint` while it builds, and starts every model, fairseq's own too,
    without the length limits noted for the model built before it (its builders note their own:
    :func:`~fairseq_attnzoo.messages.lengths.note_length_limit`)."""

    def build_model_noting_origin(cfg, task, from_checkpoint=False):
        forget_length_limits()
        token = _CHECKPOINT_BUILD.set(bool(from_checkpoint))
        try:
            return build_model(cfg, task, from_checkpoint)
        finally:
            _CHECKPOINT_BUILD.reset(token)

    return build_model_noting_origin


compat.fix("fairseq_model_from_checkpoint", "fairseq.models:build_model",
           "fairseq knows whether it builds a model from a checkpoint (from_checkpoint) but does "
           "not hand it to the arch function: note it, so that a stored config is never refused "
           "as if the user had typed it (e.g. flags of a sublayer the model does not use); and "
           "start each model, fairseq's too, without the length limits of the one built before",
           noting_origin, "616b10d14de9810d", version="fairseq 0.12.3",
           after="fairseq_parser_one_line")


def check_flag_owners(args, arch: str, given):
    """Refuse, in one line, the method flags in ``given`` (set by the user, see
    :func:`~.sublayers.given_options`) that belong to a sublayer this model does not build: not
    one of its slots' sublayers (after the user's slot flags) nor one the arch builds by default
    (a flag that selects layers, e.g. ``--pkm-decoder-layers none``, keeps its sublayer's flags).
    Stock fairseq flags are not looked at. A model built from a checkpoint is never refused
    (:func:`building_from_checkpoint`)."""
    if not given or building_from_checkpoint():
        return
    used = used_sublayers(args)
    if not used:  # a model without sublayer slots (it has none of these flags)
        return
    allowed = set(used) | set(arch_sublayers(arch))
    owners = option_owners()
    unused: Dict[Tuple[str, ...], List[str]] = {}
    for name in given:
        if not allowed & set(owners[name]):
            unused.setdefault(tuple(owners[name]), []).append(flag_name(name))
    if not unused:
        return
    parts = [f"{and_list(flags)} {'is a flag' if len(flags) == 1 else 'are flags'} of "
             f"{owner_label(list(names))}" for names, flags in unused.items()]
    names = next(iter(unused))
    examples = _archs_with(names, arch)[:2]
    fix = "drop " + ("it" if sum(map(len, unused.values())) == 1 else "them")
    if examples:
        fix += f", or use an arch with {family(list(names))} (e.g. {' or '.join(examples)})"
    raise ZooConfigError(f"{'; '.join(parts)}; {arch} has {and_list(used)}: {fix}")


def _refusing_unused_flags(arch: str, fn: Callable) -> Callable:
    """The arch function ``fn`` registered for ``arch``: after it has filled the config, the flags
    of sublayers the model does not use are refused (:func:`check_flag_owners`)."""
    def arch_function(args):
        given = given_options(args)
        fn(args)
        check_flag_owners(args, arch, given)

    arch_function.__name__ = getattr(fn, "__name__", arch)
    arch_function.__doc__ = fn.__doc__
    return arch_function


def apply_base_arch(model_class: type, args):
    """Run the base arch of the model registered as ``model_class`` (for ``build_model``, which
    fairseq may call with options no arch function has filled, e.g. from a hydra config)."""
    names = [n for n in BASE_ARCHS if MODEL_REGISTRY.get(n) is model_class]
    if not names:
        raise ValueError(f"{model_class.__name__} has no base arch: register it with "
                         "register_base_arch")
    BASE_ARCHS[names[0]](args)


def arch_tests(arch: str) -> ArchTests:
    """The test hooks of ``arch`` (an arch registered outside :func:`register_arch` gets its
    model's)."""
    if arch in ARCH_TESTS:
        return ARCH_TESTS[arch]
    cls = ARCH_MODEL_REGISTRY.get(arch)
    model = next((n for n in BASE_ARCHS if MODEL_REGISTRY.get(n) is cls), None)
    return ARCH_TESTS.get(model, ArchTests())

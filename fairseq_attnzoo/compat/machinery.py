"""The machinery of the compatibility table (:mod:`fairseq_attnzoo.compat`): a :class:`Patch` (one
entry), :func:`register` and :func:`fix` (add one), :func:`replace` / :func:`restore` (install a
wrapper, put the original back), the checks (:func:`known_source`, :func:`always`) and
:func:`apply_all` (and :func:`built_by_fairseq`, the hook that applies it before fairseq builds
one of ours), :func:`undo_all`, :func:`status`, :func:`require`, :func:`describe`. The rows are in
:mod:`.fixes`; the package re-exports both.

One undo contract for every row: applying it returns how to undo what it changed, or
:data:`NOTHING_CHANGED` when it found nothing to change in this process (a hook for console
scripts in a program that is not one, an allow-list that already holds the class); the row is then
``applied`` or ``unchanged`` (:func:`describe` shows which), and :func:`undo_all` gives back
everything the table changed, the process environment included. Anything else is a bug of the
row, refused when it is applied."""

import functools
import hashlib
import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

from ..messages.errors import ZooConfigError

logger = logging.getLogger("fairseq_attnzoo.compat")  # the name its log lines have always had

ENV_DISABLE = "ATTNZOO_COMPAT_DISABLE"

APPLIED, UNCHANGED, SKIPPED, DISABLED = "applied", "unchanged", "skipped", "disabled"

#: a target naming an environment variable: ``"env:HYDRA_FULL_ERROR"`` (its value a str, or None
#: when it is not set)
ENV = "env:"


class NothingChanged:
    """The type of :data:`NOTHING_CHANGED`."""

    def __repr__(self):
        return "NOTHING_CHANGED"


#: what a row's apply returns when it found nothing to change in this process (not an undo: there
#: is nothing to undo; the row's status is ``unchanged``)
NOTHING_CHANGED = NothingChanged()

Undo = Callable[[], None]


@dataclass
class Patch:
    name: str
    target: str  # what is changed: "module:attribute", then a note where that says too little
    why: str  # one line
    #: None when the target is the version this patch knows; otherwise why it is not applied
    check: Callable[[], Optional[str]]
    #: makes the change; returns how to undo it, or NOTHING_CHANGED
    apply: Callable[[], Union[Undo, NothingChanged]]
    #: the library and version whose behaviour the entry changes ("fairseq 0.12.3", "NumPy 2")
    version: str = ""


PATCHES: List[Patch] = []
_STATUS: Dict[str, str] = {}
_REASONS: Dict[str, str] = {}  # why an entry was skipped
#: "module:attribute" -> [(owner, attribute, what it held)] before each replace, the last last
#: (an environment variable: (os.environ, name, its value or None))
_ORIGINALS: Dict[str, List[tuple]] = {}
_UNDO: Dict[str, Undo] = {}  # applied entry -> how to undo it


def register(entry: Patch, after: Optional[str] = None) -> Patch:
    """Add ``entry`` to the table: at the end, or right after the entry named ``after`` (the
    order entries are applied and listed in)."""
    if any(p.name == entry.name for p in PATCHES):
        raise ValueError(f"compat patch {entry.name!r} is defined twice")
    at = len(PATCHES) if after is None else [p.name for p in PATCHES].index(after) + 1
    PATCHES.insert(at, entry)
    return entry


def _owner(path: str):
    """``(object, attribute)`` named by ``"module:Class.attribute"``."""
    module, _, attrs = path.partition(":")
    owner = importlib.import_module(module)
    *outer, attr = attrs.split(".")
    for name in outer:
        owner = getattr(owner, name)
    return owner, attr


def lookup(path: str):
    """What ``"module:Class.attribute"`` holds now (a class's method as ``Class.method`` gives, a
    property as the property); ``"env:NAME"``: the variable's value, None when it is not set."""
    if path.startswith(ENV):
        return os.environ.get(path[len(ENV):])
    owner, attr = _owner(path)
    return getattr(owner, attr)


def replace(path: str, wrap: Callable) -> Union[Undo, NothingChanged]:
    """Install ``wrap(original)`` at ``"module:Class.attribute"``, keeping the original for
    :func:`restore`; returns that undo, or :data:`NOTHING_CHANGED` when ``wrap`` returned the
    original itself (nothing to change here). A classmethod's function is wrapped and stays a
    classmethod; a property is handed over and returned as one (``property(...)``); the
    replacement gets the original's docstring where it has none of its own. ``"env:NAME"``:
    ``wrap(value or None)`` is the variable's new value (None: unset)."""
    if path.startswith(ENV):
        name = path[len(ENV):]
        original = os.environ.get(name)
        new = wrap(original)
        if new == original:
            return NOTHING_CHANGED
        _ORIGINALS.setdefault(path, []).append((os.environ, name, original))
        _set_env(name, new)
        return lambda: restore(path)
    owner, attr = _owner(path)
    held = inspect.getattr_static(owner, attr)
    original = held.__func__ if isinstance(held, classmethod) else getattr(owner, attr)
    new = wrap(original)
    if new is original:
        return NOTHING_CHANGED
    if new.__doc__ is None and not isinstance(new, property):
        new.__doc__ = original.__doc__
    _ORIGINALS.setdefault(path, []).append((owner, attr, held if attr in vars(owner) else None))
    setattr(owner, attr, classmethod(new) if isinstance(held, classmethod) else new)
    return lambda: restore(path)


def _set_env(name: str, value: Optional[str]):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def restore(path: str) -> None:
    """Put back what ``"module:Class.attribute"`` held before the last :func:`replace` of it (an
    inherited attribute is inherited again; an environment variable gets its value back, or is
    unset again)."""
    owner, attr, held = _ORIGINALS[path].pop()
    if not _ORIGINALS[path]:
        del _ORIGINALS[path]
    if owner is os.environ:
        _set_env(attr, held)
    elif held is None:
        delattr(owner, attr)
    else:
        setattr(owner, attr, held)


def together(*changes: Union[Undo, NothingChanged]) -> Union[Undo, NothingChanged]:
    """One row's result of several changes (each an undo or :data:`NOTHING_CHANGED`): the undo of
    those that changed something, the last first; NOTHING_CHANGED when none did."""
    undos = [c for c in changes if c is not NOTHING_CHANGED]
    if not undos:
        return NOTHING_CHANGED

    def undo():
        for u in reversed(undos):
            u()

    return undo


def source_digest(fn) -> Optional[str]:
    """SHA-256 (16 hex digits) of a function's source; a property's is its getter's."""
    if isinstance(fn, property):
        fn = fn.fget
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def known_source(get: Callable[[], object], *digests: str) -> Callable[[], Optional[str]]:
    """A check that passes when the function returned by ``get()`` has one of these digests."""

    def check():
        try:
            fn = get()
        except (ImportError, AttributeError) as e:
            return f"target not found ({e})"
        digest = source_digest(fn)
        if digest in digests:
            return None
        return (f"{getattr(fn, '__qualname__', fn)} is not the version this patch was written for "
                f"(source digest {digest}, known {', '.join(digests)})")

    return check


def always() -> Optional[str]:
    return None


def fix(name: str, target: Union[str, Dict[str, Callable]], why: str,
        wrap: Optional[Callable] = None, *digests: str, version: str = "",
        check: Optional[Callable[[], Optional[str]]] = None, after: Optional[str] = None) -> Patch:
    """Register the entry that replaces ``target``'s ``"module:Class.attribute"`` (its first
    word; a method, classmethod or property) or ``"env:NAME"`` (an environment variable) with
    ``wrap(original)`` -- or each path of a ``{path: wrap}`` dict with its wrap (:func:`replace`:
    a wrap that returns the original changes nothing there) -- applied when each path's source
    has one of ``digests`` (none given: not checked; a property's source is its getter's) and
    ``check`` (if given) passes; undone by :func:`restore` of each path it changed."""
    wraps = dict(target) if isinstance(target, dict) else {target.split()[0]: wrap}
    checks = ([check] if check else []) + [known_source(lambda p=p: lookup(p), *digests)
                                           for p in wraps if digests and not p.startswith(ENV)]

    def checked() -> Optional[str]:
        return next((reason for reason in (c() for c in checks) if reason is not None), None)

    def apply():
        return together(*(replace(path, w) for path, w in wraps.items()))

    label = " and ".join(wraps) if isinstance(target, dict) else target
    return register(Patch(name, label, why, checked, apply, version), after)


def disabled_names() -> set:
    raw = os.environ.get(ENV_DISABLE, "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def apply_all() -> Dict[str, str]:
    """Apply every entry not yet handled in this process; returns :func:`status`. Cheap after
    the first call (each entry is handled once per process)."""
    if len(_STATUS) == len(PATCHES):
        return status()
    off = disabled_names()
    unknown = sorted(off - {p.name for p in PATCHES} - {"all"})
    if unknown and not _STATUS:
        logger.warning(f"{ENV_DISABLE}: no compat patch named {', '.join(unknown)}; the names are "
                       f"{', '.join(p.name for p in PATCHES)} (or all)")
    new = []
    for p in PATCHES:
        if p.name in _STATUS:
            continue
        if "all" in off or p.name in off:
            _STATUS[p.name] = DISABLED
            new.append(f"{p.name} (disabled)")
            continue
        reason = p.check()
        if reason is not None:
            _STATUS[p.name] = SKIPPED
            _REASONS[p.name] = reason
            logger.warning(f"compat: {p.name} not applied: {reason}; {p.target} left unchanged "
                           f"({p.why})")
            continue
        undo = p.apply()
        if undo is NOTHING_CHANGED:
            _STATUS[p.name] = UNCHANGED
            new.append(f"{p.name} (unchanged)")
            continue
        if not callable(undo):  # pragma: no cover - a row of our own that breaks the contract
            raise TypeError(f"compat entry {p.name} returned {undo!r}: a row's apply returns its "
                            "undo or compat.NOTHING_CHANGED")
        _UNDO[p.name] = undo
        _STATUS[p.name] = APPLIED
        new.append(p.name)
    if new:  # one short line per process; the names at DEBUG (attnzoo-archs --compat: the table)
        off = [n for n in new if n.endswith(" (disabled)")]
        same = [n for n in new if n.endswith(" (unchanged)")]
        logger.info(f"compat: {len(new) - len(off) - len(same)} patches of fairseq/torch applied"
                    + (f", disabled: {', '.join(n.split()[0] for n in off)}" if off else "")
                    + f" (attnzoo-archs --compat lists them; {ENV_DISABLE}=NAME,... opts out)")
        logger.debug(f"compat patches: {', '.join(new)}")
    return status()


def built_by_fairseq(build: Callable) -> Callable:
    """The build hook: decorates what fairseq calls to build one of ours (a model's
    ``build_model``, a task's ``setup_task``, a criterion's or an optimizer's ``__init__``).
    fairseq building it uses the plugin, so the table is applied first (once per process)."""

    @functools.wraps(build)
    def building(*args, **kwargs):
        apply_all()
        return build(*args, **kwargs)

    return building


def undo_all() -> List[str]:
    """Undo every applied entry, the last applied first, and forget what happened to each (a
    later :func:`apply_all` handles the table again): fairseq, torch, NumPy and the process
    environment are as before the first :func:`apply_all`. Returns the names undone."""
    names = [p.name for p in reversed(PATCHES) if p.name in _UNDO]
    for name in names:
        _UNDO.pop(name)()
    _STATUS.clear()
    _REASONS.clear()
    return names


def status() -> Dict[str, str]:
    """``{entry: applied | unchanged | skipped | disabled}`` of the entries handled so far in this
    process (empty until fairseq uses the plugin or a program calls
    :func:`fairseq_attnzoo.enable`, and again after :func:`undo_all`)."""
    return dict(_STATUS)


def require(name: str, needed_by: str, alternative: str = "") -> None:
    """Refuse, in one line naming the entry, to go on without entry ``name`` (applies the table
    first). ``needed_by``: what needs it ("adaptive spans under --fp16"); ``alternative``: another
    way out, appended to the fix ("or train with --amp")."""
    if name not in {p.name for p in PATCHES}:  # pragma: no cover - a typo in our own code
        raise KeyError(name)
    state = apply_all().get(name)
    if state in (APPLIED, UNCHANGED):  # (unchanged: this process needed no change)
        return
    if state == DISABLED:
        raw = os.environ.get(ENV_DISABLE, "")
        why = f"disabled by {ENV_DISABLE}={raw}"
        remedy = f"leave {name} out of {ENV_DISABLE}"
    else:
        why = f"not applied: {_REASONS.get(name, 'unknown reason')}"
        remedy = "install fairseq-fixed==0.12.3.1"
    more = f" {alternative}" if alternative else ""
    raise ZooConfigError(f"{needed_by} needs the compat entry {name} ({why}): {remedy}{more}")


def describe() -> str:
    """A table of the entries, their targets, reasons and what happened to each (``unchanged``:
    applied, and nothing needed changing in this process)."""
    rows = [f"{p.name:34s} {_STATUS.get(p.name, 'not run'):9s} {p.target}\n{'':45s}{p.why}"
            + (f" [{p.version}]" if p.version else "") for p in PATCHES]
    return "\n".join(rows)

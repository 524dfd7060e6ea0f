"""hydra's config composition, quicker where the tests run many fairseq commands (tests only).

Every fairseq command composes its config with hydra (``convert_namespace_to_omegaconf``): one
override string a command-line argument -- about 250, most of them the same from one command to
the next (``common.log_interval=100``, ...) -- each parsed by hydra's ANTLR grammar, and the
config repository copied twice, its structured-config source with hydra's whole ``ConfigStore``
(every dataclass fairseq and the plugin register). A transformer_lm_pkm training config took
0.33-0.42 s of CPU (measured in one process composing it 10 times after once): 55 ms of it
parsing, about 130 ms copying the store; in the DDP tests' runs the config was about half of
a run.

* :func:`memoize_override_parsing` keeps each string's parse (hydra's ``Override``) and hands out
  a deep copy of it the next time the same string comes, with the same grammar functions: the
  override hydra would have parsed (parsing 55 ms -> 3.6 ms). A string that does not parse is
  parsed every time (hydra raises its own error).
* :func:`live_config_store` has the structured-config source read the store itself instead of
  holding it, as hydra does since its pull request 2928 ("Use latest configstore singleton
  instead of storing it"; hydra 1.3.2 here): a copy of the repository no longer copies it.
* :func:`one_frame_caller` has hydra's ``initialize`` (which finds its caller's file: a relative
  config path is relative to it) read the one frame it uses instead of every frame of the
  stack: ``inspect.stack()`` reads each frame's source line and looks up each frame's module,
  and a frame without a module file (``<frozen runpy>``, a forked command's) searched every
  loaded module each time.

:func:`quicker_compose` does all three (the config then takes about 0.2 s): tests/conftest.py in the
pytest workers (in-process ``run_cli``), tests/ddp_runner.py, and the console servers
(tests/console_server.py) before they fork their commands. tests/test_hydra_testlib.py checks
composed configs against hydra's own.
"""

import copy
import inspect
import sys


def quicker_compose():
    """:func:`memoize_override_parsing`, :func:`live_config_store` and :func:`one_frame_caller`."""
    memoize_override_parsing()
    live_config_store()
    one_frame_caller()


def memoize_override_parsing():
    """Memoise ``OverridesParser.parse_rule`` by (string, rule, grammar functions). Idempotent."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse_rule = OverridesParser.parse_rule
    if getattr(parse_rule, "memo", None) is not None:
        return
    memo = {}

    def memoized(self, s, rule_name):
        key = (s, rule_name, tuple(sorted(self.functions.functions)))
        if key not in memo:
            memo[key] = parse_rule(self, s, rule_name)
        return copy.deepcopy(memo[key])

    memoized.memo = memo
    memoized.stock = parse_rule  # (hydra's, for the test)
    OverridesParser.parse_rule = memoized


def live_config_store():
    """``StructuredConfigSource.store`` is the ``ConfigStore`` singleton, read when used, not an
    attribute a copy of the source copies. The class patched is the one hydra's sources registry
    resolves: hydra's plugin scan (``Plugins.instance()``, run here first) executes its core
    plugins' modules again and registers the classes of that run, not those of
    ``sys.modules``. Idempotent."""
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    source = SourcesRegistry.instance().resolve("structured")
    if isinstance(vars(source).get("store"), property):
        return

    def set_store(self, store):
        assert store is ConfigStore.instance(), "a StructuredConfigSource of another ConfigStore"

    source.store = property(lambda self: ConfigStore.instance(), set_store)


class _Frames:
    """``inspect.stack(context)`` of the frame ``outer`` and those above it, each ``FrameInfo``
    made when it is asked for (an index, a slice, in turn)."""

    def __init__(self, outer, context):
        self.frames, self.context = [], context
        while outer is not None:
            self.frames.append(outer)
            outer = outer.f_back

    def _info(self, frame):
        return inspect.FrameInfo(frame, *inspect.getframeinfo(frame, self.context))

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return [self._info(frame) for frame in self.frames[at]]
        return self._info(self.frames[at])

    def __iter__(self):
        return (self._info(frame) for frame in self.frames)


class _OneFrameInspect:
    """``inspect`` as hydra's ``_internal.utils`` sees it, with a ``stack`` that reads only the
    frames asked for."""

    stock = inspect

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context=1):
        return _Frames(sys._getframe(1), context)


def one_frame_caller():
    """``inspect.stack()`` in ``hydra._internal.utils`` (its caller lookup, which takes the one
    frame ``stack[depth]``) makes only the frame infos it is asked for. Idempotent."""
    from hydra._internal import utils

    if not isinstance(utils.inspect, _OneFrameInspect):
        utils.inspect = _OneFrameInspect()

"""tests/hydra_testlib.py: with hydra's override parser memoised and its structured-config source
reading the live ConfigStore (as the pytest workers and tests/ddp_runner.py run it), a fairseq
command's config is the one hydra as it ships composes, the second time too; a string hydra
refuses is still refused, and copying a config repository no longer copies the store."""

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import OmegaConf

from hydra_testlib import quicker_compose
from zoo_testlib import quiet, tiny_flags


def _config(arch, data):
    """(the composed config as yaml, the override strings hydra parsed for it)"""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf, override_module_args

    with quiet():
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           tiny_flags(arch, data) + ["--lr", "0.25"])
        return (OmegaConf.to_yaml(convert_namespace_to_omegaconf(args)),
                set(override_module_args(args)[0]))


def test_a_quicker_compose_composes_hydras_config(mt_data, lm_data, monkeypatch):
    from hydra._internal import utils
    from hydra._internal.sources_registry import SourcesRegistry

    source = SourcesRegistry.instance().resolve("structured")  # (the class hydra uses)

    # tests/conftest.py applied it in this worker
    assert OverridesParser.parse_rule.memo is not None and isinstance(
        vars(source)["store"], property) and utils.inspect.stock
    quicker_compose()  # (a second call changes nothing)
    live_store = vars(source)["store"]
    memoized = OverridesParser.parse_rule
    first, strings = _config("transformer_pkm", mt_data)
    parsed = {key[0] for key in memoized.memo}
    assert len(strings) > 100 and strings <= parsed  # each parsed once, kept
    assert _config("transformer_pkm", mt_data)[0] == first  # (from the memo)
    lm = _config("transformer_lm_pkm", lm_data)[0]
    monkeypatch.setattr(OverridesParser, "parse_rule", memoized.stock)  # hydra as it ships
    monkeypatch.delattr(source, "store")
    monkeypatch.setattr(utils, "inspect", utils.inspect.stock)
    assert isinstance(live_store, property) and not hasattr(source, "store")
    assert _config("transformer_pkm", mt_data)[0] == first
    assert _config("transformer_lm_pkm", lm_data)[0] == lm


def test_a_memoised_parse_is_a_copy_and_refusals_stay():
    quicker_compose()
    parser = OverridesParser.create()
    a, b = parser.parse_overrides(["optimization.lr=[0.25,0.5]"] * 2)
    assert a == b and a is not b and a.value() is not b.value()
    a.value().append(1.0)  # (hydra's own use may change what it was given)
    assert parser.parse_overrides(["optimization.lr=[0.25,0.5]"])[0].value() == [0.25, 0.5]
    for _ in range(2):
        with pytest.raises(OverrideParseException, match="no viable alternative"):
            parser.parse_overrides(["common.seed=[1"])


def test_a_copied_repository_reads_the_one_config_store():
    import copy

    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_store import ConfigStore

    quicker_compose()
    repository = CachingConfigRepository(ConfigRepository(create_config_search_path(None)))
    structured = [s for s in repository.get_sources() if s.scheme() == "structured"]
    assert structured and all(s.store is ConfigStore.instance() for s in structured)
    assert "store" not in vars(structured[0]) and copy.deepcopy(structured[0]).store is \
        ConfigStore.instance()


def test_hydras_caller_lookup_reads_one_frame_and_finds_what_stock_finds(monkeypatch):
    """hydra's initialize finds its caller's file and module as with inspect.stack(), reading
    only the frame it uses; the other use of the stack in that module (is_under_debugger) sees
    the same frames."""
    import inspect

    from hydra._internal import utils

    quicker_compose()
    read = []
    info = inspect.getframeinfo
    monkeypatch.setattr(inspect, "getframeinfo", lambda f, c=1: (read.append(f), info(f, c))[1])

    def lookups():
        return (utils.detect_calling_file_or_module_from_stack_frame(1),
                utils.is_under_debugger(), len(utils.inspect.stack()))

    quick, reads = lookups(), len(read)
    assert quick[0] == (__file__, None) and reads <= 5  # (the stack is ~40 frames deep)
    monkeypatch.setattr(utils, "inspect", utils.inspect.stock)  # hydra as it ships
    assert lookups()[:2] == quick[:2] and len(read) - reads > 30


def test_a_console_servers_commands_compose_quicker():
    """A console server that imported fairseq applies it before it forks its commands
    (tests/console_server.py's first config)."""
    import os

    from console_server import SERVERS

    code = ("from hydra._internal import utils\n"
            "from hydra._internal.sources_registry import SourcesRegistry\n"
            "from hydra.core.override_parser.overrides_parser import OverridesParser\n"
            "source = SourcesRegistry.instance().resolve('structured')\n"
            "assert OverridesParser.parse_rule.memo and utils.inspect.stock\n"
            "assert isinstance(vars(source)['store'], property)\n")
    status, _, err = SERVERS.run("-c", [code], env=dict(os.environ), cwd=os.getcwd(),
                                 preload=("fairseq",), timeout=120)
    assert status == 0, err[-2000:]

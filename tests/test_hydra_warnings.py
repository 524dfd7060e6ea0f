"""fairseq 0.12 composes every config through hydra.experimental's initialize/compose, and hydra
1.3 answered each command with about 20 lines of deprecation warnings on stderr. The compat entry
``hydra_deprecation_warnings`` silences exactly those messages inside those two calls; other
warnings (the user's own included) are untouched."""

import warnings

import fairseq_attnzoo  # noqa: F401  (applies the compat entries)
from zoo_testlib import tiny_flags


def test_loading_a_config_prints_no_hydra_deprecation(mt_data):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_attnzoo import compat

    assert compat.status()["hydra_deprecation_warnings"] == compat.APPLIED
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       tiny_flags("transformer_aop", mt_data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = convert_namespace_to_omegaconf(args)
        warnings.warn("the user's own warning", UserWarning)
    assert cfg.model.arch == "transformer_aop"
    messages = [str(w.message) for w in caught]
    assert messages == ["the user's own warning"], messages


def test_outside_fairseq_config_loading_hydra_warnings_still_show():
    """Only inside fairseq's calls: hydra's own API used elsewhere keeps its warnings."""
    from hydra.experimental import initialize

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with initialize(config_path=None):
            pass
    assert any("no longer experimental" in str(w.message) for w in caught)

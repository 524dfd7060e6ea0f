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


def test_generate_and_eval_lm_print_no_debug_lines(lm_data, mt_data, tmp_path):
    """fairseq's wav2vec2_classification sets the root logger to DEBUG when fairseq's models are
    imported, before fairseq-generate / fairseq-eval-lm configure logging: hydra's
    ``DEBUG:hydra.core.utils`` lines reached stderr (compat entry fairseq_root_log_level)."""
    import os

    from console_server import SERVERS  # (each command its own process, imports paid once)
    from zoo_testlib import USER_DIR

    missing = str(tmp_path / "missing.pt")  # the DEBUG lines came before the checkpoint is read
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOGLEVEL", None)
    for program, data in (("fairseq-eval-lm", lm_data), ("fairseq-generate", mt_data)):
        code, out, _ = SERVERS.run(program, [data, "--user-dir", USER_DIR, "--cpu", "--path",
                                             missing], env=env, cwd=tmp_path, merge=True)
        assert code != 0 and "missing.pt" in out, (program, out[-2000:])
        assert not [line for line in out.splitlines() if "DEBUG" in line], (program, out[-2000:])


def test_fairseq_train_prints_neither_pin_memory_nor_autocast_warning(mt_data):
    """Every fairseq command printed torch's pin_memory UserWarning (no accelerator: nothing to
    pin) and fairseq's torch.cuda.amp.autocast FutureWarning (the same context under an old
    name); compat entries torch_pin_memory_without_accelerator and fairseq_cuda_amp_autocast
    filter exactly those, in the console scripts. With the entries disabled both are back."""
    from test_one_line_errors import cli  # (its console server: fairseq-train's imports once)
    from zoo_testlib import USER_DIR

    argv = [mt_data, "--user-dir", USER_DIR, "--arch", "transformer", "--cpu", "--max-tokens",
            "500", "--optimizer", "adam", "--lr", "1e-3", "--max-update", "1", "--no-save",
            "--encoder-layers", "1", "--decoder-layers", "1", "--num-workers", "0"]
    noise = ("'pin_memory' argument is set as true", "torch.cuda.amp.autocast(args...)")
    for disabled in ("", "torch_pin_memory_without_accelerator,fairseq_cuda_amp_autocast"):
        code, lines = cli("fairseq-train", *argv, env={"ATTNZOO_COMPAT_DISABLE": disabled},
                          stdout_too=True)
        assert code == 0, lines[-20:]
        printed = [n for n in noise if any(n in line for line in lines)]
        assert printed == ([] if not disabled else list(noise)), (disabled, printed)

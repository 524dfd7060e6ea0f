"""A flag of a sublayer the model does not build is refused in one line naming the arch's
sublayers (it used to be accepted and ignored: ``--pkm-knn 8`` on transformer_synth_random trained
without a memory, exit 0). Only flags the user gave count (command line or hydra model config);
stock fairseq flags are not looked at; configs stored in checkpoints are never refused."""

import pytest
from omegaconf import OmegaConf

import fairseq_attnzoo  # noqa: F401  (registers the archs)
from fairseq_attnzoo.messages.errors import ZooConfigError
from zoo_testlib import USER_DIR, quiet


def parse(*argv):
    from fairseq import options

    return options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--user-dir", USER_DIR, *argv])


@pytest.mark.parametrize("argv,words", [
    (["--arch", "transformer_synth_random", "--pkm-knn", "8"],
     ["--pkm-knn is a flag of the pkm sublayer", "transformer_synth_random has synth_random, mha "
      "and ffn", "transformer_pkm"]),
    # explicitly given at its default value: still a flag the model ignores
    (["--arch", "transformer_synth_random", "--pkm-knn", "32"], ["--pkm-knn", "pkm sublayer"]),
    (["--arch", "transformer_lm_pkm", "--task", "language_modeling", "--synth-max-len", "64",
      "--collab-qk-bias"],
     ["--synth-max-len is a flag of the synth* sublayers", "--collab-qk-bias is a flag of the "
      "collab sublayer", "transformer_lm_pkm has mha, ffn and pkm", "drop them"]),
])
def test_flag_of_an_unused_sublayer_is_refused(argv, words):
    with pytest.raises(ZooConfigError) as e:
        parse(*argv)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv", [
    ["--arch", "transformer_synth_random", "--synth-max-len", "64", "--dropout", "0.2"],
    # the user's slot flag puts a memory in: its flags apply
    ["--arch", "attnzoo_transformer", "--decoder-ffn", "pkm", "--pkm-knn", "8"],
    # a flag that removes the arch's own sublayer keeps that sublayer's flags legal
    ["--arch", "transformer_lm_pkm", "--task", "language_modeling", "--pkm-decoder-layers",
     "none"],
    ["--arch", "transformer_aop"],
])
def test_flags_of_used_sublayers_and_stock_flags_pass(argv):
    parse(*argv)


def _lm_task(lm_data):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from zoo_testlib import tiny_flags

    args = options.parse_args_and_arch(options.get_training_parser(),
                                       tiny_flags("transformer_lm_synth_random", lm_data))
    with quiet():
        return tasks.setup_task(convert_namespace_to_omegaconf(args).task)


def test_hydra_model_config_with_a_flag_of_an_unused_sublayer(lm_data):
    """fairseq-hydra-train builds from the model config's keys: a key of another method is refused
    the same way; the same config stored in a checkpoint loads."""
    from fairseq import models

    task = _lm_task(lm_data)

    def cfg(**extra):
        return OmegaConf.create({"_name": "transformer_lm_synth_random", "decoder_layers": 1,
                                 "decoder_embed_dim": 16, "decoder_ffn_embed_dim": 32,
                                 "decoder_attention_heads": 2, "synth_max_len": 24,
                                 "tokens_per_sample": 24, **extra})

    with pytest.raises(ZooConfigError, match="--pkm-knn is a flag of the pkm sublayer; "
                       "transformer_lm_synth_random has synth_random and ffn"):
        models.build_model(cfg(pkm_knn=8), task)
    models.build_model(cfg(), task)
    models.build_model(cfg(pkm_knn=8), task, from_checkpoint=True)  # a stored config: not refused

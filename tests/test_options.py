"""Typed sublayer options: each method's options dataclass is built once per model from the
model's config (defaults filled, values converted to the field types, validated), and every bad
value is one line naming its flag. Builder level, no command line (except the --no-x test)."""

import enum
import typing
from argparse import Namespace
from dataclasses import fields

import pytest

import fairseq_attnzoo  # noqa: F401  (registers the sublayers)
from fairseq_attnzoo.models import sublayers
from fairseq_attnzoo.modules.aop import AttentionOverParameters
from fairseq_attnzoo.models.sublayers import (
    SUBLAYER_REGISTRY,
    SublayerSpec,
    build_options,
    build_sublayer,
    options_for,
    sharing_scope,
)
from zoo_testlib import USER_DIR, build

#: the sublayers whose builders read typed options (and sdpa, which has none)
TYPED = ["aop", "collab", "synth", "synth_dense", "synth_fixed_random", "synth_factorized_dense"]


def _spec(name: str, **flags) -> SublayerSpec:
    slot = "ffn" if name == "aop" else "self_attn"
    return SublayerSpec(slot=slot, side="encoder", layer_idx=0, num_layers=1, embed_dim=32,
                        num_heads=4, ffn_dim=64, attention_dropout=0.0, activation_dropout=0.0,
                        causal=False, kdim=32, args=Namespace(**flags))


def _base(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) is typing.Union else t


@pytest.mark.parametrize("name", TYPED)
def test_options_are_the_dataclass_defaults_with_their_types(name):
    cls = SUBLAYER_REGISTRY[name].options
    opts = options_for(name, Namespace())  # nothing set: every field is its default
    assert type(opts) is cls
    for f in fields(cls):
        if f.name.startswith("_"):
            continue
        value = getattr(opts, f.name)
        assert value == f.default, f.name
        kind = _base(typing.get_type_hints(cls)[f.name])
        if value is not None:
            expected = str if isinstance(kind, type) and issubclass(kind, enum.Enum) else kind
            assert type(value) is expected, (f.name, type(value), expected)
    module = build_sublayer(name, _spec(name, **SUBLAYER_REGISTRY[name].tiny))
    assert sum(p.numel() for p in module.parameters()) > 0


def test_values_from_configs_and_old_checkpoints_are_converted_once():
    """YAML configs and checkpoints store strings (and the "true"/"false" of string-choice
    flags); the options hold the field types."""
    opts = options_for("synth", Namespace(synth_max_len="64", synth_rank=8.0,
                                          synth_share_heads="true", synth_freeze_random="False",
                                          synth_factor_a=None))
    assert (opts.synth_max_len, opts.synth_rank, opts.synth_factor_a) == (64, 8, None)
    assert opts.synth_share_heads is True and opts.synth_freeze_random is False
    opts = options_for("aop", Namespace(aop_dropout="0.25", aop_heads="2", aop_scale_at="init"))
    assert (opts.aop_dropout, opts.aop_heads, opts.aop_scale_at) == (0.25, 2, "init")
    assert options_for("sdpa", Namespace()) is None


@pytest.mark.parametrize("stored,expected", [("false", False), ("true", True), (False, False),
                                             (True, True), ("False", False)])
def test_bool_spellings_reach_the_module(stored, expected):
    """``bool("false")`` is True: a config or checkpoint storing the string turned q/k biases on."""
    m = build_sublayer("collab", _spec("collab", collab_key_dim=16, collab_qk_bias=stored))
    assert (m.q_proj.bias is not None) is expected and (m.content_bias is None) is expected
    m = build_sublayer("synth_random", _spec("synth_random", synth_max_len=16,
                                             synth_share_heads=stored))
    assert m.share_heads is expected


@pytest.mark.parametrize("name,flags,match", [
    ("aop", {"aop_heads": 0}, "--aop-heads must be a positive integer, got 0"),
    ("aop", {"aop_slots": -1}, "--aop-slots must be a positive integer, got -1"),
    ("aop", {"aop_key_dim": "wide"}, "--aop-key-dim must be an integer, got 'wide'"),
    ("aop", {"aop_width_factor": 0}, "--aop-width-factor must be a positive integer, got 0"),
    ("aop", {"aop_dropout": 1.0}, r"--aop-dropout must be in \[0, 1\), got 1.0"),
    ("aop", {"aop_dropout": "high"}, "--aop-dropout must be a number, got 'high'"),
    ("aop", {"aop_scale_at": "both"}, "--aop-scale-at 'both' is not one of: use, init"),
    ("aop", {"aop_token_bucket": -8},
     r"--aop-token-bucket must be 0 \(no padding\) or a positive integer, got -8"),
    ("collab", {"collab_key_dim": -3}, "--collab-key-dim must be a non-negative integer"),
    ("collab", {"collab_mixing_init": "bogus"}, "--collab-mixing-init 'bogus' is not one of"),
    ("collab", {"collab_scaling": "none"}, "--collab-scaling 'none' is not one of"),
    ("collab", {"collab_proj_init": "t5"}, "--collab-proj-init 't5' is not one of"),
    ("collab", {"collab_qk_bias": "maybe"}, "--collab-qk-bias must be true or false, got 'maybe'"),
    ("synth", {"synth_max_len": 0}, "--synth-max-len must be a positive integer, got 0"),
    ("synth", {"synth_rank": 0}, "--synth-rank must be a positive integer, got 0"),
    ("synth", {"synth_factor_b": 0}, "--synth-factor-b must be a positive integer, got 0"),
    ("synth", {"synth_mix": "dense,bogus"}, "--synth-mix 'dense,bogus': give distinct names"),
    ("synth_dense", {"synth_share_heads": "yes"}, "--synth-share-heads must be true or false"),
    ("synth_random", {"synth_table_kernel": "fast"},
     "--synth-table-kernel 'fast' is not one of: auto, sdpa, table"),
    ("synth_factorized_dense", {"synth_max_len": 16, "synth_factor_a": 3, "synth_factor_b": 3},
     "--synth-factor-a 3 x --synth-factor-b 3 = 9 is less than --synth-max-len 16"),
])
def test_bad_value_is_one_line_naming_the_flag(name, flags, match):
    with pytest.raises(ValueError, match=match) as e:
        build_sublayer(name, _spec(name, **flags))
    assert "\n" not in str(e.value)


def test_options_are_built_once_per_model(mt_data, monkeypatch):
    calls = []
    real = sublayers.build_options
    monkeypatch.setattr(sublayers, "build_options", lambda cls, args: calls.append(cls) or
                        real(cls, args))
    _, _, model, _ = build("transformer_aop", mt_data)
    n_aop = sum(isinstance(m, AttentionOverParameters) for m in model.modules())
    assert n_aop >= 2 and calls == [SUBLAYER_REGISTRY["aop"].options]
    with sharing_scope():  # one instance for every sublayer of one model
        assert options_for("collab", Namespace()) is options_for("collab", Namespace())
    assert options_for("collab", Namespace()) is not options_for("collab", Namespace())


def test_bool_preset_can_be_turned_off_on_the_command_line():
    from fairseq import options

    def parse(*extra):
        return options.parse_args_and_arch(options.get_training_parser(), [
            "/nonexistent", "--user-dir", USER_DIR, "--task", "translation", *extra])

    assert parse("--arch", "transformer_collab_fork").collab_qk_bias is True
    args = parse("--arch", "transformer_collab_fork", "--no-collab-qk-bias")
    assert args.collab_qk_bias is False and args.collab_scaling == "head_dim"
    assert build_options(SUBLAYER_REGISTRY["collab"].options, args).collab_qk_bias is False
    assert parse("--arch", "transformer_collab", "--collab-qk-bias").collab_qk_bias is True
    assert parse("--arch", "transformer_collab").collab_qk_bias is False

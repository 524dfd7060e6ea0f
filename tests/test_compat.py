"""Checkpoints written before the issue-14 fidelity changes still load and compute the same function.

Fixtures (``tests/fixtures/compat``, written by ``tests/fixtures/make_compat_fixtures.py`` at commit
a7dcf99): tiny ``fairseq-train`` checkpoints of every arch whose defaults changed (AOP, collab,
Synthesizer LM, adaptive span / All-Attention) with their outputs on a fixed input, and, for the AOP
archs, the stored config of a model built with the *old default* memory sizes.
"""

import glob
import os

import pytest
import torch

import fairseq_attnzoo
from fairseq import checkpoint_utils, tasks

fairseq_attnzoo.enable()  # a script loading checkpoints: the weights-only allow-list first

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "compat")
CHECKPOINTS = sorted(os.path.basename(p)[:-5] for p in glob.glob(f"{FIXTURES}/*.ckpt")
                     if not p.endswith(".defaults.ckpt"))
DEFAULTS = sorted(os.path.basename(p)[:-len(".defaults.ckpt")]
                  for p in glob.glob(f"{FIXTURES}/*.defaults.ckpt"))


def test_fixtures_present():
    assert {"transformer_aop", "transformer_aop_h16", "transformer_lm_aop", "transformer_collab",
            "transformer_lm_synth_random", "adaptive_span_lm", "all_attention_lm"} <= set(CHECKPOINTS)
    assert set(DEFAULTS) == {"transformer_aop", "transformer_aop_h16", "transformer_lm_aop"}


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_old_checkpoint_loads_with_same_outputs(arch):
    path = os.path.join(FIXTURES, arch + ".ckpt")
    ref = torch.load(path, map_location="cpu", weights_only=False)["compat"]
    overrides = {"data": FIXTURES}
    if ref["is_mt"]:
        overrides.update(source_lang="src", target_lang="tgt")
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    model = models[0].eval()
    net_input = ref["net_input"]
    with torch.no_grad():
        if ref["is_mt"]:
            out = model(**net_input)[0]
        else:
            out = model(net_input["src_tokens"])[0]
    torch.testing.assert_close(out, ref["output"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", DEFAULTS)
def test_old_default_sizes_rebuild_the_same_parameters(arch):
    from omegaconf import OmegaConf

    state = torch.load(os.path.join(FIXTURES, arch + ".defaults.ckpt"), weights_only=False)
    cfg = OmegaConf.create(state["cfg"], flags={"allow_objects": True})  # as fairseq loads it
    cfg.task.data = FIXTURES
    if "source_lang" in cfg.task:
        cfg.task.source_lang, cfg.task.target_lang = "src", "tgt"
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert shapes == state["shapes"]


@pytest.mark.parametrize("arch", ["transformer_lm_pkm", "transformer_lm_memplus"])
def test_old_memory_checkpoints_keep_the_residual_dropout(arch):
    """Memory checkpoints written before --pkm-residual-dropout (fairseq's --dropout then always
    dropped the memory output) store no value for it: they load with it on, and a training step
    drops the memory output exactly as that code did."""
    import torch.nn.functional as F

    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    path = os.path.join(FIXTURES, arch + ".ckpt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert "pkm_residual_dropout" not in vars(state["cfg"]["model"])  # written before the flag
    models, cfg, _ = checkpoint_utils.load_model_ensemble_and_task([path],
                                                                  arg_overrides={"data": FIXTURES})
    assert cfg.model.pkm_residual_dropout is True
    layers = [layer for layer in models[0].decoder.layers if isinstance(layer.ffn, ProductKeyMemory)]
    assert layers and all(layer.ffn.residual_dropout for layer in layers)
    layer = layers[0].train()
    p = layer.dropout_module.p
    assert p > 0  # the stored --dropout 0.1
    x = torch.randn(6, 2, layer.ffn.input_dim)
    torch.manual_seed(0)
    out = layer._ffn_block(x, None)
    torch.manual_seed(0)  # the old computation: the memory (its own dropouts), then --dropout
    h = layer.final_layer_norm(x) if layer.normalize_before else x
    y = x + F.dropout(layer.ffn(h, None), p, training=True)
    ref = y if layer.normalize_before else layer.final_layer_norm(y)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

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

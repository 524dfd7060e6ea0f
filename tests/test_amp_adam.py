"""fairseq's ``--amp`` double unscale and the plugin's fix (compat entry
``fairseq_amp_single_unscale``, ``compat/mixed_precision.py``; README, docs/precision.md).

Stock fairseq 0.12 unscales the gradients twice under ``--amp``: the optimizer sees g / S instead of
g, S the loss scale. With the plugin, fairseq's own ``AMPOptimizer`` updates a weight exactly as an
fp32 run does. Adam's update m̂ / (√v̂ + ε) is scale-invariant only while √v̂ ≫ ε; once S has grown
(2¹⁶ after a few thousand clean updates) the twice-divided gradient is comparable to ε = 1e-8 and
the step shrinks: the figures the docs quote, for ``torch.optim.Adam`` (10 steps of a constant
gradient, stock g / S against intended g).
"""

import pytest
import torch

import fairseq_attnzoo
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.optim.amp_optimizer import AMPOptimizer

fairseq_attnzoo.enable()  # the table applied: AMPOptimizer.step is the plugin's


def _fairseq_amp_displacement(grad: float, scale, stock: bool = False, steps: int = 10) -> float:
    """|w| after ``steps`` --amp updates of fairseq's Adam (gradient ``grad``) through fairseq's
    AMPOptimizer with loss scale ``scale`` (None: an fp32 run, no AMPOptimizer): the trainer's
    calls (backward of the scaled loss, clip_grad_norm, step); ``stock``: fairseq's own step."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = FairseqAdam(FairseqAdamConfig(lr=[1e-3], adam_betas="(0.9, 0.999)", adam_eps=1e-8), [w])
    if scale is not None:
        amp = AMPOptimizer.__new__(AMPOptimizer)  # (its __init__ asks for a CUDA scaler)
        amp.fp32_optimizer, amp.min_loss_scale = opt, 1e-4
        amp._grad_scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6)
        opt = amp
    for _ in range(steps):
        opt.zero_grad()
        opt.backward((w * grad).sum())
        opt.clip_grad_norm(0.0)
        if stock:  # fairseq 0.12's AMPOptimizer.step, as shipped
            opt.scaler.step(opt.fp32_optimizer)
            opt.scaler.update()
        else:
            opt.step()
    return abs(w.item())


@pytest.mark.parametrize("scale", [2.0 ** 16, 128.0])
@pytest.mark.parametrize("g", [1e-3, 1e-5])
def test_an_amp_update_with_the_plugin_is_the_fp32_update(g, scale):
    fp32 = _fairseq_amp_displacement(g, None)
    assert _fairseq_amp_displacement(g, scale) == pytest.approx(fp32, rel=1e-5)
    assert _fairseq_amp_displacement(g, scale, stock=True) < 0.99 * fp32  # fairseq's: shrunk


def _adam_displacement(grad: float, steps: int = 10) -> float:
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1e-3, eps=1e-8)
    for _ in range(steps):
        w.grad = torch.full_like(w, grad)
        opt.step()
    return abs(w.item())


@pytest.mark.parametrize("scale,g,ratio", [
    (2.0 ** 16, 1e-3, 0.60), (2.0 ** 16, 1e-4, 0.13), (2.0 ** 16, 1e-5, 0.015),
    (128.0, 1e-3, 0.999), (128.0, 1e-4, 0.987), (128.0, 1e-5, 0.89),
])
def test_double_unscaled_adam_step_shrinks_with_the_loss_scale(scale, g, ratio):
    intended = _adam_displacement(g)  # the fixed optimizer: unscaled once
    stock = _adam_displacement(g / scale)  # stock fairseq --amp: unscaled twice
    assert stock / intended == pytest.approx(ratio, rel=0.02, abs=1e-3)
    # Adam's step with a constant gradient c is lr·c/(|c| + ε) (bias corrections cancel)
    c = g / scale
    assert stock / intended == pytest.approx((c / (c + 1e-8)) / (g / (g + 1e-8)), rel=1e-3)

"""What fairseq's ``--amp`` double unscale does to Adam (README, docs/precision.md).

Stock fairseq 0.12 unscales the gradients twice under ``--amp`` (``optim/mixed_precision.py``
explains why and fixes it): the optimizer sees g / S instead of g, S the loss scale. Adam's update
m̂ / (√v̂ + ε) is scale-invariant only while √v̂ ≫ ε; once S has grown (2¹⁶ after a few thousand
clean updates) the twice-divided gradient is comparable to ε = 1e-8 and the step shrinks. Pure
torch: ``torch.optim.Adam``, 10 steps of a constant gradient, stock (g / S) against intended (g).
"""

import pytest
import torch


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

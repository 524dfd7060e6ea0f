"""RMSNorm (Zhang & Sennrich, 2019): y = g ⊙ x / sqrt(mean(x²) + eps), torch's ``nn.RMSNorm``.

The statistics are taken in float32 and the result cast back once, as fairseq's
``Fp32LayerNorm``/``Fp32GroupNorm`` do inside an fp16 model (the reference's ``RMSNorm._norm``
also works on ``x.float()``). Parameter: ``weight`` (g) only. Imports torch only.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

#: the memory code's default (facebookresearch/memory, lingua/transformer.py,
#: BaseTransformerArgs.norm_eps)
RMSNORM_EPS = 1e-5


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm(dim, eps)`` computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = RMSNORM_EPS):
        super().__init__(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(),
                          self.eps).to(x.dtype)

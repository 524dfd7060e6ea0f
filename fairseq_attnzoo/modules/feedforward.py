"""The feed-forward half of the extension point: the base class of position-wise replacements.

Imports torch only.
"""

from typing import Optional

import torch.nn as nn
from torch import Tensor


class ZooFeedForward(nn.Module):
    """Base class of feed-forward (position-wise) replacements.

    ``forward(x [T, B, C], padding_mask [B, T] or None) -> [T, B, C]``. The padding mask lets
    methods with batch statistics (product-key memory's BatchNorm) ignore pads.
    """

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError

"""The feed-forward half of the extension point: the base class of position-wise replacements.

Imports torch only.
"""

from typing import Optional

import torch.nn as nn
from torch import Tensor

from .attention import bool_mask


class ZooFeedForward(nn.Module):
    """Base class of feed-forward (position-wise) replacements.

    ``forward(x [T, B, C], padding_mask [B, T] or None) -> [T, B, C]``. The padding mask lets
    methods with batch statistics (product-key memory's BatchNorm) ignore pads.
    """

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError

    def padding(self, x: Tensor, padding_mask: Optional[Tensor]) -> Optional[Tensor]:
        """``padding_mask`` as a bool ``[B, T]`` mask (True = pad; any form
        ``nn.MultiheadAttention`` takes: :func:`.attention.bool_mask`) for the time-first
        ``x [T, B, C]``; of another shape (a time-major ``[T, B]`` one), one line saying so."""
        if padding_mask is not None and tuple(padding_mask.shape) != tuple(x.shape[1::-1]):
            raise ValueError(
                f"{type(self).__name__} padding_mask has shape {list(padding_mask.shape)} but "
                f"should be [B, T] = {list(x.shape[1::-1])} for the time-first input x [T, B, C] "
                "(a [T, B] mask: transpose it)")
        return bool_mask(padding_mask, "padding_mask")

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
        ``x [T, B, C]``; an ``x`` of another rank, or a mask of another shape, one line saying
        which to transpose or reshape."""
        name = type(self).__name__
        if x.dim() != 3:
            fix = ("for tokens without a batch, pass x.unsqueeze(1) ([T, 1, C])" if x.dim() == 2
                   else "reshape it to [T, B, C]")
            raise ValueError(f"{name} takes a time-first x [T, B, C] (3 dims, as fairseq's "
                             f"layers), got {x.dim()} dims {list(x.shape)}: {fix}")
        if padding_mask is not None and tuple(padding_mask.shape) != tuple(x.shape[1::-1]):
            swapped = tuple(padding_mask.shape) == tuple(x.shape[:2])
            fix = ("either x is batch-first [B, T, C]: pass x.transpose(0, 1), or the mask is "
                   "time-major [T, B]: pass padding_mask.transpose(0, 1)" if swapped
                   else "pass a mask of x's batch and length")
            raise ValueError(
                f"{name} padding_mask has shape {list(padding_mask.shape)} but should be "
                f"[B, T] = {list(x.shape[1::-1])} for the time-first x [T, B, C] = "
                f"{list(x.shape)}: {fix}")
        return bool_mask(padding_mask, "padding_mask")

"""SwiGLU feed-forward (Shazeer, 2020, "GLU Variants Improve Transformer"), the Llama form:

    FFN(x) = W2 (SiLU(W1 x) ⊙ W3 x)

three projections without biases by default. To keep the parameter count of a d → 4d → d FFN the
hidden size is 2/3 of the FFN size, rounded up to a multiple (256 in the reference):
:func:`swiglu_hidden_dim`. Imports torch only.
"""

from typing import Optional

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .feedforward import ZooFeedForward


def swiglu_hidden_dim(ffn_dim: int, multiple_of: int = 256) -> int:
    """The hidden size for an FFN of size ``ffn_dim``, rounded as facebookresearch/memory's
    ``lingua/transformer.py`` (``FeedForward.__init__``, called with ``hidden_dim = 4 * dim``)
    rounds it: ``int(2 * ffn_dim / 3)``, then up to a multiple of ``multiple_of``."""
    hidden = int(2 * ffn_dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class SwiGLU(ZooFeedForward):
    """``w2(silu(w1 x) * w3 x)``; ``forward(x [T, B, C], padding_mask) -> [T, B, C]``."""

    def __init__(self, embed_dim: int, ffn_dim: int, multiple_of: int = 256, bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.hidden_dim = swiglu_hidden_dim(ffn_dim, multiple_of)
        self.w1 = nn.Linear(embed_dim, self.hidden_dim, bias=bias)
        self.w3 = nn.Linear(embed_dim, self.hidden_dim, bias=bias)
        self.w2 = nn.Linear(self.hidden_dim, embed_dim, bias=bias)
        self.dropout = dropout  # on the gated hidden units (fairseq's --activation-dropout)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        self.padding(x, padding_mask)  # position-wise: pads are computed and ignored
        h = F.silu(self.w1(x)) * self.w3(x)
        return self.w2(F.dropout(h, p=self.dropout, training=self.training))

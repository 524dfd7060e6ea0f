"""Persistent memory vectors (Sukhbaatar et al., 2019, "Augmenting Self-attention with Persistent
Memory", the All-Attention layer).

Every head owns N trainable key/value vectors that do not depend on the input. They are
concatenated to the context keys/values, so one softmax runs over context + persistent slots:

    a_t = softmax([q_t K_ctx^T + pos , q_t K_pers^T] / sqrt(d_h)),   y_t = a_t [V_ctx ; V_pers]

No position embedding is added to the persistent slots. With persistent memory the layer drops its
feed-forward sublayer: the persistent values play the role of the FFN weights.

Initialisation follows the reference code: keys ~ N(0, 1)/sqrt(d_h) and values ~ N(0, 1)/sqrt(N),
stored that way and multiplied back by sqrt(d_h) and sqrt(N) at use. The forward values are those of
N(0, 1) vectors; the parametrisation only changes the scale of the optimizer's steps (Adagrad).

torch only: the attention that consumes these logits/values lives in :mod:`.adaptive_span`.
"""

import math

import torch
import torch.nn as nn
from torch import Tensor


class PersistentMemory(nn.Module):
    """``N`` persistent key/value vectors per head.

    Args:
        num_slots: N, the number of persistent vectors per head
        num_heads: H
        head_dim: d_h
    """

    def __init__(self, num_slots: int, num_heads: int, head_dim: int):
        super().__init__()
        if num_slots <= 0:
            raise ValueError(f"persistent memory needs at least one slot, got num_slots "
                             f"{num_slots}: pass a positive number (AdaptiveSpanAttention: "
                             "persistent_slots=0 for none)")
        self.num_slots = num_slots
        self.num_heads = num_heads
        self.head_dim = head_dim
        # reference parametrisation: stored scaled down, scaled up at use (see module docstring)
        self.key = nn.Parameter(torch.randn(num_heads, head_dim, num_slots) / math.sqrt(head_dim))
        self.value = nn.Parameter(
            torch.randn(num_heads, num_slots, head_dim) / math.sqrt(num_slots))

    def keys(self) -> Tensor:
        """Persistent keys ``[H, d_h, N]`` (already transposed for ``q @ keys``)."""
        return self.key * math.sqrt(self.head_dim)

    def values(self) -> Tensor:
        """Persistent values ``[H, N, d_h]``."""
        return self.value * math.sqrt(self.num_slots)

    def logits(self, q: Tensor) -> Tensor:
        """``q [B, H, M, d_h]`` (already scaled by 1/sqrt(d_h)) -> logits ``[B, H, M, N]``."""
        return torch.matmul(q, self.keys())

    def read(self, probs: Tensor) -> Tensor:
        """Attention weights on the slots ``[B, H, M, N]`` -> ``[B, H, M, d_h]``."""
        return torch.matmul(probs, self.values())

    def extra_repr(self) -> str:
        return f"slots={self.num_slots}, heads={self.num_heads}, head_dim={self.head_dim}"

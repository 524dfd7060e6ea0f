"""Plain multi-head attention (Vaswani et al., 2017) on the shared base, through PyTorch's fused
scaled-dot-product kernel: softmax(Q Kᵀ / √d_k + mask) V per head.

The reference for the base's masking and caching, a drop-in for fairseq's ``MultiheadAttention``
(same parameter names, so weights are interchangeable), and the "vanilla" component of mixtures.
Registered as the ``sdpa`` sublayer by :mod:`fairseq_attnzoo.models.sdpa`. Imports torch only.
"""

import math
from typing import Optional

import torch.nn as nn
from torch import Tensor

from .attention import AttnContext, ZooAttention
from .rotary import RotaryEmbedding


def init_like_fairseq_mha(input_projections, out_proj: nn.Linear):
    """fairseq MultiheadAttention's init: xavier with gain 1/sqrt(2) on the input projections,
    plain xavier on the output projection, zero output bias."""
    for lin in input_projections:
        nn.init.xavier_uniform_(lin.weight, gain=1 / math.sqrt(2))
    nn.init.xavier_uniform_(out_proj.weight)
    if out_proj.bias is not None:
        nn.init.constant_(out_proj.bias, 0.0)


class ZooMultiheadAttention(ZooAttention):
    """Plain multi-head attention on the shared base (fused SDPA kernel); time-first ``[T, B, C]``.

    Same parameters and names as fairseq's ``MultiheadAttention`` (q_proj/k_proj/v_proj/out_proj),
    so weights are interchangeable; a test checks the outputs agree. It is the reference for the
    base's masking and caching, and the "vanilla" component of mixtures.

    ``rope_theta``: rotary position embeddings (:mod:`.rotary`) on queries and keys of
    self-attention, base theta (None: none; encoder-decoder attention is never rotated: its
    queries and keys index different sequences). ``bias=False``: projections without biases."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, kdim=None, vdim=None,
                 bias: bool = True, rope_theta: Optional[float] = None):
        super().__init__(embed_dim, num_heads, dropout)
        self.rotary = None if rope_theta is None else RotaryEmbedding(self.head_dim, rope_theta)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        init_like_fairseq_mha((self.q_proj, self.k_proj, self.v_proj), self.out_proj)

    def keys_values(self, x_kv: Optional[Tensor], ctx: AttnContext):
        if ctx.static_kv:
            return (ctx.cache_static("k", lambda: self.split_heads(self.k_proj(x_kv))),
                    ctx.cache_static("v", lambda: self.split_heads(self.v_proj(x_kv))))
        k = self.k_proj(x_kv)
        if self.rotary is not None:  # rotated once, at the keys' own positions, then cached
            b, t, _ = k.shape
            k = self.rotary(k.view(b, t, self.num_heads, self.head_dim), ctx.offset,
                            seq_dim=-3).flatten(2)
        kv = ctx.cache(k=k, v=self.v_proj(x_kv))
        return self.split_heads(kv["k"]), self.split_heads(kv["v"])

    def compute(self, x_q, x_kv, ctx):
        q = self.split_heads(self.q_proj(x_q))
        if self.rotary is not None and not ctx.static_kv:
            # the step's queries sit after the ctx.offset cached positions (RoPE: relative)
            q = self.rotary(q, ctx.offset)
        k, v = self.keys_values(x_kv, ctx)
        return self.out_proj(self.merge_heads(ctx.attend(q, k, v)))

"""Collaborative heads vs fairseq's MultiheadAttention: parameters and inference time.

d 512, 8 heads, batch 8 x 128 tokens, self-attention, forward only in eval mode, at the paper's
shared key/query dimensions D̃k in {512, 256, 128, 64} (512 = the concatenated heads' H·d_k).
"""

import torch
import torch.nn as nn

from scripts.bench.benchlib import SublayerCase, register_case
from fairseq.modules.multihead_attention import MultiheadAttention

from fairseq_attnzoo.modules.collab import CollaborativeAttention

D, HEADS, BATCH, TOKENS = 512, 8, 8, 128


class _SelfAttention(nn.Module):
    """module(x) -> self-attention output, without attention weights (as in the layers)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _inputs():
    return (torch.randn(TOKENS, BATCH, D, generator=torch.Generator().manual_seed(0)),)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _qk_params(module: nn.Module) -> int:
    names = ("q_proj", "k_proj", "mixing", "content_bias")
    return sum(p.numel() for n, p in module.named_parameters() if n.split(".")[0] in names)


def _mha():
    return MultiheadAttention(D, HEADS, self_attention=True)


def _collab(key_dim):
    return CollaborativeAttention(D, HEADS, key_dim)


for _dk in (512, 256, 128, 64):
    register_case(SublayerCase(
        group="attention", name=f"collab D̃k={_dk} vs fairseq mha",
        note=f"d {D}, {HEADS} heads, batch {BATCH}x{TOKENS}, forward, eval",
        candidate=lambda dk=_dk: (_SelfAttention(_collab(dk)).eval(), _inputs()),
        baseline=lambda: (_SelfAttention(_mha()).eval(), _inputs()),
        forward_only=True,
        extra=lambda dk=_dk: {"params": _params(_collab(dk)), "baseline params": _params(_mha()),
                              "q/k params": _qk_params(_collab(dk)),
                              "baseline q/k params": _qk_params(_mha())},
    ))

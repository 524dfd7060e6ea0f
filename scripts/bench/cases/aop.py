"""AOP₁ / AOP₂ sublayer vs fairseq's FFN (fc1-ReLU-fc2, 512→2048→512), 4096 tokens, forward+backward.

Paper: AOP steps are ~30% slower than the baseline; our goal is <= 1.10x for the sublayer."""

import torch
import torch.nn as nn

from scripts.bench.benchlib import SublayerCase, register_case
from fairseq_attnzoo.modules.aop import AttentionOverParameters

D, FFN, T, B = 512, 2048, 128, 32  # 4096 tokens, time-first like fairseq


def _x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, B, D, generator=g, requires_grad=True)


def ffn():
    torch.manual_seed(0)
    # exactly fairseq's position-wise FFN (activation dropout 0)
    return nn.Sequential(nn.Linear(D, FFN), nn.ReLU(), nn.Linear(FFN, D)), (_x(),)


def aop(heads, slots):
    def make():
        torch.manual_seed(0)
        return AttentionOverParameters(D, heads=heads, key_dim=64, value_dim=64, slots=slots), (_x(),)
    return make


register_case(SublayerCase(group="ffn", name="aop1 (h8 n1536) vs ffn", candidate=aop(8, 1536),
                           baseline=ffn, note="4096 tokens, d 512, d_ff 2048", target=1.10))
register_case(SublayerCase(group="ffn", name="aop2 (h16 n512) vs ffn", candidate=aop(16, 512),
                           baseline=ffn, note="4096 tokens, d 512, d_ff 2048", target=1.10))

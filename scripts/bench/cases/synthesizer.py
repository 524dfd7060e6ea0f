"""Synthesizer self-attention vs fairseq's MultiheadAttention: forward+backward of the sublayer.

Batch 8, d 512, 8 heads, L = 128/256/512, self-attention without masks, the same input for both;
every synthesizer has N = --synth-max-len = 512 (Dense computes only the first L columns of W2).
Target (issue): pure Random <= 0.55x of MHA at L=512 (FLOP ratio ~0.5: no Q/K projections, no QK^T).
"""

import torch
from scripts.bench.benchlib import SublayerCase, register_case
from fairseq.modules import MultiheadAttention

from fairseq_attnzoo.models.synthesizer import VARIANTS
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

BATCH, DIM, HEADS, MAX_LEN = 8, 512, 8, 512
LENGTHS = (128, 256, 512)
TARGETS = {("random", 512): 0.55}


class FairseqSelfAttention(torch.nn.Module):
    """fairseq MHA called as its transformer layers call it (need_weights=False: fused path)."""

    def __init__(self):
        super().__init__()
        self.mha = MultiheadAttention(DIM, HEADS, self_attention=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def _input(length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    return torch.randn(length, BATCH, DIM, generator=g).requires_grad_()  # time-first


def _candidate(variant: str, length: int):
    def make():
        torch.manual_seed(0)
        components, frozen = VARIANTS[variant]
        module = SynthesizerAttention(DIM, HEADS, components=components, max_len=MAX_LEN,
                                      freeze_random=frozen)
        return module, (_input(length),)

    return make


def _baseline(length: int):
    def make():
        torch.manual_seed(0)
        return FairseqSelfAttention(), (_input(length),)

    return make


for _length in LENGTHS:
    for _variant in VARIANTS:
        register_case(SublayerCase(
            group="self_attn", name=f"synth_{_variant} vs fairseq mha",
            note=f"B {BATCH}, L {_length}, d {DIM}, {HEADS} heads, N {MAX_LEN}, no mask",
            candidate=_candidate(_variant, _length), baseline=_baseline(_length),
            target=TARGETS.get((_variant, _length))))

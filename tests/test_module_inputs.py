"""The plain PyTorch modules check their inputs as torch's own layers do (issue 45): a mask or input
whose shape contradicts the documented layout is a one-line ``ValueError``, never sliced or
ignored; and every module returns autocast's dtype under ``torch.autocast``."""

import pytest
import torch

from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanAttention
from fairseq_attnzoo.modules.aop import AttentionOverParameters
from fairseq_attnzoo.modules.collab import CollaborativeAttention
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

D, T, B = 16, 10, 2


def _causal(n):
    return torch.triu(torch.full((n, n), float("-inf")), 1)


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as err:
        fn()
    assert "\n" not in str(err.value)


ATTENTIONS = {
    "synthesizer": lambda: SynthesizerAttention(D, 2, components=("random",), max_len=32),
    "synthesizer_dense": lambda: SynthesizerAttention(D, 2, components=("dense",), max_len=32),
    "collab": lambda: CollaborativeAttention(D, num_heads=2, key_dim=8),
}


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_oversized_attn_mask_is_refused_not_sliced(name):
    torch.manual_seed(0)
    attn, x = ATTENTIONS[name](), torch.randn(T, B, D)
    attn(x, x, x, attn_mask=_causal(T))  # the right size runs
    _one_line_error(lambda: attn(x, x, x, attn_mask=_causal(T + 2)), r"attn_mask .*\[10, 10\]")


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_batch_first_input_is_refused_where_the_masks_tell(name):
    torch.manual_seed(0)
    attn, x = ATTENTIONS[name](), torch.randn(B, T, D)  # [B, T, C] instead of [T, B, C]
    pad = torch.zeros(B, T, dtype=torch.bool)
    _one_line_error(lambda: attn(x, x, x, attn_mask=_causal(T)), "time-first")
    _one_line_error(lambda: attn(x, x, x, key_padding_mask=pad), "time-first")


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_time_major_padding_mask_is_refused(name):
    attn, x = ATTENTIONS[name](), torch.randn(T, B, D)
    _one_line_error(lambda: attn(x, x, x, key_padding_mask=torch.zeros(T, B, dtype=torch.bool)),
                    r"key_padding_mask .*\[B, T\]")


def test_synthesizer_longer_than_max_len_names_the_layout():
    attn = SynthesizerAttention(D, 2, components=("random",), max_len=8)
    x = torch.randn(T, B, D)
    _one_line_error(lambda: attn(x, x, x), "time-first")


def test_pkm_padding_mask_of_another_shape_is_refused_not_ignored():
    torch.manual_seed(0)
    pkm = ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8).eval()
    x, pad = torch.randn(T, B, D), torch.zeros(B, T, dtype=torch.bool)
    pad[1, 6:] = True
    out = pkm(x, pad)
    assert out[6:, 1].abs().max() == 0  # padding read nothing
    _one_line_error(lambda: pkm(x, pad.t()), r"padding_mask .*\[B, T\]")


def test_adaptive_span_without_key_pe_says_what_to_pass():
    attn = AdaptiveSpanAttention(D, num_heads=2, max_span=8)
    _one_line_error(lambda: attn(torch.randn(B, T, D)), "own_key_pe=True")
    out, _ = AdaptiveSpanAttention(D, num_heads=2, max_span=8, own_key_pe=True)(
        torch.randn(B, T, D))
    assert out.shape == (B, T, D)


def test_adaptive_span_time_first_input_is_refused_where_it_can_be_told():
    attn = AdaptiveSpanAttention(D, num_heads=2, max_span=8, own_key_pe=True)
    x = torch.randn(T, B, D)  # time-first, where the module is batch-first
    _one_line_error(lambda: attn(x, key_padding_mask=torch.zeros(B, T, dtype=torch.bool)),
                    r"batch-first x \[B, M, C\]")
    _one_line_error(lambda: attn(x, memory=torch.randn(B, 4, D)), "batch-first")
    assert "batch-first" in AdaptiveSpanAttention.__doc__.splitlines()[0]


def test_every_module_returns_autocasts_dtype():
    torch.manual_seed(0)
    x = torch.randn(T, B, D)
    ffns = {"pkm": ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8),
            "aop": AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8, slots=16)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, ffn in ffns.items():
            assert ffn(x).dtype == torch.bfloat16, name
        for name, make in ATTENTIONS.items():
            assert make()(x, x, x)[0].dtype == torch.bfloat16, name
        out, _ = AdaptiveSpanAttention(D, 2, max_span=8, own_key_pe=True)(x.transpose(0, 1))
        assert out.dtype == torch.bfloat16

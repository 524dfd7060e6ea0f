"""The plain PyTorch modules check their inputs as torch's own layers do (issue 45): a mask or input
whose shape contradicts the documented layout is a one-line ``ValueError``, never sliced or
ignored; and every module returns autocast's dtype under ``torch.autocast``. Issue 56: every mask
form ``nn.MultiheadAttention`` takes gives one result, empty sequences give empty outputs, and a
module's messages name its own arguments."""

import pytest
import torch

from fairseq_attnzoo.modules.adaptive_span import (AdaptiveSpanAttention, AdaptiveSpanLayer,
                                                   span_penalty)
from fairseq_attnzoo.modules.aop import AttentionOverParameters
from fairseq_attnzoo.modules.collab import CollaborativeAttention
from fairseq_attnzoo.modules.persistent_memory import PersistentMemory
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.modules.sdpa import ZooMultiheadAttention
from fairseq_attnzoo.modules.swiglu import SwiGLU
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


# ---- masks in every form nn.MultiheadAttention takes (issue 56) ---------------------------------
def _time_first(make):
    """An attention with fairseq's call ``attn(x, x, x, key_padding_mask=, attn_mask=)``."""
    def call(x, pad, mask=None):
        return make()(x, x, x, key_padding_mask=pad, attn_mask=mask)[0]
    return call


def _span(**kw):
    """AdaptiveSpanAttention (batch-first) called on the time-first x."""
    def call(x, pad, mask=None):
        torch.manual_seed(0)
        attn = AdaptiveSpanAttention(D, 2, max_span=8, own_key_pe=True, span_init=0.5, **kw)
        return attn(x.transpose(0, 1), key_padding_mask=pad)[0].transpose(0, 1)
    return call


def _ffn(make):
    def call(x, pad, mask=None):
        return make().eval()(x, pad)
    return call


def _seeded(make):
    def build():
        torch.manual_seed(0)
        return make()
    return build


MASKED = {
    **{name: _time_first(_seeded(make)) for name, make in ATTENTIONS.items()},
    "synthesizer_factorized": _time_first(_seeded(lambda: SynthesizerAttention(
        D, 2, components=("factorized_random", "factorized_dense", "vanilla"), max_len=32,
        rank=4))),
    "zoo_mha_rope": _time_first(_seeded(lambda: ZooMultiheadAttention(D, 2, rope_theta=1e4))),
    "adaptive_span": _span(),
    "adaptive_span_persistent": _span(persistent_slots=4),
    "pkm": _ffn(_seeded(lambda: ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8))),
    "aop": _ffn(_seeded(lambda: AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8,
                                                        slots=16))),
}


def _padding():
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :3] = True  # left padded
    pad[1, 7:] = True  # right padded
    return pad


AS = {  # the same mask in the forms nn.MultiheadAttention takes (ints as bool)
    "int64": lambda m: m.long(),
    "uint8": lambda m: m.to(torch.uint8),
    "int32": lambda m: m.int(),
    "float_additive": lambda m: torch.zeros(m.shape).masked_fill(m, float("-inf")),
    "float_fairseq_fp16": lambda m: torch.zeros(m.shape).masked_fill(m, -1e4),
}


@pytest.mark.parametrize("form", sorted(AS))
@pytest.mark.parametrize("name", sorted(MASKED))
def test_every_mask_form_gives_the_bool_masks_result(name, form):
    """An integer 0/1 padding mask gave SynthesizerAttention other outputs (max difference 0.1
    -0.9, unpadded sentences too: ``~`` on integers), a uint8 one an index error, a float one a
    TypeError."""
    torch.manual_seed(0)
    x, pad = torch.randn(T, B, D), _padding()
    with torch.no_grad():
        want = MASKED[name](x, pad)
        got = MASKED[name](x, AS[form](pad))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(MASKED))
def test_a_float_mask_that_stands_for_no_bool_mask_is_refused(name):
    """1.0 meant as True (``pad.float()``) is an additive +1 to nn.MultiheadAttention: it was
    read as True by some modules, ignored by others."""
    x, pad = torch.randn(T, B, D), _padding()
    _one_line_error(lambda: MASKED[name](x, pad.float()), r"padding_mask of dtype float32 is an "
                    r"additive mask .* holds 1\.0: pass a bool mask")


@pytest.mark.parametrize("form", ["int64", "uint8", "float_additive"])
@pytest.mark.parametrize("name", sorted(ATTENTIONS) + ["zoo_mha_rope"])
def test_every_attn_mask_form_gives_the_bool_masks_result(name, form):
    """An integer causal attn_mask was compared ``<= -1e4``: never true, the mask ignored."""
    torch.manual_seed(0)
    x, causal = torch.randn(T, B, D), _causal(T) < 0
    with torch.no_grad():
        want = MASKED[name](x, None, causal)
        got = MASKED[name](x, None, AS[form](causal))
    assert torch.equal(got, want)


# ---- empty sequences (issue 56) ----------------------------------------------------------------
EMPTY = {
    **{name: (lambda make: lambda x: make()(x, x, x)[0])(make) for name, make in ATTENTIONS.items()},
    "zoo_mha_rope": lambda x: ZooMultiheadAttention(D, 2, rope_theta=1e4)(x, x, x)[0],
    "collab_rope": lambda x: CollaborativeAttention(D, 2, key_dim=8, rope_theta=1e4)(x, x, x)[0],
    "aop": lambda x: AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8, slots=16)(x),
    "aop_bucketed": lambda x: AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8, slots=16,
                                                      token_bucket=8).train()(x),
    "pkm": lambda x: ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8)(x),
    "swiglu": lambda x: SwiGLU(D, 32)(x),
    **{f"adaptive_span_{kernel}": (lambda kernel: lambda x: AdaptiveSpanAttention(
        D, 2, max_span=8, own_key_pe=True, kernel=kernel)(x.transpose(0, 1))[0].transpose(0, 1)
    )(kernel) for kernel in ("explicit", "sdpa")},
    "adaptive_span_persistent": lambda x: AdaptiveSpanAttention(
        D, 2, max_span=8, own_key_pe=True, persistent_slots=4)(x.transpose(0, 1))[0].transpose(0, 1),
}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_an_empty_sequence_gives_an_empty_output(name):
    """Rope attention and AOP failed with "cannot reshape tensor of 0 elements", adaptive span
    with ZeroDivisionError."""
    torch.manual_seed(0)
    assert EMPTY[name](torch.randn(0, B, D)).shape == (0, B, D)


def test_adaptive_span_on_no_new_positions_keeps_the_cache():
    attn = AdaptiveSpanAttention(D, 2, max_span=8, own_key_pe=True)
    past = (torch.randn(B, 2, 3, D // 2), torch.randn(B, 2, 3, D // 2))
    out, kv = attn(torch.randn(B, 0, D), past_kv=past)
    assert out.shape == (B, 0, D) and all(torch.equal(a, b) for a, b in zip(kv, past))


# ---- the span penalty (issue 56) ---------------------------------------------------------------
def test_span_penalty_is_zero_without_a_coefficient_and_none_without_spans():
    """``loss + span_penalty(model)`` failed for span_loss=0 (the default): it returned None."""
    layer = AdaptiveSpanLayer(D, 2, 32, max_span=8, span_init=0.5)
    penalty = span_penalty(layer)
    assert isinstance(penalty, torch.Tensor) and penalty.dtype == torch.float32
    assert penalty.shape == () and float(penalty) == 0.0
    assert float(torch.tensor(2.0) + penalty) == 2.0
    penalty = span_penalty(AdaptiveSpanLayer(D, 2, 32, max_span=8, span_init=0.5, span_loss=1.0))
    assert float(penalty.detach()) == 4.0  # lambda * S * z/S = 1.0 * 8 * 0.5
    assert span_penalty(torch.nn.Linear(D, D)) is None


# ---- padding masks of the position-wise layers (issue 56) ---------------------------------------
@pytest.mark.parametrize("make", [
    lambda: AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8, slots=16),
    lambda: SwiGLU(D, 32)], ids=["aop", "swiglu"])
def test_position_wise_padding_mask_of_another_shape_is_refused(make):
    """AttentionOverParameters took any padding_mask shape ([T, B], swapped) silently."""
    ffn, x = make(), torch.randn(T, B, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    ffn(x, pad)
    _one_line_error(lambda: ffn(x, pad.t()), rf"{type(ffn).__name__} padding_mask .*\[B, T\]")


# ---- Synthesizer: self-attention by value, errors in its own arguments (issue 56) ---------------
def test_synthesizer_self_attention_is_decided_by_value():
    """``attn(norm(x), norm(x), norm(x))`` (three equal tensors) was refused with "keep
    --cross-attn mha", a fairseq flag, to a plain PyTorch user."""
    torch.manual_seed(0)
    attn, norm = ATTENTIONS["synthesizer"](), torch.nn.LayerNorm(D)
    x = torch.randn(T, B, D)
    h = norm(x)
    assert torch.equal(attn(norm(x), norm(x), norm(x))[0], attn(h, h, h)[0])
    assert torch.equal(attn(h)[0], attn(h, h, h)[0])
    for key, value in ((x, h), (h, x), (h[:4], h[:4])):
        _one_line_error(lambda: attn(h, key, value), "self-attention only .* key and value equal "
                        "to query, or None")
    with pytest.raises(ValueError) as err:
        attn(h, x, x)
    assert "--" not in str(err.value)


def test_synthesizer_rope_refusal_names_its_arguments():
    _one_line_error(lambda: SynthesizerAttention(D, 2, components=("random",), rope_theta=1e4),
                    "pass rope_theta=None or add 'vanilla' to components")


@pytest.mark.parametrize("make,words", [
    (lambda: ZooMultiheadAttention(12, 5), "embed_dim 12 is not divisible by num_heads 5"),
    (lambda: ZooMultiheadAttention(12, 4, rope_theta=1e4), "dim 3 is odd"),
    (lambda: AdaptiveSpanAttention(12, 5, max_span=8), "not divisible by num_heads 5"),
    (lambda: AdaptiveSpanAttention(D, 2, max_span=8, persistent_slots=2, kernel="sdpa"),
     "persistent_slots=0"),
    (lambda: PersistentMemory(0, 2, 8), "num_slots 0"),
], ids=["heads", "rope", "span_heads", "span_kernel", "persistent"])
def test_module_errors_name_the_modules_arguments_not_fairseq_flags(make, words):
    """Flags (``--*-attention-heads``, ``--adaptive-span-kernel``, ``--persistent-memory-size``)
    meant nothing to a plain PyTorch user; the fairseq side words them as flags."""
    with pytest.raises(ValueError, match=words) as err:
        make()
    assert "--" not in str(err.value) and "\n" not in str(err.value)


# ---- weak messages of the plain modules (issue 64, item 9) ---------------------------------------
def test_synthesizer_misspelled_component_is_one_line_with_the_closest_name():
    """``components=("dence",)`` was a bare ``AssertionError: components ('dence',)``."""
    _one_line_error(lambda: SynthesizerAttention(D, 2, components=("dence",)),
                    r"'dence' is not a component: did you mean 'dense'\? pass one or more of")
    _one_line_error(lambda: SynthesizerAttention(D, 2, components=("dense", "dense")), "each once")
    _one_line_error(lambda: SynthesizerAttention(D, 2, table_kernel="cuda"),
                    "table_kernel 'cuda': pass one of auto, sdpa, table")


@pytest.mark.parametrize("make", [
    lambda: ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8),
    lambda: AttentionOverParameters(D, heads=2, key_dim=8, value_dim=8, slots=16)],
    ids=["pkm", "aop"])
def test_position_wise_layer_on_a_2d_tensor_says_the_shape_it_takes(make):
    """``x [N, C]`` ended in ``ValueError: not enough values to unpack (expected 3, got 2)``."""
    ffn = make()
    _one_line_error(lambda: ffn(torch.randn(T, D)), r"takes a time-first x \[T, B, C\] \(3 dims.*"
                    r"got 2 dims \[10, 16\]: for tokens without a batch, pass x.unsqueeze\(1\)")


def test_pkm_batch_first_x_says_to_transpose_x():
    """A batch-first ``x [B, T, C]`` with its ``[B, T]`` mask was told to transpose the mask; the
    shapes cannot tell it from a time-major mask, so the line names both, x first."""
    pkm = ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8)
    x, pad = torch.randn(B, T, D), torch.zeros(B, T, dtype=torch.bool)
    _one_line_error(lambda: pkm(x, pad), r"either x is batch-first \[B, T, C\]: pass "
                    r"x.transpose\(0, 1\), or the mask is time-major \[T, B\]")

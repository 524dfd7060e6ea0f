"""Parity with fairseq's own port of the reference, ``fairseq/examples/adaptive_span`` (shipped
inside the installed fairseq package): the same weights give the same outputs over a stream of
blocks with ``--adaptive-span-no-renorm --adaptive-span-exclude-self``; each of the two options is
a remaining, named difference. Also the two weight-init schemes."""

from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

import fairseq_attnzoo  # noqa: F401
from fairseq.data import Dictionary

from fairseq_attnzoo.models.adaptive_span import AdaptiveSpanDecoder, adaptive_span_base
from fairseq_attnzoo.modules.span_stack import StreamState

reference = pytest.importorskip("fairseq.examples.adaptive_span.adaptive_span_model")

D, H, FFN, LAYERS, S, RAMP, B, M = 32, 4, 64, 2, 256, 8, 2, 16
# per layer, per head z/S: spans 13..64 positions, so the window is trimmed to 128 of S = 256
SPANS = [[0.05, 0.25, 0.1, 0.2], [0.15, 0.02, 0.25, 0.08]]


def _dictionary():
    d = Dictionary()
    for i in range(20):
        d.add_symbol(f"w{i}")
    return d


def _ours(dictionary, **flags):
    sizes = dict(decoder_embed_dim=D, decoder_ffn_embed_dim=FFN, decoder_layers=LAYERS,
                 decoder_attention_heads=H, dropout=0.0, attn_span=S, adaptive_span_ramp=RAMP,
                 adaptive_span_init=0.0, adaptive_span_loss=0.0)
    args = Namespace(**dict(sizes, **flags))
    adaptive_span_base(args)
    return AdaptiveSpanDecoder(args, dictionary).eval()


def _reference(vocab):
    torch.manual_seed(0)
    return reference.TransformerSeq(
        vocab_size=vocab, d_model=D, n_head=H, n_layer=LAYERS, attn_span=S, emb_dropout=0.0,
        aux_loss_scaler=0.0, adapt_span_layer=False, d_inner=FFN, dropout=0.0,
        adapt_span_ramp=RAMP, adapt_span_init=0.0).eval()


def _copy(ref, ours):
    """Reference parameter -> ours (names differ, values are copied as they are)."""
    with torch.no_grad():
        ours.embed_tokens.weight.copy_(ref.in_emb.weight)
        ours.output_projection.weight.copy_(ref.out_emb.weight)
        ours.output_projection.bias.copy_(ref.out_emb.bias)
        ours.stack.key_pe.copy_(ref.key_pe)
        for i, (a, b) in enumerate(zip(ref.layers, ours.stack.layers)):
            for src, dst in (("proj_query", "q_proj"), ("proj_key", "k_proj"),
                             ("proj_val", "v_proj"), ("proj_out", "out_proj")):
                getattr(b.attn, dst).weight.copy_(getattr(a.attn, src).weight)
            z = torch.tensor(SPANS[i])
            a.attn.attn.adaptive_span._mask.current_val.copy_(z.view(H, 1, 1))
            b.attn.mask.span.copy_(z)
            b.attn_norm.load_state_dict(a.norm1.state_dict())
            b.ffn_norm.load_state_dict(a.norm2.state_dict())
            b.ffn.load_state_dict(a.ff.state_dict())


def _run_stream(ref, ours, blocks):
    """Both models over the same blocks of B streams, each carrying its own cache. The reference
    trainer starts every stream from an all-zero cache; our stream cache is seeded with the same
    zeros (no padding), so block 0 sees identical history."""
    ref_cache = [torch.zeros(B, layer.get_cache_size(), D) for layer in ref.layers]
    ours.stack.streams[("eval", 0)] = StreamState(
        next=[0] * B, device=torch.device("cpu"), padded=False,
        mems=[(torch.zeros(B, c.size(1), D), torch.zeros(B, c.size(1), dtype=torch.bool))
              for c in ref_cache])
    diffs = []
    with torch.no_grad():
        for n, x in enumerate(blocks):
            out_ref, ref_cache, _ = ref(x, ref_cache)
            logits, _ = ours(x, stream_pos=torch.full((B,), n, dtype=torch.long))
            diffs.append((F.log_softmax(logits, -1) - out_ref).abs().max().item())
    return diffs


@pytest.fixture(scope="module")
def stream():
    g = torch.Generator().manual_seed(3)
    vocab = len(_dictionary())
    return [torch.randint(4, vocab, (B, M), generator=g) for _ in range(14)]  # 224 tokens > 128


def test_window_and_cache_sizes_agree_with_the_reference():
    dictionary = _dictionary()
    ref, ours = _reference(len(dictionary)), _ours(dictionary, adaptive_span_exclude_self=True,
                                                   adaptive_span_no_renorm=True)
    _copy(ref, ours)
    for a, b in zip(ref.layers, ours.stack.layers):
        span = a.attn.attn.adaptive_span
        assert S - span.get_trim_len() == b.attn.mask.window(b.attn.mask.spans()) == 128
        assert span.get_cache_size() == b.attn.cache_size(64) == 192


def test_outputs_match_fairseq_example_over_a_stream(stream):
    dictionary = _dictionary()
    ref = _reference(len(dictionary))
    ours = _ours(dictionary, adaptive_span_exclude_self=True, adaptive_span_no_renorm=True)
    _copy(ref, ours)
    diffs = _run_stream(ref, ours, stream)
    assert max(diffs) < 2e-5, diffs


@pytest.mark.parametrize("flags", [dict(adaptive_span_no_renorm=True),  # our window: 0..S-1
                                   dict(adaptive_span_exclude_self=True)])  # renormalised
def test_each_remaining_difference_is_a_named_option(stream, flags):
    dictionary = _dictionary()
    ref, ours = _reference(len(dictionary)), _ours(dictionary, **flags)
    _copy(ref, ours)
    assert min(_run_stream(ref, ours, stream)) > 1e-3


def test_weight_init_schemes():
    torch.manual_seed(0)
    dictionary = _dictionary()
    ex = _ours(dictionary)  # default: fairseq's examples/adaptive_span inits
    assert ex.stack.layers[0].attn.q_proj.weight.std().item() == pytest.approx(
        (2 / (2 * D)) ** 0.5, rel=0.1)  # xavier normal
    assert ex.embed_tokens.weight[4:].std().item() == pytest.approx(D ** -0.5, rel=0.1)
    assert ex.embed_tokens.weight[dictionary.pad()].abs().sum() == 0
    ref = _reference(len(dictionary))  # the fairseq example's own model: same statistics
    assert ref.in_emb.weight.std().item() == pytest.approx(D ** -0.5, rel=0.1)
    td = _ours(dictionary, adaptive_span_weight_init="torch_default")  # facebookresearch code
    assert td.embed_tokens.weight[4:].std().item() == pytest.approx(1.0, rel=0.1)
    assert td.embed_tokens.weight[dictionary.pad()].abs().sum() == 0
    layers = td.stack.layers
    for lin in (layers[0].attn.q_proj, layers[1].ffn.fc1, layers[0].ffn.fc2):
        bound = lin.weight.size(1) ** -0.5  # nn.Linear default: U(±1/sqrt(fan_in))
        assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.95 * bound
    assert layers[0].ffn.fc1.bias.abs().max() > 0  # (the example keeps them nn.Linear's too)
    torch.testing.assert_close(td.stack.key_pe.std(), torch.tensor(1.0), rtol=0.1, atol=0)


@pytest.mark.parametrize("persistent", [0, 4])
def test_exclude_self_incremental_decoding_equals_full_forward(persistent):
    """The reference window (distances 1..S) through our cache paths: token-by-token decoding
    gives the plain forward's outputs; the first token of a stream sees no context (only the
    persistent vectors, if any)."""
    torch.manual_seed(0)
    dictionary = _dictionary()
    dec = _ours(dictionary, adaptive_span_exclude_self=True, attn_span=12, adaptive_span_ramp=4,
                adaptive_span_init=0.5, adaptive_span_trim_chunk=4,
                persistent_memory_size=persistent)
    tokens = torch.randint(4, len(dictionary), (2, 30))
    with torch.no_grad():
        full = dec(tokens)[0]
        state, steps = {}, []
        for t in range(tokens.size(1)):
            steps.append(dec(tokens[:, :t + 1], incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    layer = dec.stack.layers[0].attn
    assert layer.cache_size() == layer.mask.cache_size() + 1  # S previous tokens, not S - 1

"""Attention over parameters: parameter budget, the exact function, row dropout, flag errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from zoo_testlib import USER_DIR, DispatchedOps, record_sdpa
from fairseq import options
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from fairseq_attnzoo.models.sublayers import SublayerSpec, build_sublayer
from fairseq_attnzoo.modules import aop_triton
from fairseq_attnzoo.modules.aop import AttentionOverParameters, aop_num_params


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


SMALL = ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4"]


def _args(arch, extra=(), task="translation"):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["/nonexistent-data", "--user-dir", USER_DIR, "--arch", arch,
                 "--task", task] + list(extra))


def _spec(args, d=512, ffn=2048, heads=8, attention_dropout=0.0, activation_dropout=0.0):
    return SublayerSpec(slot="ffn", side="encoder", layer_idx=0, num_layers=6, embed_dim=d,
                        num_heads=heads, ffn_dim=ffn, attention_dropout=attention_dropout,
                        activation_dropout=activation_dropout, causal=False, kdim=d, args=args)


def _build(args):
    """The encoder-decoder model for args, with a stand-in dictionary (no data needed)."""
    from fairseq.data import Dictionary
    from fairseq_attnzoo.models.transformer import ZooTransformerModel

    class _Task:
        source_dictionary = target_dictionary = Dictionary()

    return ZooTransformerModel.build_model(args, _Task())


def _ffn_weights(d, ffn):
    stock = TransformerEncoderLayerBase(TransformerConfig.from_namespace(_args(
        "attnzoo_transformer", ["--encoder-embed-dim", str(d), "--encoder-ffn-embed-dim", str(ffn)])))
    return stock.fc1.weight.numel() + stock.fc2.weight.numel()


@pytest.mark.parametrize("arch,heads,dk,slots", [("transformer_aop", 8, 64, 1536),
                                                 ("transformer_aop_h16", 16, 64, 512)])
def test_presets_have_exactly_the_ffn_weights(arch, heads, dk, slots):
    args = _args(arch)
    assert args.encoder_ffn == "aop" and args.decoder_ffn == "aop"
    aop = build_sublayer("aop", _spec(args, heads=args.encoder_attention_heads))
    assert (aop.heads, aop.key_dim, aop.value_dim, aop.slots) == (heads, dk, dk, slots)
    n_aop = sum(p.numel() for p in aop.parameters())
    # the stock fairseq FFN at d=512, d_ff=2048: weights 2·512·2048, plus 2048 + 512 biases
    stock = TransformerEncoderLayerBase(TransformerConfig())
    ffn_weights = stock.fc1.weight.numel() + stock.fc2.weight.numel()
    ffn_biases = stock.fc1.bias.numel() + stock.fc2.bias.numel()
    assert ffn_weights == 512 * 2048 * 2 == 2_097_152
    assert ffn_biases == 2048 + 512
    assert n_aop == ffn_weights == aop_num_params(512, heads, dk, dk, slots)  # AOP has no biases
    assert all(not n.endswith("bias") for n, _ in aop.named_parameters())


@pytest.mark.parametrize("arch", ["transformer_aop", "transformer_aop_h16", "transformer_lm_aop"])
@pytest.mark.parametrize("d,ffn", [(128, 512), (512, 2048)])
def test_default_sizes_follow_the_model_and_match_the_ffn(arch, d, ffn, caplog):
    """A new user's model at any size: memory sized from d / d_ff, weights == the FFN's, logged."""
    import logging

    side = "decoder" if "lm" in arch else "encoder"
    args = _args(arch, [f"--{side}-embed-dim", str(d), f"--{side}-ffn-embed-dim", str(ffn)],
                 task="language_modeling" if "lm" in arch else "translation")
    heads = getattr(args, f"{side}_attention_heads")
    with caplog.at_level(logging.INFO, logger="fairseq_attnzoo.models.aop"):
        aop = build_sublayer("aop", _spec(args, d=d, ffn=ffn, heads=heads))
    width = (2 if arch.endswith("h16") else 1) * d
    assert aop.heads == heads == (16 if arch.endswith("h16") else 8)
    assert aop.heads * aop.key_dim == aop.heads * aop.value_dim == width
    assert aop.slots == (ffn - d if width == d else ffn // 2 - d)
    n_aop = sum(p.numel() for p in aop.parameters())
    assert n_aop == 2 * d * ffn == _ffn_weights(d, ffn)
    assert f"{n_aop:,} weights per sublayer vs the FFN's {2 * d * ffn:,} weights" in caplog.text


def test_h16_has_16_heads_in_every_attention():
    """tensor2tensor's transformer_parameter_attention_b sets num_heads = 16 for the whole model."""
    args = _args("transformer_aop_h16", ["--encoder-layers", "1", "--decoder-layers", "1"])
    assert args.encoder_attention_heads == args.decoder_attention_heads == 16
    model = _build(args)
    enc, dec = model.encoder.layers[0], model.decoder.layers[0]
    assert enc.self_attn.num_heads == dec.self_attn.num_heads == dec.encoder_attn.num_heads == 16
    assert enc.ffn.heads == dec.ffn.heads == 16 and enc.ffn.slots == 512 and enc.ffn.key_dim == 64
    # an explicit head count still wins
    args = _args("transformer_aop_h16", ["--encoder-attention-heads", "8"])
    assert args.encoder_attention_heads == 8 and args.decoder_attention_heads == 16


def test_dropout_defaults_to_attention_dropout():
    args = _args("transformer_aop", ["--attention-dropout", "0.25", "--activation-dropout", "0.4"])
    aop = build_sublayer("aop", _spec(args, d=32, ffn=64, attention_dropout=0.25,
                                      activation_dropout=0.4, heads=4))
    assert aop.dropout == 0.25
    model = _build(_args("transformer_aop", ["--attention-dropout", "0.25", "--activation-dropout",
                                             "0.4", "--encoder-layers", "1", "--decoder-layers", "1",
                                             *SMALL]))
    assert model.encoder.layers[0].ffn.dropout == model.decoder.layers[0].ffn.dropout == 0.25
    args = _args("transformer_aop", ["--attention-dropout", "0.25", "--aop-dropout", "0.1"])
    assert build_sublayer("aop", _spec(args, d=32, ffn=64, heads=4)).dropout == 0.1


def test_forward_is_scaled_softmax_attention_over_parameters():
    torch.manual_seed(0)
    d, h, dk, dv, n_p = 32, 4, 6, 5, 11
    m = AttentionOverParameters(d, heads=h, key_dim=dk, value_dim=dv, slots=n_p).eval()
    x = torch.randn(7, 3, d)  # [T, B, C]
    q = m.q_proj(x).view(7, 3, h, dk)
    k = m.keys * math.sqrt(h)  # t2t: keys scaled by sqrt(h_p), values by sqrt(d_model)
    v = m.values * math.sqrt(d)
    w = torch.softmax(torch.einsum("tbhk,hnk->tbhn", q, k), dim=-1)  # no 1/sqrt(d_pk)
    ref = m.out_proj(torch.einsum("tbhn,hnv->tbhv", w, v).reshape(7, 3, h * dv))
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
    # position-wise: a token's output does not depend on the other tokens (or on padding)
    torch.testing.assert_close(m(x[2:3, 1:2]), ref[2:3, 1:2], rtol=1e-5, atol=1e-5)


def test_init_scale_matches_tensor2tensor():
    torch.manual_seed(0)
    d, h = 512, 8
    m = AttentionOverParameters(d, heads=h, key_dim=64, value_dim=64, slots=1536)
    k, v = m.memory()
    assert abs(k.std().item() - math.sqrt(h / d)) < 0.01  # = 1/sqrt(d_pk) since h·d_pk = d
    assert abs(v.std().item() - 1.0) < 0.02
    assert abs(m.keys.std().item() - d ** -0.5) < 0.001  # stored N(0, d^-1/2)


def test_dropout_drops_whole_memory_rows():
    torch.manual_seed(0)
    d, h, n_p, p = 16, 2, 64, 0.5
    m = AttentionOverParameters(d, heads=h, key_dim=4, value_dim=8, slots=n_p, dropout=p).train()
    _, v = m.memory()
    full = m.values * math.sqrt(d)
    zero = (v == 0).all(-1)  # [h, n_p]: whole rows dropped
    kept = ~zero
    assert 0 < zero.sum() < h * n_p
    torch.testing.assert_close(v[kept], full[kept] / (1 - p))
    assert ((v == 0) == zero.unsqueeze(-1)).all(), "a row is either dropped entirely or kept"
    # dropped rows keep their softmax weight (tensor2tensor's scheme: V is masked, not the
    # logits), so a token's output is the kept rows' weighted sum; nothing is dropped in eval
    x = torch.randn(5, 2, d)
    m.eval()
    assert torch.equal(m(x), m(x)), "no dropout in eval"
    k, v_eval = m.memory()
    torch.testing.assert_close(v_eval, full)


def _one_line_error(args, match):
    with pytest.raises(ValueError, match=match) as e:
        build_sublayer("aop", _spec(args, d=32, ffn=64))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag,value,match", [
    ("--aop-slots", "0", "--aop-slots must be a positive integer"),
    ("--aop-heads", "-2", "--aop-heads must be a positive integer"),
    ("--aop-key-dim", "0", "--aop-key-dim must be a positive integer"),
    ("--aop-dropout", "1.0", r"--aop-dropout must be in \[0, 1\)"),
])
def test_bad_flags_fail_at_build_with_one_line(flag, value, match):
    _one_line_error(_args("transformer_aop", [flag, value]), match)


def _explicit(m, x):
    """The "use" form written out: softmax(q (√h_p K)ᵀ) (√d V) W_o, no 1/√d_pk."""
    t, b, d = x.shape
    q = m.q_proj(x).view(t, b, m.heads, m.key_dim)
    w = F.softmax(torch.einsum("tbhk,hnk->tbhn", q, m.keys * math.sqrt(m.heads)), -1)
    v = m.values * math.sqrt(d)
    return m.out_proj(torch.einsum("tbhn,hnv->tbhv", w, v).reshape(t, b, -1))


def test_sdpa_path_matches_explicit_math_in_training_mode_backward():
    """Gradients through the fused kernel equal the explicit softmax formulation."""
    torch.manual_seed(0)
    m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=9)
    x = torch.randn(4, 3, 16, requires_grad=True)
    m(x).square().sum().backward()
    g_fused = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    _explicit(m, x).square().sum().backward()
    g_ref = [p.grad for p in m.parameters()] + [x.grad]
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("groups", [3, 4])  # both divide the 12 tokens; 5 (below) does not
def test_token_groups_give_the_same_function_and_gradients(groups):
    """Tokens split into SDPA batch entries sharing the memory (the expanded K, V get the summed
    gradient); an indivisible count falls back to one entry."""
    results = []
    for g in (1, groups, 5):
        torch.manual_seed(0)
        m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=9)
        m.token_groups = g
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = m(x)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad for p in m.parameters()] + [x.grad])
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scale_at_init_has_t2t_statistics_and_the_same_function_at_init():
    """tensor2tensor since 2018-06-11 folds √h_p, √d into the initialiser: K ~ N(0, √h_p·d^-½),
    V ~ N(0, 1) stored and used as is; at init that is the at-use form's function exactly."""
    d, h = 512, 8
    torch.manual_seed(0)
    use = AttentionOverParameters(d, heads=h, key_dim=64, value_dim=64, slots=1536, scale_at="use")
    torch.manual_seed(0)
    init = AttentionOverParameters(d, heads=h, key_dim=64, value_dim=64, slots=1536,
                                   scale_at="init")
    assert abs(init.keys.std().item() - math.sqrt(h / d)) < 0.002  # stored = effective
    assert abs(init.values.std().item() - 1.0) < 0.005
    assert abs(init.keys.mean().item()) < 0.002 and abs(init.values.mean().item()) < 0.005
    assert abs(use.keys.std().item() - d ** -0.5) < 0.001  # stored N(0, d^-½), scaled at use
    for a, b in zip(use.memory(), init.memory()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    x = torch.randn(5, 3, d)
    torch.testing.assert_close(use(x), init(x), rtol=1e-5, atol=1e-6)


def test_scale_at_changes_the_adam_step_by_the_constant():
    """Same function, different dynamics: Adam's first step moves every parameter by ≈ lr, so the
    effective values move √d times more when √d multiplies them at use."""
    d = 64
    moved = {}
    for form in ("use", "init"):
        torch.manual_seed(0)
        m = AttentionOverParameters(d, heads=2, key_dim=8, value_dim=8, slots=12, scale_at=form)
        before = m.memory()[1].detach().clone()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        torch.manual_seed(1)
        m(torch.randn(4, 2, d)).square().sum().backward()
        opt.step()
        moved[form] = (m.memory()[1].detach() - before).abs().mean().item()
    assert abs(moved["use"] / moved["init"] - math.sqrt(d)) < 0.01 * math.sqrt(d)


def test_scale_at_flag_reaches_the_module_and_old_name_default():
    args = _args("transformer_aop", ["--aop-scale-at", "init"])
    assert build_sublayer("aop", _spec(args, d=32, ffn=64, heads=4)).scale_at == "init"
    assert build_sublayer("aop", _spec(_args("transformer_aop"), d=32, ffn=64, heads=4)).scale_at == "use"


def test_indivisible_default_width_is_a_one_line_error():
    args = _args("transformer_aop", ["--aop-heads", "3"])
    _one_line_error(args, "not divisible by h_p = 3: set --aop-key-dim")
    args = _args("transformer_aop", ["--aop-heads", "4", "--aop-width-factor", "5"])
    with pytest.raises(ValueError, match="set --aop-slots") as e:
        build_sublayer("aop", _spec(args, d=32, ffn=64, heads=4))
    assert "\n" not in str(e.value)


def test_the_memory_costs_one_multiply_each_way():
    """At transformer-base size a GPU step waits on the host's kernel launches. The key constant
    √h_p is the fused kernel's logit scale (no scaled copy of K, forward or backward), the value
    constant and row dropout's 1/(1-p) one multiply of V, and one SDPA batch entry is a view of
    the memory, not an expand (whose backward is a reduction): the forward is the FFN's two
    matrix products, one multiply and the attention."""
    def launched(ops):  # what launches a kernel: no views, no matmul output reshape
        return ["attention" if name.startswith("_scaled_dot_product") else name
                for name, func, _ in ops.calls if not func.is_view and name != "_unsafe_view"]

    x = torch.randn(6, 2, 16, requires_grad=True)
    for dropout, forward in ((0.0, ["mm", "mul", "attention", "mm"]),
                             (0.3, ["mm", "empty", "bernoulli_", "mul_", "mul", "attention", "mm"])):
        m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=9, dropout=dropout)
        with DispatchedOps() as ops:
            y = m(x)
        assert launched(ops) == forward, launched(ops)
        loss = y.sum()
        with DispatchedOps() as ops:
            loss.backward()
        backward = launched(ops)  # V's gradient; no expand's reduction
        assert backward.count("mul") == 1 and "sum" not in backward, backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bucket", [5, 16])  # 12 tokens: padded to 15 and to 16
def test_token_bucket_pads_the_attention_and_keeps_the_function_and_gradients(bucket, dtype,
                                                                             monkeypatch):
    """``--aop-token-bucket``: in training the attention sees the tokens padded with zero queries
    to a multiple of the bucket (fewer shapes for cuDNN's per-shape graphs); the outputs and every
    gradient are those of the unpadded module, in each precision. Decoding and evaluation are not
    padded."""
    calls = record_sdpa(monkeypatch)
    results = []
    for b in (0, bucket):
        torch.manual_seed(0)
        m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=9,
                                    token_bucket=b).to(dtype).train()
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        x.requires_grad_(True)
        y = m(x)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad for p in m.parameters()] + [x.grad])
        m.eval()
        m(x.detach())
    assert [c[0][0].shape[-2] for c in calls] == [12, 12, 12 + (-12) % bucket, 12]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}  # (the dtype's defaults)
    for a, b in zip(results[1], results[0]):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)


def _mul_shapes(ops):
    return [tuple(args[0].shape) for name, _, args in ops.calls if name in ("mul", "mul_")]


@pytest.mark.parametrize("slots,scaled", [(40, "W_o"), (9, "V")])
def test_unpadded_path_scales_the_smaller_of_v_and_w_o_and_slices_nothing(slots, scaled):
    """Without padding the output is not sliced (a slice's backward zero-fills and copies the
    whole [N, h·d_pv] gradient) and the value constant c multiplies the smaller of V [h, n_p,
    d_pv] and W_o [d, h·d_pv] ((c·AV) W_o = AV (c·W_o)), once each way; the function and every
    gradient are the explicit formula's within fp32 rounding."""
    m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=slots)
    x = torch.randn(6, 2, 16, requires_grad=True)
    with DispatchedOps() as ops:
        y = m(x)
    up = torch.randn(6, 2, 16)
    with DispatchedOps() as back:
        y.backward(up)
    small = tuple((m.out_proj.weight if scaled == "W_o" else m.values).shape)
    assert _mul_shapes(ops) == [small] and _mul_shapes(back) == [small], (ops.names, back.names)
    assert "slice_backward" not in back.names and "constant_pad_nd" not in ops.names
    grads = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    ref = _explicit(m, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    ref.backward(up)
    for a, b in zip(grads, [p.grad for p in m.parameters()] + [x.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert list(m.state_dict()) == ["keys", "values", "q_proj.weight", "out_proj.weight"]


# ---- the Triton kernel (modules/aop_triton.py) against the SDPA reference, in the interpreter ----

triton_only = pytest.mark.skipif(not aop_triton.HAS_TRITON,
                                 reason="Triton is not installed (make install adds it)")


def _close(a, b, dtype):
    """fp32: rounding only; 16-bit: the kernel and the reference round the probabilities and
    the output differently (each within a few ulps of the dtype), against the tensor's scale."""
    scale = b.float().abs().max().clamp_min(1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((a.float() - b.float()).abs().max() / scale).item()
    assert err < tol, (err, tol)


def _memory_problem(dtype, n=40, h=2, dk=6, dv=5, slots=37):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(n, h * dk, generator=g).view(n, h, dk)  # (a view: q_proj's [N, h·d_pk])
    k = torch.randn(h, slots, dk, generator=g) * dk ** -0.5
    v = torch.randn(h, slots, dv, generator=g)
    up = torch.randn(n, h, dv, generator=g)
    return [t.to(dtype) for t in (q, k, v, up)]


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunks", [1, 3])  # 40 tokens in blocks of 16: 3 chunks of one block
def test_triton_kernel_matches_sdpa_forward_and_every_gradient(dtype, chunks):
    """c · softmax(s · q Kᵀ) V over a shared memory: output and dQ, dK, dV equal the SDPA
    reference's (the module's path) on the same inputs, with the keys' and values' gradient
    summed over token chunks in fp32 partial sums or written by one chunk."""
    q, k, v, up = _memory_problem(dtype)
    results = []
    for fused in (True, False):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        if fused:
            y = aop_triton.attention(qq, kk, vv, 1.7, 2.5, chunks=chunks)
        else:  # the module's SDPA call: tokens as one sequence of one batch entry
            y = F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kk[None], vv[None],
                                               scale=1.7)[0].transpose(0, 1) * 2.5
        y.backward(up)
        results.append([y, qq.grad, kk.grad, vv.grad])
    for a, b in zip(*results):
        assert a.dtype == dtype and a.shape == b.shape
        _close(a, b, dtype)


@triton_only
def test_triton_chunked_backward_is_deterministic_and_equals_one_chunk():
    """The partial sums are reduced in a fixed order (no atomics): two runs are bitwise equal, and
    any chunking gives the one-chunk gradient within fp32 rounding."""
    q, k, v, up = _memory_problem(torch.float32, n=40)  # 3 blocks of 16 tokens
    grads = {}
    for chunks in (1, 2, 3, 3):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        aop_triton.attention(qq, kk, vv, 1.0, 1.0, chunks=chunks).backward(up)
        grads.setdefault(chunks, []).append((kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads[3]))
    for chunks in (2, 3):
        for a, b in zip(grads[chunks][0], grads[1][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale_at,dropout", [("use", 0.0), ("init", 0.0), ("use", 0.3)])
def test_module_triton_kernel_matches_the_sdpa_path(dtype, scale_at, dropout):
    """``kernel="triton"`` computes the module's function and every gradient (the value constant
    inside the kernel; with dropout the same rows dropped), from the same state dict."""
    results = []
    state = None
    for kernel in ("sdpa", "triton"):
        torch.manual_seed(0)
        m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=20,
                                    dropout=dropout, scale_at=scale_at, kernel=kernel)
        if state is None:
            state = m.state_dict()
        m.load_state_dict(state)
        m = m.to(dtype).train()
        x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        x.requires_grad_(True)
        torch.manual_seed(2)  # (the dropout mask)
        y = m(x)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad for p in m.parameters()] + [x.grad])
    for a, b in zip(results[1], results[0]):
        assert a.dtype == dtype
        _close(a, b, dtype)


@triton_only
def test_kernel_flag_reaches_the_module_and_an_unavailable_kernel_is_one_line(monkeypatch):
    args = _args("transformer_aop", ["--aop-kernel", "triton"])
    m = build_sublayer("aop", _spec(args, d=32, ffn=64, heads=4))
    assert m.kernel == "triton" and "kernel=triton" in repr(m)
    assert build_sublayer("aop", _spec(_args("transformer_aop"), d=32, ffn=64, heads=4)
                          ).kernel == "sdpa"
    monkeypatch.setattr(aop_triton, "interpreted", lambda: False)  # a CPU without the interpreter
    with pytest.raises(ValueError, match="need a CUDA device.*--aop-kernel sdpa") as e:
        m(torch.randn(3, 2, 32))
    assert "\n" not in str(e.value)
    # the plain module names its own argument, not the flag
    plain = AttentionOverParameters(32, heads=4, key_dim=8, value_dim=8, slots=16, kernel="triton")
    with pytest.raises(ValueError, match="need a CUDA device.*pass kernel='sdpa'") as e:
        plain(torch.randn(3, 2, 32))
    assert "--" not in str(e.value) and "\n" not in str(e.value)


def test_one_sdpa_backend_alone_gives_the_same_function_or_one_line_naming_it():
    """``sdpa_backend`` restricts SDPA to one backend (the benchmark's sweep): a backend that runs
    here gives torch's pick's output and gradients; one that cannot (on a CPU: cuDNN's and the
    memory-efficient kernel) is one line naming it, not torch's warnings and its generic error."""
    import warnings

    from fairseq_attnzoo.modules.aop import SDPA_BACKENDS

    results = {}
    for backend in (None, *SDPA_BACKENDS):
        torch.manual_seed(0)
        m = AttentionOverParameters(16, heads=2, key_dim=4, value_dim=4, slots=9)
        m.sdpa_backend, m.token_groups = backend, 2
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (none escapes)
            try:
                y = m(x)
            except RuntimeError as e:
                results[backend] = str(e)
                continue
        y.square().sum().backward()
        results[backend] = [y.detach()] + [p.grad for p in m.parameters()] + [x.grad]
    for backend in ("flash", "math"):
        for a, b in zip(results[backend], results[None]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for backend in ("cuDNN", "efficient"):
        assert results[backend].startswith(f"AOP's SDPA backend {backend} cannot run float32 "
                                           "on cpu: ") and "\n" not in results[backend]


@triton_only
def test_fairseq_train_with_the_triton_kernel_logs_the_same_losses(lm_data, tmp_path):
    """``fairseq-train --aop-kernel triton`` (interpreted here) and ``--aop-kernel sdpa`` log the
    same losses update after update, and the flag reaches every memory."""
    from zoo_testlib import json_logs, run_cli, tiny_flags

    logs = {}
    for kernel in ("triton", "sdpa"):
        lines = run_cli("train", tiny_flags("transformer_lm_aop", lm_data) + [
            "--aop-kernel", kernel, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "200",
            "--max-update", "3", "--no-save", "--disable-validation", "--log-interval", "1",
            "--log-format", "json", "--num-workers", "0", "--seed", "1",
            "--save-dir", str(tmp_path / kernel)])
        assert any("kernel=triton" in line for line in lines) == (kernel == "triton")
        logs[kernel] = [float(r["loss"]) for r in json_logs(lines, "train_inner")]
    assert len(logs["triton"]) == 3
    assert logs["triton"] == pytest.approx(logs["sdpa"], abs=1e-3)

"""Synthesizer (Tay et al. 2020): method-specific properties. The generic sweep covers the rest."""

import os
from argparse import Namespace

import pytest
import torch

from zoo_testlib import DispatchedOps, record_sdpa
from fairseq_attnzoo.models.sublayers import build_options
from fairseq_attnzoo.models.synthesizer import (
    VARIANTS,
    SynthesizerConfig,
    format_mixture_weights,
    mixture_weights,
)
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention, default_factors

D, H, N = 16, 4, 12
#: where the kernels are compared with the formula (``ATTNZOO_TEST_DEVICE=cuda``: the GPU's fused
#: attention kernels; the rest of the file runs on the CPU)
DEVICE = torch.device(os.environ.get("ATTNZOO_TEST_DEVICE", "cpu"))
MODES = sorted(VARIANTS)


def make(mode: str, seed: int = 0, **kw) -> SynthesizerAttention:
    torch.manual_seed(seed)
    components, frozen = VARIANTS[mode]
    kw.setdefault("max_len", N)
    kw.setdefault("rank", 3)
    m = SynthesizerAttention(D, H, components=components, freeze_random=frozen, **kw)
    with torch.no_grad():  # non-zero biases and mixture logits, so they are exercised too
        for name, p in m.named_parameters():
            if name.endswith(("b2", "bA", "bB")) or name == "mix_logits":
                p.normal_(0, 0.5)
    return m.eval()


def causal(t: int) -> torch.Tensor:
    return torch.triu(torch.full((t, t), float("-inf")), 1)


def run(m, x, pad=None, mask=None, state=None):
    """x batch-first [B, T, C] -> batch-first output; through the fairseq (time-first) API."""
    xt = x.transpose(0, 1)
    out, _ = m(xt, xt, xt, key_padding_mask=pad, attn_mask=mask, incremental_state=state)
    return out.transpose(0, 1)


KERNELS = ["sdpa", "table"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_padding_does_not_change_real_outputs(mode, kernel):
    m = make(mode, table_kernel=kernel)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1, 5, D, generator=g)  # the sentence of interest
    other = torch.randn(1, 7, D, generator=g)  # a longer sentence in the same batch
    ref_enc = run(m, a)
    ref_dec = run(m, a, mask=causal(5))

    # encoder: left padding (fairseq's default for sources), garbage in the pad slots
    x = torch.cat([torch.cat([torch.randn(1, 2, D, generator=g) * 9, a], 1), other])
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :2] = True
    out = run(m, x, pad=pad)
    torch.testing.assert_close(out[0, 2:], ref_enc[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()

    # decoder: right padding with the causal mask
    x = torch.cat([torch.cat([a, torch.randn(1, 2, D, generator=g) * 9], 1), other])
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True
    out = run(m, x, pad=pad, mask=causal(7))
    torch.testing.assert_close(out[0, :5], ref_dec[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_incremental_equals_full_forward(mode, kernel):
    m = make(mode, table_kernel=kernel)
    x = torch.randn(3, 6, D, generator=torch.Generator().manual_seed(2))
    full = run(m, x, mask=causal(6))
    state, steps = {}, []
    for t in range(6):
        steps.append(run(m, x[:, t:t + 1], state=state))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    # only what is needed is cached: values (+ keys for the vanilla mixtures) and the padding
    buf = m._get_buffer(state)
    want = {"v", "_padding"} | ({"k"} if "vanilla" in m.components else set())
    assert set(buf) == want and buf["v"].shape == (3, 6, D)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["random", "factorized_random", "random_dense"])
def test_shared_fast_path_equals_gathered_path(mode, kernel):
    # no padding: tables sliced (the table kernel: Softmax shared by the batch); an all-False
    # padding mask forces the per-sentence gather path: the same numbers
    for share in (False, True):
        m = make(mode, share_heads=share, table_kernel=kernel)
        x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
        nopad = torch.zeros(2, 7, dtype=torch.bool)
        for mask in (None, causal(7)):
            torch.testing.assert_close(run(m, x, mask=mask), run(m, x, pad=nopad, mask=mask),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "dense_vanilla", "factorized_random", "random",
                                  "random_dense"])
def test_fused_path_equals_materialized_path(mode):
    # dot-product-form logits go through SDPA; keep_attention materializes Softmax(B) instead
    m = make(mode, table_kernel="sdpa")
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :3] = True
    for kw in ({}, {"pad": pad}, {"mask": causal(7)}):
        fused = run(m, x, **kw)
        m.keep_attention = True
        torch.testing.assert_close(run(m, x, **kw), fused, atol=1e-5, rtol=1e-5)
        m.keep_attention = False


def _attention_ops(m, x, **kw):
    with DispatchedOps() as ops:
        run(m, x, **kw)
    return {n for n in ops.names if "scaled_dot_product" in n or "softmax" in n}


@pytest.mark.parametrize("share", [False, True])
def test_random_runs_the_fused_kernel_while_its_keys_are_narrow(share):
    """R[i, j] = R[i]·e_j: the query's row of R against the one-hot key position, a dot product
    as wide as the keys. Up to RANDOM_DOT_MAX_WIDTH (or the head width) it goes through SDPA,
    padded or not, with no [B, H, Tq, Tk] logits and fp32 softmax; wider keys make the table,
    with one softmax for the batch when it shares one map."""
    from fairseq_attnzoo.modules.synthesizer import RANDOM_DOT_MAX_WIDTH

    g = torch.Generator().manual_seed(3)
    cases = [(7, "sdpa", True), (RANDOM_DOT_MAX_WIDTH, "sdpa", True),
             (RANDOM_DOT_MAX_WIDTH + 1, "sdpa", False), (7, "table", False),
             (7, "auto", False)]  # auto: the table on the CPU
    for t, kernel, fused in cases:
        m = make("random", share_heads=share, max_len=RANDOM_DOT_MAX_WIDTH + 8,
                 table_kernel=kernel)
        x = torch.randn(2, t, D, generator=g)
        pad = torch.zeros(2, t, dtype=torch.bool)
        pad[0, :3] = True
        for kw in ({"pad": pad}, {"pad": pad, "mask": causal(t)}, {"mask": causal(t)}, {}):
            attention = _attention_ops(m, x, **kw)
            assert any("scaled_dot_product" in n for n in attention) == fused, (t, kw, attention)
            assert any("softmax" in n for n in attention) == (not fused), (t, kw, attention)
            if fused:  # the same numbers as the materialized logits
                expected = run(m, x, **kw)
                m.keep_attention = True
                torch.testing.assert_close(run(m, x, **kw), expected, atol=1e-5, rtol=1e-5)
                m.keep_attention = False


@pytest.mark.parametrize("share", [False, True])
def test_factorized_random_runs_the_fused_kernel_unless_the_batch_shares_one_map(share,
                                                                                monkeypatch):
    """R1 R2ᵀ is a rank-k dot product: with padding or weight dropout (a map per sentence) it
    goes through SDPA like Dense, no [B, H, Tq, Tk] logits and fp32 softmax; with neither, the
    one softmax for the whole batch stays. Outputs equal the materialized path's."""
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :3] = True
    m = make("factorized_random", share_heads=share, table_kernel="sdpa")
    for kw, fused in (({"pad": pad}, True), ({"pad": pad, "mask": causal(7)}, True),
                      ({"mask": causal(7)}, False)):
        attention = _attention_ops(m, x, **kw)
        assert any("scaled_dot_product" in n for n in attention) == fused, (kw, attention)
        assert any("softmax" in n for n in attention) == (not fused), (kw, attention)
    # weight dropout: a map per sentence too (torch's CPU SDPA runs its math path with dropout,
    # so the call itself is counted)
    calls = record_sdpa(monkeypatch)
    m.dropout = 0.1
    run(m.train(), x, mask=causal(7))
    assert [kw["dropout_p"] for _, _, _, kw in calls] == [0.1]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("t", [7, 131])
def test_random_equals_the_formula_with_its_gradients(t, padding, dtype, kernel):
    """Random, through the fused kernel (one-hot key positions against rows of R; 7 keys) and
    as a table (131 keys, past RANDOM_DOT_MAX_WIDTH), against softmax(R[pos_i, pos_j] + mask) V
    written out: outputs and the gradients of R, the input and the value projection, without
    padding and with an encoder's (left) or a decoder's (right, causal) padding."""
    m = make("random", max_len=t + 3, table_kernel=kernel).to(DEVICE, dtype)
    x = torch.randn(3, t, D, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    pad = torch.zeros(3, t, dtype=torch.bool)
    if padding == "right":
        pad[0, t - 3:] = pad[1, t - 1:] = True
    elif padding == "left":
        pad[0, :3] = pad[1, :1] = True
    pad = pad.to(DEVICE)
    causal_mask = padding != "left"
    mask = causal(t).to(DEVICE) if causal_mask else None
    grad = torch.randn(3, t, D, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)

    def grads(fn):
        xx = x.clone().requires_grad_()
        m.zero_grad()
        fn(xx).backward(grad)
        return [fn(x).detach(), xx.grad, m.R.grad, m.v_proj.weight.grad]

    def formula(xx):
        pos = ((~pad).long().cumsum(1) - 1).clamp(min=0) * (~pad)  # pads: position 0
        logits = m.R[:, pos[:, :, None], pos[:, None, :]].transpose(0, 1)  # [B, H, T, T]
        blocked = pad[:, None, None, :] | (mask.isinf() if causal_mask else False)
        probs = torch.softmax(logits.float().masked_fill(blocked, -1e9), -1).to(dtype)
        v = m.v_proj(xx).view(3, t, H, D // H).transpose(1, 2)
        return m.out_proj((probs @ v).transpose(1, 2).reshape(3, t, D))

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    given = None if padding == "none" else pad
    for ours, want in zip(grads(lambda xx: run(m, xx, pad=given, mask=mask)), grads(formula)):
        torch.testing.assert_close(ours, want, **tol)


def test_the_fused_kernels_mask_is_finite_in_autocasts_dtype(monkeypatch):
    """Random's query rows stay float32 under autocast (a gather is not autocast), and SDPA casts
    its inputs to autocast's dtype: a mask made in float32 would hold float32's minimum, which
    is -inf in bfloat16 and float16. It is made in the dtype the kernel computes in."""
    m = make("random", table_kernel="sdpa").train()
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :3] = True
    calls = record_sdpa(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(m, x, pad=pad)
    q, mask = calls[0][0], calls[0][3]["attn_mask"]
    assert q.dtype == torch.float32 and mask.dtype == torch.bfloat16
    assert torch.isfinite(mask).all() and mask.min() == torch.finfo(torch.bfloat16).min
    assert torch.isfinite(out).all()


def _step_params(m, steps=3):
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1,
                            weight_decay=0.1)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(4))
    m.train()
    for _ in range(steps):
        opt.zero_grad()
        run(m, x, mask=causal(6)).pow(2).sum().backward()
        opt.step()


def test_fixed_random_is_frozen_and_saved():
    m = make("fixed_random")
    assert "R" in m.state_dict() and "R" not in dict(m.named_parameters())
    R0, v0 = m.R.clone(), m.v_proj.weight.clone()
    _step_params(m)
    assert torch.equal(m.R, R0)  # bit-identical
    assert not torch.equal(m.v_proj.weight, v0)  # the rest trains
    trainable = make("random")
    R0 = trainable.R.detach().clone()
    _step_params(trainable)
    assert not torch.equal(trainable.R, R0)


def test_factorized_parameter_counts():
    d, h, dh = D, H, D // H
    proj = 2 * (d * d + d)  # G (value) and output projections
    n_params = lambda m: sum(p.numel() for p in m.parameters())
    a, b = 4, 3
    m = make("factorized_dense", factor_a=a, factor_b=b)
    # shared hidden W1,b1 (d^2 + d), then per head F_A: d_h -> a and F_B: d_h -> b (+ biases)
    assert n_params(m) == proj + d * d + d + h * (dh * a + a) + h * (dh * b + b)
    assert n_params(make("dense")) == proj + d * d + d + h * (dh * N + N)
    k = 3
    assert n_params(make("factorized_random", rank=k)) == proj + 2 * h * N * k
    assert n_params(make("factorized_random", rank=k, share_heads=True)) == proj + 2 * N * k
    assert n_params(make("random")) == proj + h * N * N
    assert n_params(make("fixed_random")) == proj
    with pytest.raises(ValueError, match=r"--synth-factor-a 3 x --synth-factor-b 3 = 9 is less"):
        build_options(SynthesizerConfig, Namespace(synth_max_len=N, synth_factor_a=3,
                                                   synth_factor_b=3))  # 9 < N
    assert default_factors(256) == (16, 16) and default_factors(128) == (16, 8)
    assert default_factors(64) == (8, 8) and default_factors(101)[0] ** 2 >= 101


def test_factorized_dense_tiles_every_pair():
    # column j = q*a + p is A[p] * B[q]: all a*b products appear exactly once
    m = make("factorized_dense", factor_a=4, factor_b=3)
    from fairseq_attnzoo.modules.attention import AttnContext

    x = torch.randn(1, 5, D)
    ctx = AttnContext(m, None, None, None, 1, 5, False)
    logits = m.synthesized_logits(x, None, ctx, 5)
    hidden = torch.relu(m.fdense_W1(x)).view(1, 5, H, D // H).transpose(1, 2)
    A = hidden @ m.fdense_WA + m.fdense_bA[:, None]
    B = hidden @ m.fdense_WB + m.fdense_bB[:, None]
    for j in range(5):
        torch.testing.assert_close(logits[..., j], A[..., j % 4] * B[..., j // 4])


def test_projections_read_one_copy_of_the_time_first_input():
    """fairseq hands attention time-first inputs; the base turns each into one contiguous
    batch-first tensor, read by all the module's projections (Dense: its hidden layer and the
    values), not copied again by each ``nn.Linear``."""
    m = SynthesizerAttention(D, H, components=("dense",), max_len=16)
    t, b = 5, 3
    x = torch.randn(t, b, D)
    with DispatchedOps() as ops:
        m(x, x, x, need_weights=False)
    copies = [name for name, _, args in ops.calls
              if name in ("clone", "copy_", "_to_copy") and tuple(args[0].shape) == (b, t, D)]
    assert copies == ["clone"], copies


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("share", [False, True])
def test_gathered_tables_equal_the_position_formulas(share, kernel):
    # with padding, every table is gathered by the tokens' real positions in one index:
    # Random R[h, i, j], Factorized Random R1[h, i] . R2[h, j], Factorized Dense A[p] B[q] at
    # column j = q*a + p, Dense h_i . W2[h, j] + b2[h, j], for query/key positions i, j; the sdpa
    # kernel makes Random and Factorized Random dot terms, the table kernel tables
    from fairseq_attnzoo.modules.attention import AttnContext

    m = SynthesizerAttention(D, H, components=("random", "factorized_random", "factorized_dense",
                                               "dense"), max_len=N, rank=3, factor_a=4,
                             factor_b=3, share_heads=share, table_kernel=kernel)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(8))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, :3] = True  # left padding: positions 0..3 on the last four slots
    ctx = AttnContext(m, None, pad, None, 2, 7, False)
    dots, tables = m.terms(x, None, ctx, 7)
    alpha = torch.softmax(m.mix_logits, 0)
    pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3], list(range(7))])
    hidden = torch.relu(m.fdense_W1(x)).view(2, 7, H, D // H).transpose(1, 2)
    A = hidden @ m.fdense_WA + m.fdense_bA[:, None]
    Bf = hidden @ m.fdense_WB + m.fdense_bB[:, None]
    dense_q = torch.relu(m.dense_W1(x)).view(2, 7, H, D // H).transpose(1, 2)
    products = [torch.cat(q, -1) @ torch.cat(k, -1).mT for q, k in dots]
    # in component order: Random, Factorized Random, Factorized Dense (always a table), Dense
    # (always a dot term)
    terms = (products[:2] + tables + products[2:]) if kernel == "sdpa" else (tables + products)
    assert len(terms) == 4 and len(tables) == (1 if kernel == "sdpa" else 3)
    for b in range(2):
        i, j = pos[b][:, None], pos[b][None, :]
        want = [alpha[0] * m.R[:, i, j], alpha[1] * m.R1[:, pos[b]] @ m.R2[:, pos[b]].mT,
                alpha[2] * Bf[b][..., pos[b] // 4] * A[b][..., pos[b] % 4],
                alpha[3] * (dense_q[b] @ m.dense_W2[:, pos[b]].mT + m.dense_b2[:, None, pos[b]])]
        for term, expected in zip(terms, want):
            torch.testing.assert_close(term[b].expand(H, 7, 7), expected.expand(H, 7, 7))


@pytest.mark.parametrize("mode", ["random_dense", "dense_vanilla", "random_vanilla"])
def test_mixture_weights_sum_to_one(mode):
    m = make(mode, seed=5)
    w = m.mixture_weights()
    assert list(w) == list(m.components) and abs(sum(w.values()) - 1) < 1e-6
    assert len(set(round(v, 6) for v in w.values())) > 1  # learned, not fixed at 1/n
    _step_params(m)
    assert abs(sum(m.mixture_weights().values()) - 1) < 1e-6
    assert m.mix_logits.grad is not None and m.mix_logits.grad.abs().sum() > 0
    model = torch.nn.ModuleList([make(mode), make("random")])
    rows = mixture_weights(model)
    assert [n for n, _ in rows] == ["0", "1"] and rows[1][1] == {"random": 1.0}
    assert "0: " in format_mixture_weights(model)


def test_dense_row_depends_only_on_its_token():
    m = make("dense")
    m.keep_attention = True
    x = torch.randn(1, 6, D, generator=torch.Generator().manual_seed(6))
    run(m, x)
    before = m.last_attention.clone()
    x2 = x.clone()
    x2[0, 4] += 1.0  # change token 4 only
    run(m, x2)
    after = m.last_attention
    changed = (after - before).abs().amax(dim=(0, 1, 3)) > 1e-6  # per query row
    assert changed.tolist() == [False, False, False, False, True, False]


def test_too_long_input_is_a_one_line_error():
    """The module names its own argument (max_len); the fairseq sublayer names the flag."""
    from fairseq_attnzoo.models.synthesizer import FairseqSynthesizerAttention

    m = make("random", max_len=8)
    with pytest.raises(ValueError, match="max_len >= 9") as err:
        run(m, torch.randn(1, 9, D))
    assert "\n" not in str(err.value) and "--" not in str(err.value)
    hosted = FairseqSynthesizerAttention(D, H, components=("random",), max_len=8)
    with pytest.raises(ValueError, match="raise --synth-max-len") as err:
        run(hosted, torch.randn(1, 9, D))
    assert "\n" not in str(err.value) and "max_len >=" not in str(err.value)
    # left padding beyond N is fine as long as every real sentence fits
    pad = torch.zeros(1, 10, dtype=torch.bool)
    pad[0, :2] = True
    run(hosted, torch.randn(1, 10, D), pad=pad)
    # incremental decoding past N fails the same way
    state = {}
    for t in range(8):
        run(hosted, torch.randn(1, 1, D), state=state)
    with pytest.raises(ValueError, match="--synth-max-len"):
        run(hosted, torch.randn(1, 1, D), state=state)


# ---- fairseq wiring -----------------------------------------------------------------------------
def _parse(arch: str, *extra, task="translation"):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", task, "--arch", arch, *extra])


class _Task:
    def __init__(self):
        from fairseq.data import Dictionary

        self.source_dictionary = self.target_dictionary = d = Dictionary()
        for w in "abcdefghij":
            d.add_symbol(w)


def _tiny(arch, *extra):
    return _parse(arch, "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
                  "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                  "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
                  "--encoder-layers", "2", "--decoder-layers", "2", "--synth-max-len", "16",
                  "--synth-rank", "4", *extra)


def test_arch_caps_positions_and_rejects_larger_ones():
    from fairseq_attnzoo.models.transformer import ZooTransformerModel

    args = _parse("transformer_synth_random")
    assert args.synth_max_len == SynthesizerConfig.synth_max_len == 256
    assert args.max_source_positions == args.max_target_positions == 256
    assert args.encoder_embed_dim == 512 and args.encoder_layers == 6
    args = _tiny("transformer_synth_dense")
    assert args.max_source_positions == 16
    args = _tiny("transformer_synth_dense", "--max-source-positions", "40")
    with pytest.raises(ValueError, match="--max-source-positions 40 exceeds --synth-max-len 16"):
        ZooTransformerModel.build_model(args, _Task())


def test_lm_arch_caps_block_size():
    args = _parse("transformer_lm_synth_dense_vanilla", "--synth-max-len", "48",
                  task="language_modeling")
    assert args.tokens_per_sample == args.max_target_positions == 48  # fairseq default 1024 capped
    with pytest.raises(ValueError, match="--tokens-per-sample 100 exceeds --synth-max-len 48"):
        _parse("transformer_lm_synth_random", "--synth-max-len", "48", "--tokens-per-sample", "100",
               task="language_modeling")


@pytest.mark.parametrize("tps", ["1024", "257"])
def test_lm_explicit_block_size_above_max_len_is_an_error_even_at_the_default_value(tps):
    """docs/synthesizer.md: an explicit --tokens-per-sample larger than N is an error, also when it
    equals fairseq's default 1024 (only a flag left out is capped)."""
    with pytest.raises(ValueError) as e:
        _parse("transformer_lm_synth_random", "--tokens-per-sample", tps, task="language_modeling")
    msg = str(e.value)
    assert msg == (f"--tokens-per-sample {tps} exceeds --synth-max-len 256: pass "
                   "--tokens-per-sample 256 (or less), or raise --synth-max-len")
    args = _parse("transformer_lm_synth_random", task="language_modeling")  # left out: capped
    assert args.tokens_per_sample == args.max_target_positions == 256
    args = _parse("transformer_lm_synth_random", "--tokens-per-sample", "200",
                  task="language_modeling")
    assert args.tokens_per_sample == 200


def test_model_fixed_random_buffers_in_checkpoint_and_frozen():
    from fairseq_attnzoo.models.transformer import ZooTransformerModel

    torch.manual_seed(0)
    args = _tiny("transformer_synth_fixed_random")
    model = ZooTransformerModel.build_model(args, _Task())
    keys = [k for k in model.state_dict() if k.endswith("self_attn.R")]
    assert len(keys) == 4  # 2 encoder + 2 decoder layers
    assert not any(n.endswith(".R") for n, _ in model.named_parameters())
    before = {k: model.state_dict()[k].clone() for k in keys}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    src = torch.randint(4, 14, (2, 7))
    prev = torch.randint(4, 14, (2, 5))
    for _ in range(2):
        opt.zero_grad()
        out, _ = model(src, torch.full((2,), 7), prev)
        out.logsumexp(-1).sum().backward()
        opt.step()
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in keys)
    assert "encoder.layers.0.self_attn" in format_mixture_weights(model)

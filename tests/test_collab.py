"""Collaborative multi-head attention: exact full-rank re-parametrisation, CP solver, caching,
and the checkpoint conversion script end to end (train -> convert -> generate -> fine-tune)."""

import contextlib
import importlib
import shlex
import io

import pytest
import torch

import fairseq_attnzoo  # noqa: F401
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq_attnzoo.models.collab import CollabConfig
from fairseq_attnzoo.models.sublayers import build_sublayer

from fairseq_attnzoo.modules.collab import (
    CollaborativeAttention,
    concatenate_mixing,
    cp_heads,
    cp_init_heads,
    head_projections,
)

from zoo_testlib import USER_DIR, DispatchedOps, record_sdpa, run_cli


def _script(name):
    return importlib.import_module(f"fairseq_attnzoo.cli.{name}")


def _trained_like_mha(d=32, heads=4, kdim=None, seed=0, **kw):
    torch.manual_seed(seed)
    mha = MultiheadAttention(d, heads, kdim=kdim, vdim=kdim, **kw).eval()
    with torch.no_grad():  # non-zero biases, so the content bias and b_K cancellation are exercised
        for p in mha.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return mha


# ---- module level ----------------------------------------------------------------------------

def test_full_rank_conversion_is_exact_with_padding_and_causal_masks():
    torch.manual_seed(1)
    T, B, d = 9, 3, 32
    x = torch.randn(T, B, d)
    # encoder self-attention: left padding
    mha = _trained_like_mha(d, self_attention=True)
    col = CollaborativeAttention.from_mha(mha).eval()
    assert col.key_dim == d and torch.equal(col.mixing, concatenate_mixing(4, d))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :3] = True
    pad[2, :1] = True
    ref, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    out, _ = col(x, x, x, key_padding_mask=pad)
    assert (ref - out).abs().max() <= 1e-4
    # decoder self-attention: causal mask + right padding
    causal = torch.triu(torch.full((T, T), float("-inf")), 1)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 6:] = True
    ref, _ = mha(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
    out, _ = col(x, x, x, key_padding_mask=pad, attn_mask=causal)
    assert (ref - out).abs().max() <= 1e-4
    # cross-attention with a different key dimension
    mha = _trained_like_mha(d, kdim=24, encoder_decoder_attention=True, seed=2)
    col = CollaborativeAttention.from_mha(mha).eval()
    enc = torch.randn(11, B, 24)
    pad = torch.zeros(B, 11, dtype=torch.bool)
    pad[2, :4] = True
    ref, _ = mha(x, enc, enc, key_padding_mask=pad, static_kv=True, need_weights=False)
    out, _ = col(x, enc, enc, key_padding_mask=pad, static_kv=True)
    assert (ref - out).abs().max() <= 1e-4


@pytest.mark.parametrize("cross", [False, True])
def test_projections_read_one_copy_of_each_input(cross):
    """fairseq hands attention time-first inputs; the four projections of self-attention (three
    of the keys' side in cross-attention) read one batch-first copy of each, not one copy each."""
    d, t, b = 32, 5, 3
    m = CollaborativeAttention(d, 4, 16, kdim=24 if cross else None, vdim=24 if cross else None)
    x = torch.randn(t, b, d)
    kv = torch.randn(t + 2, b, 24) if cross else x
    with DispatchedOps() as ops:
        m(x, kv, kv, need_weights=False)
    copies = [tuple(args[0].shape) for name, _, args in ops.calls
              if name in ("clone", "copy_", "_to_copy") and args[0].dim() == 3]
    expected = [(b, t, d), (b, t + 2, 24)] if cross else [(b, t, d)]
    assert sorted(c for c in copies if c in expected) == sorted(expected), copies


def test_content_bias_carries_the_query_bias_and_key_bias_cancels():
    mha = _trained_like_mha(self_attention=True, seed=3)
    col = CollaborativeAttention.from_mha(mha).eval()
    assert col.content_bias.weight.abs().max() > 1e-3  # b_Q W_Kᵀ is not zero here...
    x = torch.randn(7, 2, 32)
    with torch.no_grad():
        col.content_bias.weight.zero_()  # ...and dropping it changes the outputs
        off, _ = col(x, x, x)
        mha.k_proj.bias.add_(5.0)  # while b_K has no effect at all
    ref, _ = mha(x, x, x, need_weights=False)
    full = CollaborativeAttention.from_mha(mha).eval()
    assert (full(x, x, x)[0] - ref).abs().max() <= 1e-4
    assert (off - ref).abs().max() > 1e-3


def test_structured_als_matches_tensorly_parafac():
    import tensorly as tl
    from tensorly.cp_tensor import CPTensor
    from tensorly.decomposition import parafac

    torch.manual_seed(4)
    A, B = torch.randn(3, 10, 4, dtype=torch.float64), torch.randn(3, 12, 4, dtype=torch.float64)
    T = A @ B.transpose(1, 2)
    init = cp_init_heads(A, B, 6)
    ours = cp_heads(A, B, 6, n_iter_max=8, tol=0)
    tl.set_backend("pytorch")
    (w, (M, P, C)) = parafac(T, 6, n_iter_max=8, tol=0,
                             init=CPTensor((torch.ones(6, dtype=torch.float64), list(init))))
    ref = torch.einsum("r,hr,jr,kr->hjk", w, M, P, C)
    rec = torch.einsum("hr,jr,kr->hjk", ours.mixing, ours.W_Q, ours.W_K)
    assert ours.iterations == 8
    assert (rec - ref).abs().max() <= 1e-8 * T.abs().max()
    assert abs(ours.rel_error - float((rec - T).norm() / T.norm())) < 1e-9


def _shared_heads(seed, H=4, d=16, dk=4, R=6):
    """Per-head W_Q,i [H, d, d_k], W_K,i built from R < H·d_k shared components (d_k each)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(d, R, generator=g, dtype=torch.float64)
    C = torch.randn(d, R, generator=g, dtype=torch.float64)
    A = torch.empty(H, d, dk, dtype=torch.float64)
    B = torch.empty(H, d, dk, dtype=torch.float64)
    for i in range(H):
        cols = torch.randperm(R, generator=g)[:dk]
        A[i] = P[:, cols] * (1 + torch.rand(dk, generator=g, dtype=torch.float64))
        B[i] = C[:, cols]
    return A, B


def test_cp_recovers_heads_that_share_a_subspace():
    """Heads built from 6 shared components (4 each, 16 = H·d_k in total): rank 6 suffices, which
    no per-head truncation reaches (it is where ALS starts)."""
    A, B = _shared_heads(5)
    start = cp_heads(A, B, 6, n_iter_max=0)
    cp = cp_heads(A, B, 6, n_iter_max=300, tol=0)
    assert start.rel_error > 0.1
    assert cp.rel_error < 1e-3


def test_reduced_rank_conversion_keeps_outputs_of_collaborating_heads():
    """An MHA whose heads already share 6 components converts at D̃k = 6 < 16 with the same
    outputs: checks the CP wiring and the sqrt(D̃k/H) vs sqrt(d_k) temperature correction."""
    d, H, dk, R = 16, 4, 4, 6
    mha = _trained_like_mha(d, H, self_attention=True, seed=7)
    A, B = _shared_heads(5, H, d, dk, R)
    with torch.no_grad():  # q_proj rows of head i = W_Q,iᵀ
        mha.q_proj.weight.copy_(0.5 * A.transpose(1, 2).reshape(H * dk, d))
        mha.k_proj.weight.copy_(0.5 * B.transpose(1, 2).reshape(H * dk, d))
    col = CollaborativeAttention.from_mha(mha, key_dim=R, n_iter_max=300, tol=0).eval()
    assert col.key_dim == R and col.scaling == (R / H) ** -0.5
    x = torch.randn(8, 2, d)
    ref, _ = mha(x, x, x, need_weights=False)
    assert (col(x, x, x)[0] - ref).abs().max() <= 1e-3


def test_content_bias_rides_in_the_fused_product_and_equals_the_formula(monkeypatch):
    """logits_i = (X W̃Q diag(m_i) (Y W̃K)ᵀ + 1 (Y w_i)ᵀ) · s: the content term goes to SDPA as H
    more query/key features (padded to a multiple of 8), not as an additive bias with a gradient
    ([B, H, Tq, Tk], which the fused kernels must write out or cannot take). Outputs and every
    parameter's gradient equal the formula's."""
    torch.manual_seed(7)
    d, H, Dk, T, B = 32, 4, 13, 6, 3
    m = CollaborativeAttention(d, H, Dk).train()
    x = torch.randn(T, B, d)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :2] = True
    calls = record_sdpa(monkeypatch)
    out, _ = m(x, x, x, key_padding_mask=pad)
    (q, _, _, kw), = calls
    assert q.shape == (B, H, T, 24) and not kw["attn_mask"].requires_grad  # Dk + H = 17 -> 24
    out.pow(2).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()

    xb = x.transpose(0, 1)
    q, k, c = m.q_proj(xb), m.k_proj(xb), m.content_bias(xb)  # [B,T,Dk], [B,T,Dk], [B,T,H]
    logits = torch.einsum("bqr,hr,bkr->bhqk", q, m.mixing, k) + c.permute(0, 2, 1)[:, :, None]
    logits = (logits * m.scaling).masked_fill(pad[:, None, None], float("-inf"))
    v = m.v_proj(xb).view(B, T, H, d // H).transpose(1, 2)
    ref = m.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ref.pow(2).sum().backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_incremental_cache_stores_shared_keys_once_per_token():
    torch.manual_seed(6)
    d, H, Dk, T, B = 32, 4, 12, 6, 2  # D̃k not a multiple of H on purpose
    self_attn = CollaborativeAttention(d, H, Dk).eval()
    cross = CollaborativeAttention(d, H, Dk, kdim=20, vdim=20).eval()
    x, enc = torch.randn(T, B, d), torch.randn(5, B, 20)
    causal = torch.triu(torch.full((T, T), float("-inf")), 1)
    full = self_attn(x, x, x, attn_mask=causal)[0]
    full_cross = cross(x, enc, enc, static_kv=True)[0]
    state, steps, steps_cross = {}, [], []
    for t in range(T):
        xt = x[t:t + 1]
        steps.append(self_attn(xt, xt, xt, incremental_state=state)[0])
        steps_cross.append(cross(xt, enc, enc, incremental_state=state, static_kv=True)[0])
    assert (torch.cat(steps) - full).abs().max() <= 1e-5
    assert (torch.cat(steps_cross) - full_cross).abs().max() <= 1e-5
    # shared keys with the content bias, padded to a multiple of 8: D̃k + H + 0 = 16 per token,
    # not H x d_k
    buf = self_attn._get_buffer(state)
    assert set(buf) == {"k", "v", "_padding"}
    assert buf["k"].shape == (B, T, 16) and buf["v"].shape == (B, T, d)
    buf = cross._get_buffer(state)
    assert buf["k"].shape == (B, 5, 16)


def test_keys_and_content_bias_are_one_product_of_the_keys_input():
    """k' = [Y W̃K | Y wᵀ | 0] is one matrix product of the keys' input with the stacked weights
    (not two products, a concatenation and a padding copy), forward and backward, and the
    weights' gradients equal the two projections'."""
    torch.manual_seed(7)
    d, H, Dk, T, B = 32, 4, 12, 5, 3
    m = CollaborativeAttention(d, H, Dk, kdim=20, vdim=20)
    x, y = torch.randn(T, B, d), torch.randn(T + 2, B, 20)
    with DispatchedOps() as ops:
        out = m(x, y, y, static_kv=True)[0]
    y_first = [n for n, _, args in ops.calls if n in ("mm", "addmm", "linear", "matmul")
               and any(getattr(a, "shape", None) == (B * (T + 2), 20) for a in args)]
    assert len(y_first) == 2, y_first  # keys (with the content bias) and values
    grad = torch.randn_like(out)
    out.backward(grad)
    k_grad, c_grad = m.k_proj.weight.grad.clone(), m.content_bias.weight.grad.clone()
    m.zero_grad()
    # the same function with the two projections written out
    yb = y.transpose(0, 1)
    q = torch.cat([m.q_proj(x.transpose(0, 1)), torch.ones(B, T, 4)], -1)
    kk = torch.cat([m.k_proj(yb), m.content_bias(yb)], -1)
    mixing = torch.cat([m.mixing, torch.eye(H, 4)], -1)
    logits = (q[:, None] * mixing[None, :, None]) @ kk[:, None].transpose(-1, -2) * m.scaling
    v = m.v_proj(yb).view(B, T + 2, H, d // H).transpose(1, 2)
    ref = m.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ref.backward(grad)
    torch.testing.assert_close(k_grad, m.k_proj.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_grad, m.content_bias.weight.grad, atol=1e-5, rtol=1e-5)


def test_builder_flags():
    from argparse import Namespace

    from fairseq_attnzoo.models.collab import build_collab, resolve_key_dim
    from fairseq_attnzoo.models.sublayers import SublayerSpec

    assert resolve_key_dim(0, 512) == 128  # d/4 by default
    assert resolve_key_dim(40, 512) == 40
    for bad, flag in (({"collab_key_dim": -3}, "--collab-key-dim"),
                      ({"collab_mixing_init": "bogus"}, "--collab-mixing-init")):
        spec = SublayerSpec("self_attn", "encoder", 0, 1, 32, 4, 64, 0.0, 0.0, False, 32,
                            Namespace(**bad))
        with pytest.raises(ValueError, match=flag):
            build_sublayer("collab", spec)
    # the typed options reach the module; an explicit spec.options skips the namespace
    spec = SublayerSpec("self_attn", "encoder", 0, 1, 32, 4, 64, 0.0, 0.0, False, 32, Namespace(),
                        options=CollabConfig(collab_key_dim=16, collab_qk_bias=True))
    m = build_collab(spec)
    assert m.key_dim == 16 and m.content_bias is None and m.q_proj.bias is not None


# ---- the authors' fairseq fork (jbcdnr/fairseq-collaborative-heads) ---------------------------

# parameter layout of the fork's MultiheadAttention(collaborative_heads=True, kdim=D̃k), self- or
# cross-attention with encoder dim = d (read from its fairseq/modules/multihead_attention.py)
def fork_layout(d, H, Dk):
    return {"q_proj.weight": (Dk, d), "q_proj.bias": (Dk,), "k_proj.weight": (Dk, d),
            "k_proj.bias": (Dk,), "v_proj.weight": (d, d), "v_proj.bias": (d,),
            "mixing_matrix": (H, Dk), "out_proj.weight": (d, d), "out_proj.bias": (d,)}


def _fork_reference(state, x, y, H, pad=None, causal=None):
    """The fork's forward, re-implemented as it computes it: mixing on the key side (per-head keys
    k_h = (y W̃K + b̃K) diag(m_h)), q = (x W̃Q + b̃Q) / sqrt(d/H). x [T, B, d], y [S, B, d]."""
    d = x.size(-1)
    q = (x @ state["q_proj.weight"].t() + state["q_proj.bias"]) * (d // H) ** -0.5
    k = y @ state["k_proj.weight"].t() + state["k_proj.bias"]
    k = k.unsqueeze(2) * state["mixing_matrix"][None, None]  # [S, B, H, D̃k]
    v = (y @ state["v_proj.weight"].t() + state["v_proj.bias"]).view(y.size(0), y.size(1), H, -1)
    logits = torch.einsum("tbd,sbhd->bhts", q, k)
    if causal is not None:
        logits = logits + causal
    if pad is not None:
        logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("bhts,sbhe->tbhe", torch.softmax(logits, -1), v).reshape(x.shape)
    return out @ state["out_proj.weight"].t() + state["out_proj.bias"]


def test_fork_arch_builds_with_the_fork_parameter_layout_and_init():
    from argparse import Namespace

    from fairseq import options

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--user-dir", USER_DIR, "--arch", "transformer_collab_fork", "--task",
        "translation", "--collab-key-dim", "128"])
    assert (args.collab_qk_bias, args.collab_scaling, args.collab_mixing_init,
            args.collab_proj_init) == (True, "head_dim", "xavier", "fork")
    assert {args.encoder_self_attn, args.decoder_self_attn, args.cross_attn} == {"collab"}
    from fairseq_attnzoo.models.sublayers import SublayerSpec

    torch.manual_seed(0)
    d, H, Dk = 512, 8, 128
    m = build_sublayer("collab", SublayerSpec("self_attn", "encoder", 0, 6, d, H, 2048, 0.0, 0.0,
                                              False, d, args))
    layout = {("mixing_matrix" if n == "mixing" else n): tuple(p.shape)
              for n, p in m.state_dict().items()}
    assert layout == fork_layout(d, H, Dk)
    assert m.scaling == (d / H) ** -0.5  # 1/sqrt(d/H) = 1/8, not 1/sqrt(D̃k/H) = 1/4
    # xavier-uniform mixing and, since D̃k != d, plain (gain 1) xavier on W̃Q, W̃K, W_V
    for w, (fan_out, fan_in) in ((m.mixing, (H, Dk)), (m.q_proj.weight, (Dk, d)),
                                 (m.k_proj.weight, (Dk, d)), (m.v_proj.weight, (d, d))):
        bound = (6 / (fan_in + fan_out)) ** 0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.97 * bound
    # ours (transformer_collab) keeps fairseq MHA's gain 1/sqrt(2), a content bias, no q/k bias
    ours = build_sublayer("collab", SublayerSpec("self_attn", "encoder", 0, 6, d, H, 2048, 0.0,
                                                 0.0, False, d, Namespace(collab_key_dim=Dk)))
    assert ours.q_proj.bias is None and ours.content_bias.weight.shape == (H, d)
    assert ours.q_proj.weight.abs().max() <= (3 / (d + Dk)) ** 0.5
    assert ours.scaling == (Dk / H) ** -0.5


@pytest.mark.parametrize("cross", [False, True])
def test_fork_state_dict_loads_and_matches_the_forks_key_side_forward(cross):
    torch.manual_seed(0)
    T, S, B, d, H, Dk = 6, 7, 3, 32, 4, 12
    state = {n: torch.randn(shape) * 0.3 for n, shape in fork_layout(d, H, Dk).items()}
    m = CollaborativeAttention(d, H, Dk, qk_bias=True, scaling="head_dim").eval()
    m.load_state_dict(dict(state))  # the fork's ``mixing_matrix`` loads into ``mixing``
    assert torch.equal(m.mixing, state["mixing_matrix"])
    x = torch.randn(T, B, d)
    y = torch.randn(S, B, d) if cross else x
    pad = torch.zeros(B, y.size(0), dtype=torch.bool)
    pad[1, -2:] = True
    causal = None if cross else torch.triu(torch.full((T, T), float("-inf")), 1)
    out, _ = m(x, y, y, key_padding_mask=pad, attn_mask=causal, static_kv=cross)
    ref = _fork_reference(state, x, y, H, pad=pad, causal=causal)
    assert (out - ref).abs().max() <= 1e-5
    # incremental decoding caches one shared [B, T, D̃k] key tensor and no content bias
    if not cross:
        inc, steps = {}, []
        for t in range(T):
            xt = x[t:t + 1]
            steps.append(m(xt, xt, xt, incremental_state=inc, key_padding_mask=pad[:, t:t + 1])[0])
        assert (torch.cat(steps) - out).abs().max() <= 1e-5
        buf = m._get_buffer(inc)
        assert buf["k"].shape == (B, T, Dk) and "c" not in buf


def test_fork_configuration_at_full_rank_is_fairseq_mha():
    """With D̃k = d, block one-hot mixing and the MHA's own q/k biases, the fork's logits
    (x W̃Q + b̃Q) diag(m_i) (y W̃K + b̃K)ᵀ / sqrt(d/H) are exactly fairseq MHA's."""
    torch.manual_seed(2)
    T, B, d, H = 8, 3, 32, 4
    mha = _trained_like_mha(d, H, self_attention=True)
    state = {n: p for n, p in mha.state_dict().items()}
    state["mixing"] = concatenate_mixing(H, d)
    col = CollaborativeAttention(d, H, d, qk_bias=True, scaling="head_dim", proj_init="fork").eval()
    col.load_state_dict(state)
    x = torch.randn(T, B, d)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -3:] = True  # right padding: no query row is fully masked
    causal = torch.triu(torch.full((T, T), float("-inf")), 1)
    ref, _ = mha(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
    out, _ = col(x, x, x, key_padding_mask=pad, attn_mask=causal)
    assert (ref - out).abs().max() <= 1e-5


# ---- checkpoint conversion end to end --------------------------------------------------------

TINY = ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--encoder-layers", "2", "--decoder-layers", "2"]
COMMON = ["--user-dir", USER_DIR, "--cpu", "--no-progress-bar", "--log-format", "simple",
          "--seed", "1", "--num-workers", "0"]


@pytest.fixture(scope="module")
def vanilla(trained, tmp_path_factory):
    """A tiny attnzoo_transformer (concatenated heads, the sizes of TINY) trained for 3 updates on
    the toy task (the sweep's run, read only), and a folder for what the tests write."""
    run = trained("attnzoo_transformer")
    args = torch.load(run.ckpt, weights_only=False)["cfg"]["model"]
    assert [args.encoder_embed_dim, args.encoder_layers] == [32, 2]  # TINY's
    return tmp_path_factory.mktemp("collab"), run.data, run.ckpt


def _load(path, data):
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path],
                                                                      arg_overrides={"data": data})
    return models[0].eval(), task


def _outputs(model, task):
    itr = task.get_batch_iterator(task.dataset("test"), max_tokens=1000).next_epoch_itr(
        shuffle=False)
    batch = next(iter(itr))
    with torch.no_grad():
        return model(**batch["net_input"])[0]


def test_convert_full_rank_exact_then_generate_and_finetune(vanilla):
    root, data, ckpt = vanilla
    conv = _script("collab_reparametrize")
    full, half = str(root / "full.pt"), str(root / "half.pt")
    rows = conv.main([ckpt, full, "--key-dim", "32", "--quiet"])
    assert len(rows) == 6 and all(r[3] == 0.0 for r in rows)  # 2 enc self, 2 dec self, 2 cross
    rows = conv.main([ckpt, half, "--key-dim", "16", "--quiet"])
    assert all(0.0 < r[3] < 1.0 for r in rows)

    orig, task = _load(ckpt, data)
    collab, _ = _load(full, data)
    assert type(collab.encoder.layers[0].self_attn).__name__ == "CollaborativeAttention"
    assert type(collab.decoder.layers[1].encoder_attn).__name__ == "CollaborativeAttention"
    task.load_dataset("test")
    ref, out = _outputs(orig, task), _outputs(collab, task)
    assert (ref - out).abs().max() <= 1e-4
    small, _ = _load(half, data)
    assert small.encoder.layers[0].self_attn.k_proj.weight.shape == (16, 32)
    assert (_outputs(small, task) - ref).abs().max() > 1e-4  # compressed: not the same model

    lines = run_cli("generate", [
        data, "--user-dir", USER_DIR, "--path", half, "--beam", "2", "--max-len-b", "12",
        "--batch-size", "8", "--cpu", "--gen-subset", "test"])
    assert sum(line.startswith("H-") for line in lines) == len(task.dataset("test"))

    run_cli("train", [
        data, "--arch", "transformer_collab", "--collab-key-dim", "16", *TINY, "--optimizer", "adam",
        "--lr", "1e-3", "--max-tokens", "400", "--max-update", "5",
        "--save-dir", str(root / "ft"), "--restore-file", half, "--reset-optimizer",
        "--no-epoch-checkpoints", "--disable-validation", *COMMON])
    tuned = torch.load(str(root / "ft" / "checkpoint_last.pt"), weights_only=False)
    assert tuned["optimizer_history"][-1]["num_updates"] == 5
    before = torch.load(half, weights_only=False)["model"]
    key = "encoder.layers.0.self_attn.mixing"
    assert not torch.equal(tuned["model"][key], before[key])  # the mixing trains


def test_printed_finetune_command_runs_as_printed(vanilla, capsys):
    """The command printed after a conversion names the checkpoint's data, sizes and optimizer
    (no placeholder): it parses, builds a model the converted weights load into, and trains."""
    from fairseq import options, tasks

    root, data, ckpt = vanilla
    out = str(root / "ft_cmd" / "converted.pt")
    _script("collab_reparametrize").main([ckpt, out, "--key-dim", "16", "--quiet"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fine-tune: "))
    argv = shlex.split(line[len("fine-tune: "):])
    assert argv[0] == "fairseq-train" and "<" not in line
    args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    assert (args.arch, args.collab_key_dim, args.encoder_embed_dim, args.encoder_layers,
            args.optimizer, args.data) == ("transformer_collab", 16, 32, 2, "adam", data)
    model = tasks.setup_task(args).build_model(args)
    model.load_state_dict(torch.load(out, weights_only=False)["model"], strict=True)
    lines = run_cli("train", argv[1:] + ["--max-update", "1", "--no-epoch-checkpoints"])
    assert any("done training" in x for x in lines)


def test_convert_accepts_stock_transformer_arch(vanilla):
    from fairseq import checkpoint_utils

    _, _, ckpt = vanilla
    conv = _script("collab_reparametrize")
    state = checkpoint_utils.load_checkpoint_to_cpu(ckpt)
    for attr in ("encoder_self_attn", "decoder_self_attn", "cross_attn"):
        delattr(state["cfg"]["model"], attr)
    state["cfg"]["model"]._name = state["cfg"]["model"].arch = "transformer_iwslt_de_en"
    rows = conv.convert(state, 8, progress=False)
    assert len(rows) == 6
    assert state["cfg"]["model"]._name == "transformer_collab"
    assert state["cfg"]["model"].cross_attn == "collab"
    assert state["model"]["decoder.layers.0.encoder_attn.mixing"].shape == (4, 8)
    assert "decoder.layers.0.encoder_attn.q_proj.bias" not in state["model"]


@pytest.mark.parametrize("key_dim, message", [
    ("0", "expected a positive integer"), ("abc", "expected a positive integer"),
    ("2.5", "expected a positive integer"), ("33", "expected 1 <= D̃k <= 32"),
])
def test_convert_rejects_bad_key_dim(vanilla, tmp_path, capsys, key_dim, message):
    _, _, ckpt = vanilla
    conv = _script("collab_reparametrize")
    with pytest.raises(SystemExit) as e:
        conv.main([ckpt, str(tmp_path / "x.pt"), "--key-dim", key_dim, "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x.pt").exists()


def test_convert_rejects_unsupported_arch(vanilla, tmp_path, capsys):
    from fairseq import checkpoint_utils

    _, _, ckpt = vanilla
    state = checkpoint_utils.load_checkpoint_to_cpu(ckpt)
    state["cfg"]["model"]._name = state["cfg"]["model"].arch = "lstm"
    bad = str(tmp_path / "lstm.pt")
    from omegaconf import OmegaConf

    state["cfg"] = OmegaConf.to_container(state["cfg"], resolve=True)
    torch.save(state, bad)
    conv = _script("collab_reparametrize")
    with pytest.raises(SystemExit):
        conv.main([bad, str(tmp_path / "y.pt"), "--key-dim", "8", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unsupported arch 'lstm'" in err and "expected" in err
    # an already-replaced attention slot is refused too
    state["cfg"]["model"]._name = state["cfg"]["model"].arch = "attnzoo_transformer"
    state["cfg"]["model"].encoder_self_attn = "collab"
    torch.save(state, bad)
    with pytest.raises(SystemExit):
        conv.main([bad, str(tmp_path / "y.pt"), "--key-dim", "8", "--quiet"])
    assert "--encoder-self-attn 'collab'" in capsys.readouterr().err


def test_spectrum_plot(vanilla, tmp_path):
    _, _, ckpt = vanilla
    plot = _script("plot_qk_spectrum")
    png = tmp_path / "spec.png"
    with contextlib.redirect_stdout(io.StringIO()):
        curves = plot.main([ckpt, "-o", str(png), "--with-projections"])
    assert png.stat().st_size > 1000 and len(curves) == 6
    prod, _ = curves["encoder.0.self"]
    assert abs(prod[-1] - 1.0) < 1e-9 and all(a <= b + 1e-12 for a, b in zip(prod, prod[1:]))

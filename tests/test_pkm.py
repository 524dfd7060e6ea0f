"""Product-key memory: exact product top-k, pad-free batch norm, sparse row updates, pkm_adam,
the refused flag combinations, layer selection and the usage diagnostics."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from zoo_testlib import USER_DIR, DispatchedOps
from fairseq import options
from fairseq.logging import metrics

from fairseq_attnzoo.models.pkm import UsageLogger, memory_layers, sparse_values
from fairseq_attnzoo.models.sublayers import SublayerSpec, build_sublayer
from fairseq_attnzoo.modules import pkm_triton
from fairseq_attnzoo.modules.pkm import ProductKeyMemory, product_topk, slot_counts, usage_stats
from fairseq_attnzoo.optim.pkm_optimizer import PKMAdam, PKMAdamConfig


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _memory(sparse=False, bn=True, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(n_keys=12, heads=3, knn=5, k_dim=8)
    cfg.update(kw)
    return ProductKeyMemory(16, 16, query_batchnorm=bn, sparse=sparse, **cfg)


# ---- the product-key search -------------------------------------------------------------------

@pytest.mark.parametrize("n_keys,knn", [(12, 5), (7, 7), (30, 1)])
def test_product_topk_equals_brute_force_over_all_product_keys(n_keys, knn):
    g = torch.Generator().manual_seed(n_keys)
    h, n, half = 3, 50, 4
    q1, q2 = torch.randn(h, n, half, generator=g), torch.randn(h, n, half, generator=g)
    k1, k2 = torch.randn(h, n_keys, half, generator=g), torch.randn(h, n_keys, half, generator=g)
    scores, idx = product_topk(q1, q2, k1, k2, knn)
    # every product key (a, b) = concat(k1[a], k2[b]) scored explicitly: n_keys² keys per head
    full_keys = torch.cat([k1.unsqueeze(2).expand(h, n_keys, n_keys, half),
                           k2.unsqueeze(1).expand(h, n_keys, n_keys, half)], -1)
    full = torch.einsum("hnd,hkd->hnk", torch.cat([q1, q2], -1), full_keys.reshape(h, -1, 2 * half))
    ref_scores, ref_idx = full.topk(knn, dim=-1)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_keys,knn", [(12, 5), (7, 7), (30, 1)])
def test_product_topk_gradients_equal_autograd_through_brute_force(n_keys, knn):
    """The hand-written backward of the search (straight to the chosen sub-keys) equals autograd
    through the explicit scores of all n_keys² product keys."""
    g = torch.Generator().manual_seed(n_keys + 1)
    h, n, half = 3, 40, 4
    leaves = [torch.randn(h, n, half, generator=g, requires_grad=True) for _ in range(2)]
    leaves += [torch.randn(h, n_keys, half, generator=g, requires_grad=True) for _ in range(2)]
    up = torch.randn(h, n, knn, generator=g)
    q1, q2, k1, k2 = leaves
    scores, idx = product_topk(q1, q2, k1, k2, knn)
    ours = torch.autograd.grad((scores.softmax(-1) * up).sum(), leaves)
    full = (torch.einsum("hnd,hkd->hnk", q1, k1).unsqueeze(-1)
            + torch.einsum("hnd,hkd->hnk", q2, k2).unsqueeze(-2)).reshape(h, n, -1)
    ref_scores, ref_idx = full.topk(knn, dim=-1)
    assert torch.equal(idx, ref_idx)
    ref = torch.autograd.grad((ref_scores.softmax(-1) * up).sum(), leaves)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_product_topk_in_token_chunks_equals_one_block(monkeypatch):
    """The CPU search runs in chunks of tokens (cache-sized score blocks): 7 tokens a chunk
    (a ragged last one) selects the same keys as one block, with the same scores and gradients up
    to float rounding (the GEMM of a smaller block may sum in another order)."""
    import fairseq_attnzoo.modules.pkm_search as search

    g = torch.Generator().manual_seed(3)
    h, n, half, n_keys, knn = 3, 50, 4, 12, 5
    leaves = [torch.randn(h, n, half, generator=g, requires_grad=True) for _ in range(2)]
    leaves += [torch.randn(h, n_keys, half, generator=g, requires_grad=True) for _ in range(2)]
    up = torch.randn(h, n, knn, generator=g)

    def run():
        scores, idx = product_topk(*leaves, knn)
        return (scores, idx) + torch.autograd.grad((scores.softmax(-1) * up).sum(), leaves)

    monkeypatch.setattr(search, "_SCORE_CHUNK", h * n_keys * n)
    whole = run()
    monkeypatch.setattr(search, "_SCORE_CHUNK", h * n_keys * 7)
    chunked = run()
    assert torch.equal(whole[1], chunked[1])
    for a, b in zip(whole[:1] + whole[2:], chunked[:1] + chunked[2:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_search_answers_token_major_and_its_key_gradient_is_a_gemm_per_half(monkeypatch):
    """A GPU step at transformer-base size waits on the host's kernel launches. The search (one
    chunk, as on CUDA) hands the value read its weights and (int32) slot ids as views, with no
    transposed copies, and the sub-key gradient is one scatter and one batched GEMM per half for
    all heads (not one per head and half)."""
    import fairseq_attnzoo.modules.pkm_search as search

    monkeypatch.setattr(search, "_SCORE_CHUNK", 1 << 62)
    m = _memory(heads=4)
    q = m.query(torch.randn(9, 16)).detach().requires_grad_()
    m.lookup(q)  # the candidate-pair table is made once per knn and device
    with DispatchedOps() as ops:
        weights, indices = m.lookup(q)
    assert not {"clone", "copy_", "cat"} & set(ops.names), ops.names
    assert ops.n["_to_copy"] == 2, ops.names  # the two top-k's sub-key ids to int32
    assert indices.dtype == torch.int32
    loss = (weights * torch.randn_like(weights)).sum()
    with DispatchedOps() as ops:
        loss.backward()
    assert (ops.n["scatter_add_"], ops.n["bmm"], ops.n["mm"]) == (2, 2, 0), ops.names


def test_memory_read_equals_explicit_weighted_sum_of_values():
    m = _memory(bn=False).eval()
    x = torch.randn(9, 16)
    q = m.query(x)  # [H, N, k_dim]
    half = m.k_dim // 2
    keys = torch.cat([m.keys[:, 0].unsqueeze(2).expand(-1, -1, m.n_keys, -1),
                      m.keys[:, 1].unsqueeze(1).expand(-1, m.n_keys, -1, -1)], -1)
    full = torch.einsum("hnd,hkd->hnk", q, keys.reshape(m.heads, -1, 2 * half))
    s, i = full.topk(m.knn, -1)
    w = torch.softmax(s, -1)  # softmax over each head's k scores; heads summed
    ref = torch.einsum("hnk,hnkd->nd", w, m.values.weight[i])
    torch.testing.assert_close(m.read(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [True, False])
def test_value_read_gradients_equal_plain_autograd(sparse):
    """The compact table gradient (coalesced rows) and the weight gradient equal autograd through
    an explicit gather, duplicates included."""
    from fairseq_attnzoo.modules.pkm_values import _WeightedRowSum

    g = torch.Generator().manual_seed(2)
    table = torch.randn(20, 6, generator=g, requires_grad=True)
    idx = torch.randint(0, 20, (7, 5), generator=g)
    idx[0, :3] = 4  # repeated rows inside a bag and across bags
    idx[3, 0] = 4
    w = torch.rand(7, 5, generator=g, requires_grad=True)
    up = torch.randn(7, 6, generator=g)
    (_WeightedRowSum.apply(table, idx, w, sparse) * up).sum().backward()
    g_table = table.grad.to_dense() if sparse else table.grad
    assert table.grad.is_sparse == sparse
    if sparse:  # one entry per distinct row read, sorted (autograd drops the coalesced flag)
        assert torch.equal(table.grad._indices()[0], torch.unique(idx))
    g_w = w.grad.clone()
    table.grad, w.grad = None, None
    ((table[idx] * w.unsqueeze(-1)).sum(1) * up).sum().backward()
    torch.testing.assert_close(g_table, table.grad)
    torch.testing.assert_close(g_w, w.grad)


def test_zeroed_loss_reads_no_sparse_rows():
    """fairseq multiplies the loss of a DDP rank's padding (dummy) batch by 0; its sparse table
    gradient must hold no rows, or the lazy value optimiser decays the moments of rows that one
    process never read (update 3 of the 2-rank --update-freq 2 run differed by 6e-4)."""
    from fairseq_attnzoo.modules.pkm_values import _WeightedRowSum

    g = torch.Generator().manual_seed(4)
    table = torch.randn(20, 6, generator=g, requires_grad=True)
    real, dummy = (torch.randint(0, 20, (7, 5), generator=g) for _ in range(2))
    w = torch.rand(7, 5, generator=g)
    up = torch.randn(7, 6, generator=g)
    (_WeightedRowSum.apply(table, real, w, True) * up).sum().backward()
    (_WeightedRowSum.apply(table, dummy, w, True) * up).sum().mul(0).backward()
    grad = table.grad.coalesce()
    assert torch.equal(grad.indices()[0], torch.unique(real))
    table.grad = None
    (_WeightedRowSum.apply(table, dummy, w, True) * up).sum().mul(0).backward()
    assert table.grad.is_sparse and table.grad._nnz() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_table_gradient_equals_embedding_bag_autograd(dtype):
    """The dense gradient (one bag per table row, empty bags = the unread rows) equals the stock
    ``F.embedding_bag`` backward, unread rows exactly zero; bf16 within bf16 rounding."""
    from fairseq_attnzoo.modules.pkm_values import _WeightedRowSum

    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, 8, generator=g).to(dtype).requires_grad_(True)
    idx = torch.randint(0, 40, (9, 6), generator=g)  # rows 40..49 and some others never read
    idx[1, :4] = 7
    w = torch.rand(9, 6, generator=g).to(dtype).requires_grad_(True)
    up = torch.randn(9, 8, generator=g).to(dtype)
    (_WeightedRowSum.apply(table, idx, w, False) * up).sum().backward()
    ours, ours_w = table.grad, w.grad
    assert ours.layout == torch.strided and ours.shape == table.shape and ours.dtype == dtype
    unread = torch.ones(50, dtype=torch.bool)
    unread[idx.reshape(-1)] = False
    assert ours[unread].abs().max() == 0
    ref_table = table.detach().float().requires_grad_(True)
    ref_w = w.detach().float().requires_grad_(True)
    ref = F.embedding_bag(idx, ref_table, mode="sum", per_sample_weights=ref_w)
    (ref * up.float()).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours.float(), ref_table.grad, **tol)
    torch.testing.assert_close(ours_w.float(), ref_w.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_fallback_equals_the_kernel(dtype):
    """CUDA has no bfloat16 kernel for the embedding-bag weight gradient (found on an H100: a bf16
    PKM model could not train); the chunked gather fallback computes the same dots."""
    from fairseq_attnzoo.modules.pkm_values import read_dots

    g = torch.Generator().manual_seed(5)
    n, m, d = 7, 5, 16
    table = torch.randn(30, d, generator=g).to(dtype)
    grad = torch.randn(n, d, generator=g).to(dtype)
    rows = torch.randint(0, 30, (n * m,), generator=g).sort().values
    token = torch.randint(0, n, (n * m,), generator=g)
    ref = (table[rows].double() * grad[token].double()).sum(-1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for kernel in (True, False):
        out = read_dots(grad, table, rows, token, n, m, kernel=kernel)
        assert out.dtype == dtype and out.shape == (n * m,)
        torch.testing.assert_close(out.double(), ref, **tol)


# ---- padding and batch norm -------------------------------------------------------------------

def test_padding_changes_neither_batchnorm_statistics_nor_real_outputs():
    t, b = 6, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, b, 16, generator=g)
    pad = torch.zeros(b, t, dtype=torch.bool)
    pad[0, :2] = True  # left-padded source-style
    pad[2, 4:] = True  # right-padded target-style
    pad[3, 1:] = True
    x_other = x.clone()
    x_other[pad.t()] = 1e3 * torch.randn(int(pad.sum()), 16, generator=g)  # different garbage

    outs, stats = [], []
    for inp in (x, x_other):
        m = _memory(bn=True).train()
        outs.append(m(inp, pad))
        stats.append((m.query_bn.running_mean.clone(), m.query_bn.running_var.clone()))
    real = ~pad.t()
    torch.testing.assert_close(outs[0][real], outs[1][real])
    torch.testing.assert_close(stats[0][0], stats[1][0])
    torch.testing.assert_close(stats[0][1], stats[1][1])
    assert outs[0][pad.t()].abs().max() == 0, "padded positions read nothing"

    # statistics = those of the real tokens alone (a batch with no padding at all)
    m = _memory(bn=True).train()
    alone = m.read(x[real])
    torch.testing.assert_close(alone, outs[0][real])
    torch.testing.assert_close(m.query_bn.running_mean, stats[0][0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries_leave_the_batch_norm_in_float32_without_a_round_trip(dtype):
    """The batch norm's float32 output goes on to the search as it is (not rounded to the
    model's dtype and cast back, two copies each way; the search rounds it once to its own
    dtype, tests/test_pkm_half.py), and the one cast of the query path is the projection's
    into the batch norm."""
    m = ProductKeyMemory(16, n_keys=8, heads=2, knn=4, k_dim=8).to(dtype).train()
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    with DispatchedOps() as ops:
        q = m.query(x)
    assert q.dtype == torch.float32 and ops.n["_to_copy"] == 1, ops.names
    bn = m.query_bn
    ref = F.batch_norm(m.query_proj(x).float(), None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    torch.testing.assert_close(q, ref.view(10, 2, 8).transpose(0, 1), rtol=0, atol=0)


#: the memory layer's configurations: dense values, the same with padding, Memory+ (shared-pool
#: style swilu output, qk-norm, its init) with padding, sparse values with padding
LAYERS = {"dense": ({}, False), "padded": ({}, True),
          "memory+": (dict(swilu="reference", qk_norm=True, init="memplus"), True),
          "sparse": (dict(sparse=True), True)}


def _layer_step_inputs(padded):
    x = torch.randn(6, 4, 16, requires_grad=True, generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[1, :2] = padded
    pad[3, 1:] = padded
    return x, (pad if padded else None)


@pytest.mark.parametrize("layer,expected", [("dense", []), ("padded", []), ("memory+", []),
                                            ("sparse", ["nonzero"])])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_training_step_syncs_with_the_device_only_for_sparse_rows(layer, expected, kernel,
                                                                     monkeypatch):
    """On CUDA every op that reads a device value back (``bool(t)``, ``.item()``) or sizes its
    output by the data (``nonzero``, ``bincount``) drains the GPU's queue. A memory layer's
    forward and backward need none: pads are masked, not removed; the search's candidate pairs
    are a constant made without ``nonzero``; the value gradient's row ranges are a binary search
    (``pkm_triton.row_ranges``). A sparse value gradient needs one: the number of distinct rows
    read (and a zeroed loss gives an empty one without reading the loss back), on the PyTorch
    path and the Triton kernels' alike (before: the kernels' path read the loss back and took
    the rows in a second op). Counted on the CPU with the benchmark's CUDA classification
    (``tests/syncs_testlib.py``; the kernels in Triton's interpreter)."""
    from fairseq_attnzoo.modules import pkm, pkm_search
    from syncs_testlib import syncs

    # the candidate pairs: built again inside the count, as by a layer's first step
    pkm_search._candidate_pairs.cache_clear()
    monkeypatch.setattr(pkm, "SKIP_PADS_ON", ())  # pads masked, as on CUDA
    kw, padded = LAYERS[layer]
    if kernel == "triton" and not (pkm_triton.HAS_TRITON and pkm_triton.interpreted()):
        pytest.skip("Triton's interpreter is not available")
    m = _memory(kernel=kernel, **kw).train()
    x, pad = _layer_step_inputs(padded)
    assert syncs(lambda: m(x, pad).square().sum().backward()) == expected
    assert m.values.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("layer", ["dense", "padded", "memory+"])
def test_the_layer_compiles_to_one_graph_forward_and_backward(layer):
    """``torch.compile(layer, fullgraph=True)`` takes the whole memory layer, forward and
    backward (AOTAutograd traces both hand-written backwards), with no graph break (before:
    12 graphs for the dense layer by ``torch._dynamo.explain``: the candidate pairs' and the
    padding's ``nonzero``), and computes what the eager layer does. The ``aot_eager`` backend
    keeps the test fast; inductor compiles the same graphs."""
    kw, padded = LAYERS[layer]
    x, pad = _layer_step_inputs(padded)
    results = []
    for compiled in (False, True):
        m = _memory(kernel="torch", **kw).train()
        run = torch.compile(m, fullgraph=True, backend="aot_eager") if compiled else m
        x.grad = None
        out = run(x, pad)
        out.square().sum().backward()
        results.append([out, x.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("skip,kernel", [(False, "torch"), (True, "torch"), (False, "triton")])
@pytest.mark.parametrize("sparse", [True, False])
def test_padding_masked_equals_padding_removed(sparse, skip, kernel, monkeypatch):
    """Pads are masked (as on CUDA) or removed (the CPU: ``pkm.SKIP_PADS_ON``); either way the
    result is that of the real tokens alone: the same outputs, batch-norm statistics and
    gradients (a sparse value gradient holds exactly the rows the real tokens read, on the
    Triton path too, in its interpreter), and zeros at the pads, even where they hold inf."""
    from fairseq_attnzoo.modules import pkm, pkm_triton

    if kernel == "triton" and not pkm_triton.HAS_TRITON:
        pytest.skip("Triton is not installed (make install adds it)")
    monkeypatch.setattr(pkm, "SKIP_PADS_ON", ("cpu",) if skip else ())
    x, pad = _layer_step_inputs(True)
    real = ~pad.t()
    with torch.no_grad():
        x[~real] = float("inf")  # whatever a pad holds changes nothing (0 · inf is nan)
    padded = _memory(kernel=kernel, sparse=sparse).train()
    out = padded(x, pad)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    grads = [x.grad[real]] + [p.grad for p in padded.parameters()]
    alone = _memory(kernel="torch", sparse=sparse).train()
    xr = x.detach()[real].requires_grad_()
    ref = alone.transform(xr)
    (ref * torch.arange(out.numel()).view_as(out)[real].sin()).sum().backward()
    torch.testing.assert_close(out[real], ref)
    assert out[pad.t()].abs().max() == 0 and x.grad[pad.t()].abs().max() == 0
    for a, b in zip(grads, [xr.grad] + [p.grad for p in alone.parameters()]):
        if b.is_sparse:
            a, b = a.coalesce(), b.coalesce()
            assert torch.equal(a.indices(), b.indices())
            a, b = a.values(), b.values()
        torch.testing.assert_close(a, b)
    for a, b in ((padded.query_bn.running_mean, alone.query_bn.running_mean),
                 (padded.query_bn.running_var, alone.query_bn.running_var)):
        torch.testing.assert_close(a, b)


def test_eval_mode_is_position_wise():
    m = _memory(bn=True).train()
    m(torch.randn(5, 3, 16))  # move the running statistics away from their init
    m.eval()
    x = torch.randn(5, 3, 16)
    full = m(x)
    torch.testing.assert_close(m(x[2:3, 1:2]), full[2:3, 1:2], rtol=1e-5, atol=1e-6)


# ---- sparse updates and the pkm_adam optimizer --------------------------------------------------

def _pkm_adam(model, values_lr=1e-2, lr=1e-3, weight_decay=0.0):
    cfg = PKMAdamConfig(lr=[lr], pkm_values_lr=values_lr, weight_decay=weight_decay)
    return PKMAdam(cfg, [p for p in model.parameters() if p.requires_grad])


def test_sparse_step_changes_only_the_selected_value_rows():
    m = _memory(sparse=True).train()
    opt = _pkm_adam(m)
    x = torch.randn(4, 2, 16)
    before = m.values.weight.detach().clone()
    m(x).square().sum().backward()
    grad = m.values.weight.grad
    assert grad.is_sparse
    _, idx = m.lookup(m.query(x.reshape(-1, 16)))  # same BN batch statistics -> same slots
    selected = torch.zeros(m.size, dtype=torch.bool)
    selected[idx.reshape(-1)] = True
    assert torch.equal(torch.unique(grad.coalesce().indices()[0]), selected.nonzero().squeeze(1))
    opt.clip_grad_norm(0.0)
    opt.step()
    changed = (m.values.weight.detach() != before).any(-1)
    assert torch.equal(changed, selected), "exactly the read rows move"
    assert 0 < int(selected.sum()) < m.size
    # SparseAdam-style first step: each touched row moves by ~values_lr per coordinate
    step = (m.values.weight.detach() - before)[selected].abs()
    torch.testing.assert_close(step.max(), torch.tensor(1e-2), rtol=1e-3, atol=1e-4)
    # and the values group runs at --pkm-values-lr, the rest at --lr (both follow set_lr)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == [1e-3, 1e-2]
    opt.set_lr(5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, pytest.approx(5e-3)]
    assert opt.get_lr() == 5e-4


def test_sparse_and_dense_value_updates_agree_on_a_step():
    """One sparse step equals the dense Adam step (untouched rows have zero gradient and zero
    moments, so dense Adam leaves them too). Later steps differ on purpose: like SparseAdam, the
    sparse update is lazy -- a row not read in this batch keeps its moments and does not move."""
    x = torch.randn(5, 2, 16)
    weights, moved = [], []
    for sparse in (True, False):
        m = _memory(sparse=sparse, seed=3).train()
        opt = _pkm_adam(m)
        before = m.values.weight.detach().clone()
        m(x).square().sum().backward()
        opt.step()
        weights.append(m.values.weight.detach())
        moved.append((weights[-1] != before).any(-1))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(moved[0], moved[1])


def test_multiply_grads_scales_sparse_gradients():
    """fairseq divides the summed loss's gradients by the sample size with multiply_grads; its own
    implementation (p.grad.data.mul_) leaves sparse gradients unchanged."""
    m = _memory(sparse=True).train()
    opt = _pkm_adam(m)
    m(torch.randn(6, 2, 16)).square().sum().backward()
    before = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
              for n, p in m.named_parameters()}
    opt.multiply_grads(torch.tensor(0.25))
    for n, p in m.named_parameters():
        after = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(after, before[n] * 0.25)


def test_clip_grad_norm_handles_sparse_gradients():
    """Norms over coalesced sparse gradients; the values are clipped separately from the rest
    (both references), each set to the threshold; the returned (logged) norm is over all."""
    m = _memory(sparse=True).train()
    opt = _pkm_adam(m)
    m(torch.randn(6, 2, 16)).square().sum().backward()
    m(torch.randn(6, 2, 16)).square().sum().backward()  # accumulated (--update-freq 2): duplicates
    assert not m.values.weight.grad.is_coalesced()
    names = [n for n, _ in m.named_parameters()]
    dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for p in m.parameters()]
    norm = lambda gs: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))  # noqa: E731
    ref = norm(dense)
    ref_values = norm([g for n, g in zip(names, dense) if n == "values.weight"])
    ref_model = norm([g for n, g in zip(names, dense) if n != "values.weight"])
    limit = min(ref_values, ref_model).item() / 4
    total = opt.clip_grad_norm(limit)
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6)
    clipped = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in m.parameters()]
    for n, a, b in zip(names, clipped, dense):
        own = ref_values if n == "values.weight" else ref_model
        torch.testing.assert_close(a, b * limit / own, rtol=1e-4, atol=1e-7)


def _grads(m, x, value_scale=1.0):
    m.zero_grad()
    m(x).square().sum().backward()
    m.values.weight.grad.mul_(value_scale)
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_value_gradients_are_clipped_separately():
    """--pkm-values-clip-norm: huge value gradients do not shrink the rest (a joint norm would),
    the values get their own threshold, and 0 leaves them unclipped."""
    x = torch.randn(5, 2, 16)
    m = _memory(sparse=False).train()
    for values_clip, expect_values in ((-1, 1.0), (0.5, 0.5), (0, None)):
        opt = PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_clip_norm=values_clip),
                      list(m.parameters()))
        before = _grads(m, x, value_scale=1e4)
        opt.clip_grad_norm(1.0)
        model_norm = torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(g) for n, g in before.items() if n != "values.weight"]))
        for n, p in m.named_parameters():
            if n == "values.weight":
                got = torch.linalg.vector_norm(p.grad)
                want = (torch.linalg.vector_norm(before[n]) if expect_values is None
                        else torch.tensor(expect_values))
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            else:  # clipped by the model's own norm only
                torch.testing.assert_close(p.grad, before[n] * min(1.0, 1.0 / model_norm.item()),
                                           rtol=1e-4, atol=1e-7)


def test_value_lr_constant_or_following_the_schedule():
    m = _memory()
    follow = _pkm_adam(m, values_lr=1e-2, lr=1e-3)
    const = PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_lr=1e-2,
                                  pkm_values_lr_schedule="constant"), list(m.parameters()))
    for opt in (follow, const):
        opt.set_lr(2e-4)  # e.g. warmup
    assert [g["lr"] for g in follow.param_groups] == [2e-4, pytest.approx(2e-3)]
    assert [g["lr"] for g in const.param_groups] == [2e-4, 1e-2]  # XLM: constant 1e-3-style
    state = const.state_dict()
    again = PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_lr=1e-2,
                                  pkm_values_lr_schedule="constant"), list(m.parameters()))
    again.load_state_dict(state)
    again.set_lr(5e-5)
    assert [g["lr"] for g in again.param_groups] == [5e-5, 1e-2]


def test_value_weight_decay_and_betas():
    """--pkm-values-weight-decay: decoupled decay of the values (facebookresearch/memory's AdamW
    decays them with the rest); --pkm-values-betas: their own betas (XLM's value Adam)."""
    m = _memory(sparse=False)
    opt = PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_lr=1e-2, pkm_values_weight_decay=0.1,
                                weight_decay=0.0, pkm_values_betas="(0.9, 0.95)"),
                  list(m.parameters()))
    group = opt.param_groups[1]
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.95)
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    before = m.values.weight.detach().clone()
    opt.step()  # zero gradient: only the decay moves the values, by lr·wd·v
    torch.testing.assert_close(m.values.weight.detach(), before * (1 - 1e-2 * 0.1))
    for bad, match in ((dict(pkm_values_betas="0.9"), "--pkm-values-betas"),
                       (dict(pkm_values_lr_schedule="cosine"), "--pkm-values-lr-schedule"),
                       (dict(pkm_values_clip_norm=-2.0), "--pkm-values-clip-norm"),
                       (dict(pkm_values_weight_decay=-1.0), "--pkm-values-weight-decay")):
        with pytest.raises(ValueError, match=match) as e:
            PKMAdam(PKMAdamConfig(lr=[1e-3], **bad), list(m.parameters()))
        assert "\n" not in str(e.value)


#: the two published value-optimiser recipes as pkm_adam flags (docs/pkm.md)
XLM_RECIPE = ["--pkm-values-lr", "1e-3", "--pkm-values-lr-schedule", "constant",
              "--pkm-values-betas", "(0.9, 0.999)", "--pkm-values-weight-decay", "0"]
MEMPLUS_RECIPE = ["--adam-betas", "(0.9, 0.95)", "--weight-decay", "0.1", "--pkm-values-lr",
                  "1e-3", "--pkm-values-lr-schedule", "follow", "--pkm-values-weight-decay", "0.1",
                  "--pkm-sparse", "false"]


@pytest.mark.parametrize("arch,recipe", [("transformer_lm_pkm", XLM_RECIPE),
                                         ("transformer_lm_memplus", MEMPLUS_RECIPE)])
def test_published_value_recipes_run_through_fairseq_train(arch, recipe, lm_data, tmp_path):
    from zoo_testlib import run_cli, tiny_flags

    log = run_cli("train", tiny_flags(arch, lm_data) + recipe + [
        "--optimizer", "pkm_adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "2", "--clip-norm", "1.0", "--max-tokens", "400", "--max-update", "3",
        "--no-save", "--disable-validation", "--log-interval", "1", "--log-format", "json",
        "--num-workers", "0", "--seed", "1", "--save-dir", str(tmp_path)])
    assert any("pkm_values_gnorm" in line for line in log), "separate value clip not logged"
    assert any('"num_updates": "3"' in line for line in log)


def test_dense_mode_trains_under_pkm_adam():
    torch.manual_seed(0)
    m = _memory(sparse=False).train()
    opt = _pkm_adam(m, values_lr=1e-2, lr=1e-2)
    x = torch.randn(8, 4, 16)
    target = torch.randn(8, 4, 16)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (m(x) - target).square().mean()
        loss.backward()
        assert not m.values.weight.grad.is_sparse
        opt.clip_grad_norm(1.0)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    # state survives a round trip (checkpoints)
    state = opt.state_dict()
    opt2 = _pkm_adam(m, values_lr=1e-2, lr=1e-2)
    opt2.load_state_dict(state)
    assert opt2.param_groups[1]["weight_decay"] == 0.0
    assert opt2.param_groups[1]["lr_scale"] == pytest.approx(1.0)


def test_pkm_adam_refuses_flattened_fp16_buffers():
    flat = {0: torch.nn.Parameter(torch.zeros(10))}  # what FP16Optimizer passes when flattening
    with pytest.raises(ValueError, match="--fp16-no-flatten-grads"):
        PKMAdam(PKMAdamConfig(lr=[1e-3]), [flat])


# ---- refused combinations and flag errors -------------------------------------------------------

def _ns(**kw):
    base = dict(pkm_sparse="auto", optimizer="adam", distributed_world_size=1)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,expected", [
    (dict(), False),  # --optimizer adam: dense, so every fairseq optimizer works
    (dict(optimizer="pkm_adam"), True),
    # multi-process: pkm_adam exchanges the rows read (test_ddp.py checks it end to end)
    (dict(optimizer="pkm_adam", distributed_world_size=2), True),
    (dict(optimizer="pkm_adam", distributed_world_size=2, ddp_backend="legacy_ddp"), True),
    (dict(optimizer="pkm_adam", distributed_world_size=2, ddp_backend="fully_sharded"), False),
    (dict(optimizer="pkm_adam", distributed_world_size=2, use_bmuf=True), False),
    (dict(optimizer="pkm_adam", fp16=True), False),
    (dict(optimizer="pkm_adam", pkm_sparse="false"), False),
    (dict(optimizer="pkm_adam", pkm_sparse="true"), True),
])
def test_auto_sparse_resolution(kw, expected):
    assert sparse_values(_ns(**kw)) is expected


@pytest.mark.parametrize("kw,match", [
    (dict(optimizer="adam"), "use --optimizer pkm_adam, or --pkm-sparse false"),
    (dict(optimizer="pkm_adam", distributed_world_size=2, ddp_backend="fully_sharded"),
     "--ddp-backend fully_sharded.*--pkm-sparse false"),
    (dict(optimizer="pkm_adam", distributed_world_size=2, ddp_backend="slowmo"),
     "--ddp-backend slowmo.*--pkm-sparse false"),
    (dict(optimizer="pkm_adam", distributed_world_size=2, use_bmuf=True),
     "--use-bmuf.*--pkm-sparse false"),
    (dict(optimizer="pkm_adam", fp16=True), "--fp16.*--pkm-sparse false"),
    (dict(optimizer="pkm_adam", amp=True), "--amp.*--pkm-sparse false"),
])
def test_refused_sparse_combinations_fail_with_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        sparse_values(_ns(pkm_sparse="true", **kw))
    assert "\n" not in str(e.value)


def _args(arch, extra=()):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["/nonexistent-data", "--user-dir", USER_DIR, "--arch", arch] + list(extra))


def _spec(args):
    return SublayerSpec(slot="ffn", side="decoder", layer_idx=1, num_layers=2, embed_dim=32,
                        num_heads=4, ffn_dim=64, attention_dropout=0.0, activation_dropout=0.0,
                        causal=True, kdim=32, args=args)


def test_sparse_true_with_stock_adam_is_refused_through_fairseq_flags():
    args = _args("transformer_lm_pkm", ["--task", "language_modeling", "--optimizer", "adam",
                                        "--pkm-sparse", "true", "--pkm-n-keys", "8", "--pkm-knn",
                                        "4", "--pkm-k-dim", "16"])
    with pytest.raises(ValueError, match="--optimizer adam") as e:
        build_sublayer("pkm", _spec(args))
    assert "\n" not in str(e.value)
    args = _args("transformer_lm_pkm", ["--task", "language_modeling", "--optimizer", "pkm_adam",
                                        "--pkm-n-keys", "8", "--pkm-knn", "4", "--pkm-k-dim", "16"])
    assert build_sublayer("pkm", _spec(args)).sparse  # auto: sparse with pkm_adam, one process


@pytest.mark.parametrize("extra,match", [
    (["--pkm-knn", "9", "--pkm-n-keys", "8"], "--pkm-knn .9. cannot exceed --pkm-n-keys .8."),
    (["--pkm-k-dim", "15"], "--pkm-k-dim must be even"),
    (["--pkm-heads", "0"], "--pkm-heads must be a positive integer"),
    (["--pkm-value-dropout", "1.5"], "--pkm-value-dropout must be in"),
])
def test_bad_memory_flags_fail_at_build(extra, match):
    args = _args("transformer_lm_pkm", ["--task", "language_modeling"] + extra)
    with pytest.raises(ValueError, match=match):
        build_sublayer("pkm", _spec(args))


def test_layer_selection():
    args = _args("transformer_pkm", ["--task", "translation"])
    assert args.encoder_ffn == "ffn,ffn,ffn,pkm,ffn,ffn"  # middle of 6: index 3
    assert args.decoder_ffn == "ffn,ffn,ffn,pkm,ffn,ffn"
    args = _args("transformer_pkm", ["--task", "translation", "--pkm-encoder-layers", "none",
                                     "--pkm-decoder-layers", "1,4", "--decoder-layers", "5"])
    assert args.encoder_ffn == "ffn,ffn,ffn,ffn,ffn,ffn"
    assert args.decoder_ffn == "ffn,pkm,ffn,ffn,pkm"
    args = _args("transformer_lm_pkm", ["--task", "language_modeling", "--decoder-layers", "2"])
    assert args.decoder_ffn == "ffn,pkm"
    with pytest.raises(ValueError, match="must be < 6"):
        _args("transformer_pkm", ["--task", "translation", "--pkm-decoder-layers", "6"])
    with pytest.raises(ValueError, match="disagree"):
        _args("transformer_pkm", ["--task", "translation", "--pkm-decoder-layers", "2",
                                  "--decoder-ffn", "pkm"])
    # fairseq applies the arch function again at build time (and to checkpoint args): idempotent
    from fairseq.models import ARCH_CONFIG_REGISTRY

    args = _args("transformer_pkm", ["--task", "translation", "--pkm-decoder-layers", "1,4"])
    ARCH_CONFIG_REGISTRY["transformer_pkm"](args)
    assert args.decoder_ffn == "ffn,pkm,ffn,ffn,pkm,ffn"
    assert memory_layers("middle", 12, "--x") == [6]


# ---- usage diagnostics --------------------------------------------------------------------------

def test_usage_and_kl():
    assert usage_stats(torch.ones(8)) == (1.0, pytest.approx(0.0))
    usage, kl = usage_stats(torch.tensor([4.0, 0, 0, 0]))
    assert usage == 0.25 and kl == pytest.approx(math.log(4))
    counts = slot_counts(torch.tensor([[0, 2], [2, 3]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]]), 5)
    assert counts.tolist() == [0.5, 0.0, 1.5, 0.0, 0.0]  # slot 3 got zero weight: unused


def test_usage_is_logged_during_validation_only():
    metrics.reset()
    m = _memory().eval()
    m.usage_callback = UsageLogger("pkm_dec1", m.size)
    x = torch.randn(4, 2, 16)
    m(x)  # outside validation: only the default aggregator is active -> nothing logged
    assert "pkm_dec1_usage" not in metrics.get_smoothed_values("default")
    with metrics.aggregate(new_root=True) as agg:  # how fairseq-train validates
        m(x)
        m(x)
    _, idx = m.lookup(m.query(x.reshape(-1, 16)))
    expected = torch.unique(idx).numel() / m.size
    assert agg.get_smoothed_value("pkm_dec1_usage") == pytest.approx(expected, abs=1e-4)
    assert agg.get_smoothed_value("pkm_dec1_kl") > 0


def test_pkm_adam_under_fp16_optimizer_without_flattening():
    """--fp16 --fp16-no-flatten-grads (the multi-GPU fp16 recipe): fairseq's FP16Optimizer makes
    fp32 copies of the parameters; the values keep their tag, so they keep their own lr."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    args = _args("transformer_lm_pkm", ["--task", "language_modeling", "--optimizer", "pkm_adam",
                                        "--pkm-values-lr", "0.01", "--lr", "0.001", "--fp16",
                                        "--fp16-no-flatten-grads"])
    assert sparse_values(args) is False  # auto: dense under --fp16
    cfg = convert_namespace_to_omegaconf(args)
    m = _memory(sparse=False).half()
    params = list(m.parameters())
    opt = FP16Optimizer.build_optimizer(cfg, params)
    inner = opt.fp32_optimizer
    assert isinstance(inner, PKMAdam)
    assert [g["lr"] for g in inner.param_groups] == [0.001, 0.01]
    assert inner.param_groups[1]["params"][0].shape == m.values.weight.shape
    opt.backward(sum(p.float().sum() for p in params))  # every gradient = 1 (loss-scaled)
    before = m.values.weight.detach().float().clone()
    opt.step()
    moved = (m.values.weight.detach().float() - before).abs().max().item()
    assert moved == pytest.approx(0.01, rel=1e-2)  # first Adam step = values lr


# ---- Memory+ (Berges et al., 2024): shared pool, gated output, qk-norm ---------------------------

def _explicit_read(m, x):
    """m(x) by brute force over all n_keys² product keys (the module's own search is not used)."""
    q = m.query(x)  # [H, N, k_dim]
    half = m.k_dim // 2
    k1, k2 = m.keys[:, 0], m.keys[:, 1]
    if m.qk_norm:
        k1, k2 = k1 / k1.norm(dim=-1, keepdim=True), k2 / k2.norm(dim=-1, keepdim=True)
    keys = torch.cat([k1.unsqueeze(2).expand(-1, -1, m.n_keys, -1),
                      k2.unsqueeze(1).expand(-1, m.n_keys, -1, -1)], -1)
    full = torch.einsum("hnd,hkd->hnk", q, keys.reshape(m.heads, -1, 2 * half))
    s, i = full.topk(m.knn, -1)
    return torch.einsum("hnk,hnkd->nd", torch.softmax(s, -1), m.values.weight[i])


def test_legacy_gated_output_equals_its_formula():
    """The pre-issue-23 form (``gated=True``, checkpoints storing --pkm-gated-output true):
    out = W₂(m(x) ⊙ SiLU(W₁ x)), with m(x) the plain memory read and no biases."""
    m = _memory(bn=False, gated=True, v_dim=12).eval()
    assert m.swilu == "legacy"
    assert m.out_proj is None and m.gate_proj.bias is None and m.gate_out.bias is None
    x = torch.randn(5, 2, 16)
    flat = x.reshape(-1, 16)
    w1, w2 = m.gate_proj.weight, m.gate_out.weight  # [v_dim, d], [d, v_dim]
    ref = (_explicit_read(m, flat) * torch.nn.functional.silu(flat @ w1.t())) @ w2.t()
    torch.testing.assert_close(m(x).reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)


def test_swilu_output_is_the_reference_form():
    """--pkm-swilu-output (facebookresearch/memory's swilu_projection): W₁, W₂ with biases and
    N(0, d_out^-½) weights; the gate reads the input AFTER input dropout; value dropout acts on the
    output of W₂ -- out = Drop_v(W₂(m(x̃) ⊙ SiLU(W₁ x̃) ) + b₂), x̃ = Drop_in(x)."""
    torch.manual_seed(0)
    m = ProductKeyMemory(64, 64, n_keys=12, heads=2, knn=5, k_dim=8, v_dim=48,
                         query_batchnorm=False, swilu="reference", input_dropout=0.3,
                         value_dropout=0.2)
    assert m.gate_proj.bias is not None and m.gate_out.bias is not None
    for lin in (m.gate_proj, m.gate_out):  # N(0, 64^-½): std 0.125 over 3,072 weights
        assert abs(lin.weight.std().item() - 0.125) < 0.01 and abs(lin.weight.mean()) < 0.01
    x = torch.randn(5, 2, 64)
    flat = x.reshape(-1, 64)
    w1, b1, w2, b2 = m.gate_proj.weight, m.gate_proj.bias, m.gate_out.weight, m.gate_out.bias
    m.eval()
    ref = (_explicit_read(m, flat) * F.silu(flat @ w1.t() + b1)) @ w2.t() + b2
    torch.testing.assert_close(m(x).reshape(-1, 64), ref, rtol=1e-5, atol=1e-5)
    m.train()  # the same two dropout draws, in the reference's order
    torch.manual_seed(7)
    out = m(x).reshape(-1, 64)
    torch.manual_seed(7)
    xd = F.dropout(flat, 0.3, True)  # 1st draw: the input, shared by the query and the gate
    read = _explicit_read(m.eval(), xd)  # (eval: no second input dropout inside the query)
    ref = F.dropout((read * F.silu(xd @ w1.t() + b1)) @ w2.t() + b2, 0.2, True)  # 2nd: output
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_memplus_init_is_the_references():
    """--pkm-init memplus: sub-keys uniform(±1/√k_dim), Xavier-uniform query weight (XLM's init:
    ±1/√(k_dim/2), nn.Linear's)."""
    torch.manual_seed(0)
    kw = dict(n_keys=64, heads=2, knn=4, k_dim=32, query_batchnorm=False)
    xlm = ProductKeyMemory(64, 64, **kw)
    ours = ProductKeyMemory(64, 64, init="memplus", **kw)
    assert xlm.keys.abs().max() <= 1 / math.sqrt(16) and xlm.keys.abs().max() > 0.9 / math.sqrt(16)
    assert ours.keys.abs().max() <= 1 / math.sqrt(32) and ours.keys.abs().max() > 0.9 / math.sqrt(32)
    bound = math.sqrt(6 / (64 + 2 * 32))  # Xavier-uniform bound of the [H·k_dim, d] weight
    assert bound * 0.9 < ours.query_proj.weight.abs().max() <= bound
    assert xlm.query_proj.weight.abs().max() <= 1 / math.sqrt(64)


def test_qk_norm_search_uses_normalised_queries_and_keys():
    m = _memory(bn=False, qk_norm=True).eval()
    with torch.no_grad():
        m.query_gain.uniform_(0.5, 2.0)
    x = torch.randn(7, 16)
    # query side: each half-query is g ⊙ q / rms(q) (rms with eps 1e-6 under the root)
    raw = m.query_proj(x).view(7, m.heads, 2, m.k_dim // 2)
    ref_q = raw / (raw.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    ref_q = (ref_q.reshape(7, -1) * m.query_gain).view(7, m.heads, m.k_dim).transpose(0, 1)
    torch.testing.assert_close(m.query(x), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.read(x), _explicit_read(m, x), rtol=1e-5, atol=1e-5)
    # scale-free: rescaling the query net or a sub-key changes nothing
    before = m.read(x)
    with torch.no_grad():
        m.query_proj.weight.mul_(3.0)
        m.query_proj.bias.mul_(3.0)
        m.keys[0, 1, 2].mul_(5.0)
    torch.testing.assert_close(m.read(x), before, rtol=1e-5, atol=1e-5)


def test_memplus_options_in_half_precision_follow_fp32():
    """qk-norm and the gate in fp16: the normalisation runs in fp32, so the half-precision memory
    (same weights) reads what the fp32 one reads, up to fp16 rounding."""
    import copy

    m = _memory(bn=False, qk_norm=True, gated=True).eval()
    with torch.no_grad():
        m.query_proj.weight.mul_(300.0)  # large raw queries: qk-norm takes them back to RMS 1
    x = torch.randn(4, 2, 16)
    ref = m(x)
    half = copy.deepcopy(m).half()
    out = half(x.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-3)


def test_two_memories_share_one_value_table_and_both_send_gradients():
    a = _memory(bn=False, sparse=True, seed=1)
    b = ProductKeyMemory(16, 16, n_keys=12, heads=3, knn=5, k_dim=8, query_batchnorm=False,
                         sparse=True, values=a.values)
    assert b.values is a.values and not b.owns_values
    assert "values.weight" not in dict(b.named_parameters())  # a reference, not a submodule
    model = torch.nn.ModuleList([a, b])
    tables = [p for p in model.parameters() if getattr(p, "param_group", None) == "pkm_values"]
    assert len(tables) == 1 and tables[0] is a.values.weight
    assert [k for k in model.state_dict() if "values" in k] == ["0.values.weight"]
    xa, xb = torch.randn(4, 2, 16), torch.randn(3, 2, 16)
    ups = torch.randn(4, 2, 16), torch.randn(3, 2, 16)
    grads = []
    for use in ((True, False), (False, True), (True, True)):
        model.zero_grad()
        loss = sum((m(x) * u).sum() for m, x, u, on in zip((a, b), (xa, xb), ups, use) if on)
        loss.backward()
        grads.append(a.values.weight.grad.to_dense())
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[2], grads[0] + grads[1])  # both layers' reads, one table
    rows = lambda g: set(g.abs().sum(-1).nonzero().squeeze(1).tolist())  # noqa: E731
    assert rows(grads[0]) - rows(grads[1]) and rows(grads[1]) - rows(grads[0])


def test_shared_table_must_match_the_memory_size():
    a = _memory()
    with pytest.raises(ValueError, match="shared PKM value table"):
        ProductKeyMemory(16, 16, n_keys=10, heads=3, knn=5, k_dim=8, values=a.values)


def test_memplus_preset_builds_one_pool_for_all_memory_layers(lm_data):
    """transformer_lm_memplus: memories in spread layers, one value parameter, every layer's
    reads reach it, and each model gets its own pool."""
    from zoo_testlib import build

    args, task, model, criterion = build("transformer_lm_memplus", lm_data,
                                         ["--optimizer", "pkm_adam", "--decoder-layers", "3"])
    assert args.decoder_ffn == "pkm,pkm,pkm"  # spread over 3 layers: 0, 1, 2
    assert (args.pkm_shared_values, args.pkm_swilu_output, args.pkm_qk_norm,
            args.pkm_query_batchnorm) == (True, True, False, False)
    mems = [m for m in model.modules() if isinstance(m, ProductKeyMemory)]
    assert len(mems) == 3 and all(m.values is mems[0].values for m in mems)
    assert all(m.swilu == "reference" and not m.qk_norm and m.query_bn is None and m.sparse
               for m in mems)
    tables = [n for n, p in model.named_parameters() if getattr(p, "param_group", None)]
    assert tables == ["decoder.layers.0.ffn.values.weight"]
    assert model._ddp_params_and_buffers_to_ignore == tables  # sparse: left to pkm_adam
    _, _, other, _ = build("transformer_lm_memplus", lm_data,
                           ["--optimizer", "pkm_adam", "--decoder-layers", "3"])
    other_mems = [m for m in other.modules() if isinstance(m, ProductKeyMemory)]
    assert other_mems[0].values is not mems[0].values

    inputs = {}
    for i, m in enumerate(mems):
        m.register_forward_hook(lambda mod, inp, out, i=i: inputs.__setitem__(i, inp[0]))
    tokens = torch.randint(4, len(task.dictionary), (2, 10))
    model.train()
    model(tokens)[0].square().sum().backward()
    grad = mems[0].values.weight.grad
    assert grad.is_sparse
    read = set(coalesced_rows(grad))
    for i, m in enumerate(mems):  # no batch norm: the same slots again
        _, idx = m.lookup(m.query(inputs[i].reshape(-1, inputs[i].size(-1))))
        assert set(idx.reshape(-1).tolist()) <= read, f"layer {i}'s reads got no gradient"
    assert set().union(*[set(m.lookup(m.query(inputs[i].reshape(-1, inputs[i].size(-1))))[1]
                             .reshape(-1).tolist()) for i, m in enumerate(mems)]) == read


def coalesced_rows(grad):
    return grad.coalesce().indices()[0].tolist()


def test_memplus_preset_is_the_memory_codes_configuration():
    """transformer_lm_memplus = Memory+ as facebookresearch/memory configures it
    (apps/main/configs/pkplus_373m_1024k.yaml and the HashingMemory defaults): 1024 half-keys,
    k_dim = d/2 (mem_k_dim 512 at dim 1024), value dim = d, 4 heads, k 32, three memory layers at
    4, 12, 20 of 24, one shared pool, the swilu output with biases, no qk-norm (ours, a separate
    flag), no batch norm; a model built from it has exactly that form (tiny sizes: d 32,
    n_keys 8)."""
    args = _args("transformer_lm_memplus", ["--task", "language_modeling", "--decoder-layers",
                                            "24", "--decoder-embed-dim", "1024"])
    assert (args.pkm_n_keys, args.pkm_k_dim, args.pkm_value_dim, args.pkm_heads,
            args.pkm_knn) == (1024, 512, 0, 4, 32)  # value dim 0 = d_model
    assert [i for i, s in enumerate(args.decoder_ffn.split(",")) if s == "pkm"] == [4, 12, 20]
    assert (args.pkm_shared_values, args.pkm_swilu_output, args.pkm_qk_norm,
            args.pkm_query_batchnorm, args.pkm_init) == (True, True, False, False, "memplus")
    args = _args("transformer_lm_memplus", ["--task", "language_modeling", "--decoder-embed-dim",
                                            "256"])
    assert args.pkm_k_dim == 128  # d/2 follows the model dim

    args = _args("transformer_lm_memplus", ["--task", "language_modeling", "--decoder-embed-dim",
                                            "32", "--pkm-n-keys", "8", "--pkm-knn", "4"])
    m = build_sublayer("pkm", _spec(args)).eval()
    assert (m.k_dim, m.v_dim, m.size, m.swilu, m.init) == (16, 32, 64, "reference", "memplus")
    assert m.gate_proj.bias is not None and m.gate_out.bias is not None and m.out_proj is None
    x = torch.randn(3, 2, 32)
    flat = x.reshape(-1, 32)
    g, o = m.gate_proj, m.gate_out
    ref = o(_explicit_read(m, flat) * F.silu(g(flat)))
    torch.testing.assert_close(m(x).reshape(-1, 32), ref, rtol=1e-5, atol=1e-5)


def test_deprecated_gated_output_flag_gives_the_old_form():
    """Checkpoints written before issue 23 store --pkm-gated-output; it still builds the old
    form (no biases), the preset does not turn the reference form on over it, and asking for
    both forms is refused in one line."""
    small = ["--task", "language_modeling", "--decoder-embed-dim", "32", "--pkm-n-keys", "8",
             "--pkm-knn", "4", "--pkm-k-dim", "16"]
    args = _args("transformer_lm_memplus", small + ["--pkm-gated-output"])
    m = build_sublayer("pkm", _spec(args))
    assert m.swilu == "legacy" and m.gate_proj.bias is None and m.gate_out.bias is None
    args = _args("transformer_lm_memplus", small + ["--no-pkm-gated-output"])  # off: the preset's
    assert build_sublayer("pkm", _spec(args)).swilu == "reference"
    args = _args("transformer_lm_pkm", small + ["--pkm-gated-output",
                                                "--pkm-swilu-output"])
    with pytest.raises(ValueError, match="--pkm-swilu-output") as e:
        build_sublayer("pkm", _spec(args))
    assert "\n" not in str(e.value)


def test_spread_layer_selection():
    assert memory_layers("spread", 24, "--x") == [4, 12, 20]  # the memory code's layers
    assert memory_layers("spread", 6, "--x") == [1, 3, 5]
    assert memory_layers("spread", 2, "--x") == [0, 1]
    assert memory_layers("spread:2", 12, "--x") == [3, 9]
    with pytest.raises(ValueError, match="spread:N"):
        memory_layers("spread:0", 6, "--x")
    args = _args("transformer_lm_memplus", ["--task", "language_modeling"])
    assert args.decoder_ffn == "ffn,pkm,ffn,pkm,ffn,pkm"


def test_pool_usage_is_logged_per_layer_and_for_the_pool():
    metrics.reset()
    a = _memory(bn=False).eval()
    b = ProductKeyMemory(16, 16, n_keys=12, heads=3, knn=5, k_dim=8, query_batchnorm=False,
                         values=a.values).eval()
    a.usage_callback = UsageLogger("pkm_dec0", a.size, "pkm_pool")
    b.usage_callback = UsageLogger("pkm_dec1", b.size, "pkm_pool")
    x = torch.randn(4, 2, 16)
    with metrics.aggregate(new_root=True) as agg:
        a(x)
        b(x)
    flat = x.reshape(-1, 16)
    ia, ib = a.lookup(a.query(flat))[1], b.lookup(b.query(flat))[1]
    get = agg.get_smoothed_value
    assert get("pkm_dec0_usage") == pytest.approx(torch.unique(ia).numel() / a.size, abs=1e-4)
    assert get("pkm_dec1_usage") == pytest.approx(torch.unique(ib).numel() / a.size, abs=1e-4)
    both = torch.unique(torch.cat([ia.reshape(-1), ib.reshape(-1)])).numel() / a.size
    assert get("pkm_pool_usage") == pytest.approx(both, abs=1e-4)
    assert get("pkm_pool_kl") > 0


def test_plot_script_reports_the_shared_pool(lm_data):
    from zoo_testlib import build

    from fairseq_attnzoo.cli import plot_pkm_usage as plot

    _, task, model, _ = build("transformer_lm_memplus", lm_data, ["--decoder-layers", "2"])
    counts, mems, tokens = plot.collect(model.eval(), task, "valid", 512, max_batches=2)
    assert sorted(counts) == ["decoder.layers.0.ffn", "decoder.layers.1.ffn"] and tokens > 0
    counts, mems = plot.add_pools(counts, mems)
    torch.testing.assert_close(counts["shared pool"], counts["decoder.layers.0.ffn"]
                               + counts["decoder.layers.1.ffn"])
    usage_pool = usage_stats(counts["shared pool"])[0]
    assert usage_pool >= max(usage_stats(counts[n])[0] for n in mems if n != "shared pool")


# ---- the memory in its host layer: residual dropout, the optimizer notice ----------------------

def _ffn_block_twice(layer, x):
    """The layer's FFN half (train mode) under two RNG seeds: equal iff nothing in it is random."""
    torch.manual_seed(1)
    a = layer._ffn_block(x, None)
    torch.manual_seed(2)
    return a, layer._ffn_block(x, None)


def test_memory_output_gets_no_residual_dropout_by_default(mt_data):
    """XLM adds the memory's output to the residual undropped (xlm/model/transformer.py drops
    only the FFN's), the memory code's Llama block has no dropout: a fresh transformer_pkm in
    train mode drops the FFN output (--dropout 0.5) but not the memory's, whose own dropouts are
    0, so the memory layer's FFN half is deterministic; --pkm-residual-dropout drops it again."""
    from zoo_testlib import build

    args, _, model, _ = build("transformer_pkm", mt_data, ["--dropout", "0.5"])
    model.train()
    x = torch.randn(5, 3, 32)
    for stack in (model.encoder, model.decoder):  # the memory is in layer 1 of 2, an FFN in 0
        ffn_layer, memory_layer = stack.layers
        assert isinstance(memory_layer.ffn, ProductKeyMemory) and ffn_layer.ffn is None
        a, b = _ffn_block_twice(memory_layer, x)
        assert torch.equal(a, b), "the memory output was dropped"
        a, b = _ffn_block_twice(ffn_layer, x)
        assert not torch.equal(a, b), "--dropout 0.5 should drop the FFN output"
        assert not memory_layer.ffn.residual_dropout
    assert args.pkm_residual_dropout is False

    args, _, model, _ = build("transformer_pkm", mt_data,
                              ["--dropout", "0.5", "--pkm-residual-dropout"])
    layer = model.encoder.layers[1].train()
    assert args.pkm_residual_dropout is True and layer.ffn.residual_dropout
    a, b = _ffn_block_twice(layer, x)
    assert not torch.equal(a, b)
    torch.manual_seed(3)  # exactly fairseq's dropout of the memory output, then the residual
    out = layer._ffn_block(x, None)
    torch.manual_seed(3)
    ref = layer.final_layer_norm(x + layer.dropout_module(layer.ffn(x, None)))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_stored_configs_without_the_residual_flag_keep_the_dropout():
    """A checkpoint's stored config written before --pkm-residual-dropout has every original
    PKM flag and no key for the new one: it comes back on (the dropout its model trained with).
    A new config keeps the default: on the command line the key exists unset, a hydra config
    does not give all the original flags."""
    from omegaconf import OmegaConf

    from fairseq_attnzoo.models.pkm import PKMConfig, _ORIGINAL_FLAGS

    stored = argparse.Namespace(**{k: 1 for k in _ORIGINAL_FLAGS})
    PKMConfig.upgrade_stored(stored)
    assert stored.pkm_residual_dropout is True
    for new in (argparse.Namespace(pkm_residual_dropout=None, **{k: 1 for k in _ORIGINAL_FLAGS}),
                OmegaConf.create({"pkm_n_keys": 512, "pkm_heads": 4, "pkm_knn": 32}),
                argparse.Namespace(pkm_residual_dropout=False, **{k: 1 for k in _ORIGINAL_FLAGS})):
        before = getattr(new, "pkm_residual_dropout", "absent")
        PKMConfig.upgrade_stored(new)
        assert getattr(new, "pkm_residual_dropout", "absent") == before
    args = _args("transformer_lm_pkm", ["--task", "language_modeling"])  # through the arch
    assert args.pkm_residual_dropout is False


def _notices(caplog, arch, data, extra, word="pkm_adam"):
    from zoo_testlib import build

    _, _, model, _ = build(arch, data, extra)
    tokens = torch.randint(4, 20, (2, 6))
    caplog.clear()
    with caplog.at_level("WARNING", logger="fairseq_attnzoo.models.pkm"):
        model.eval()
        model(tokens)  # evaluating: no notice
        model.train()
        model(tokens)
        model(tokens)
    return [r.getMessage() for r in caplog.records if word in r.getMessage()]


def test_one_warning_when_memory_values_train_without_their_own_rate(lm_data, caplog):
    """A model with memory layers trained by an optimizer that gives the values no rate of their
    own warns once, at its first training step, naming pkm_adam and its flags; pkm_adam and
    models without a memory stay quiet."""
    lines = _notices(caplog, "transformer_lm_memplus", lm_data, ["--optimizer", "adam"])
    assert len(lines) == 1 and "\n" not in lines[0], lines  # three memories, one line
    for flag in ("--optimizer adam", "--optimizer pkm_adam", "--pkm-values-lr",
                 "--pkm-values-lr-schedule", "--pkm-values-betas"):
        assert flag in lines[0]
    assert _notices(caplog, "transformer_lm_pkm", lm_data, ["--optimizer", "adagrad"])
    assert _notices(caplog, "transformer_lm_pkm", lm_data, ["--optimizer", "pkm_adam"]) == []
    assert _notices(caplog, "attnzoo_lm", lm_data, ["--optimizer", "adam"]) == []


def test_one_warning_when_memplus_llama_values_depart_from_the_reference_lr_ratio(lm_data, caplog):
    """transformer_lm_memplus_llama trained by pkm_adam at a value-lr ratio other than the
    reference's 10 (pkplus_373m_1024k.yaml: 1e-3 against 1e-4) warns once, naming the ratio it
    runs at and --pkm-values-lr-ratio 10; at 10 (as a ratio, or as --pkm-values-lr 10 × --lr) and
    under the other presets it stays quiet."""
    opt = ["--optimizer", "pkm_adam", "--lr", "2e-3"]
    lines = _notices(caplog, "transformer_lm_memplus_llama", lm_data, opt, word="ratio")
    assert len(lines) == 1 and "\n" not in lines[0], lines  # three memories, one line
    assert "0.5x --lr" in lines[0] and "--pkm-values-lr-ratio 10" in lines[0], lines
    for ten in (["--pkm-values-lr-ratio", "10"], ["--pkm-values-lr", "2e-2"]):
        assert _notices(caplog, "transformer_lm_memplus_llama", lm_data, opt + ten,
                        word="ratio") == []
    assert _notices(caplog, "transformer_lm_memplus", lm_data, opt, word="ratio") == []


def test_value_lr_ratio_scales_with_the_model_lr():
    """--pkm-values-lr-ratio R: the values peak at R × --lr, follow the schedule, and survive a
    state dict round trip; a negative ratio is one line (so is a ratio with --pkm-values-lr:
    tests/test_pkm_adam_rates.py)."""
    m = _memory()
    cfg = dict(lr=[3e-4], pkm_values_lr_ratio=10.0)
    opt = PKMAdam(PKMAdamConfig(**cfg), list(m.parameters()))
    assert [g["lr"] for g in opt.param_groups] == [3e-4, pytest.approx(3e-3)]
    opt.set_lr(1e-4)  # e.g. warmup
    assert [g["lr"] for g in opt.param_groups] == [1e-4, pytest.approx(1e-3)]
    const = PKMAdam(PKMAdamConfig(**cfg, pkm_values_lr_schedule="constant"), list(m.parameters()))
    const.set_lr(1e-4)
    assert [g["lr"] for g in const.param_groups] == [1e-4, pytest.approx(3e-3)]
    again = PKMAdam(PKMAdamConfig(**cfg), list(m.parameters()))
    again.load_state_dict(opt.state_dict())
    again.set_lr(2e-4)
    assert [g["lr"] for g in again.param_groups] == [2e-4, pytest.approx(2e-3)]
    with pytest.raises(ValueError, match="--pkm-values-lr-ratio") as e:
        PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_lr_ratio=-1.0), list(m.parameters()))
    assert "\n" not in str(e.value)


# ---- reduced precision: fp16 against bf16 -------------------------------------------------------

def test_fp16_reads_the_fp32_slots_more_often_than_bf16(mt_data):
    """A whole-model cast of a tiny transformer_pkm (d 32, 2+2 layers, the sweep's padded batch,
    eval mode) changes a memory's top-k only where two product-key scores lie closer than the
    rounding of the memory's input: one of k reads swaps, which sets the largest log-prob
    difference from fp32 when it happens. Over six seeded models, fp16 (11 significant bits) must
    swap at most half as many (token, head) slot sets as bf16 (8 bits) in the first memory (the
    later one also sees the earlier one's swaps), and its median largest difference must stay at
    the model's rounding (measured 0.0035-0.0039 without a swap, bf16 0.12-0.21)."""
    import copy
    import statistics

    from zoo_testlib import build, sweep_batch

    flips = {torch.float16: 0, torch.bfloat16: 0}
    worst = {torch.float16: [], torch.bfloat16: []}
    for seed in range(6):
        args, task, model, _ = build("transformer_pkm", mt_data, seed=seed)
        net = sweep_batch(task, args)["net_input"]
        runs = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            m = copy.deepcopy(model).to(dtype).eval()
            memory = m.encoder.layers[1].ffn
            sets = []
            memory.usage_callback = lambda idx, w, sets=sets, h=memory.heads: sets.append(
                idx.view(idx.size(0), h, -1).sort(-1)[0])
            with torch.no_grad():
                runs[dtype] = (torch.log_softmax(m(**net)[0].float(), -1), sets[0])
        ref, ref_sets = runs.pop(torch.float32)
        for dtype, (logp, sets) in runs.items():
            flips[dtype] += int((sets != ref_sets).any(-1).sum())
            worst[dtype].append(float((logp - ref).abs().max()))
    assert 2 * flips[torch.float16] <= flips[torch.bfloat16], flips
    medians = {str(d): statistics.median(v) for d, v in worst.items()}
    assert medians["torch.float16"] <= 0.01, medians
    assert medians["torch.float16"] <= medians["torch.bfloat16"], medians


def test_host_syncs_are_counted_as_they_would_be_on_cuda():
    """tests/syncs_testlib.py: what would make the host wait for a GPU, counted on the CPU: a
    device value read back, an output sized by the data, boolean-mask indexing. Reading a tensor
    that would stay on the host there (a shape, ``torch.tensor(...)``) is no sync."""
    import torch

    from syncs_testlib import syncs

    x = torch.randn(5, 3)

    def run():
        bool(x.sum() > 0)
        x[x > 0]
        (x > 0).nonzero()
        torch.bincount(torch.tensor([1, 2]).to(x.device) * (x[0, 0] > 0).long())
        x.repeat_interleave(2, dim=0)
        shape = torch._shape_as_tensor(x)
        int(shape[0]) + int(torch.tensor(3)) + int(torch.tensor(3) * 2)
        x.view(int(shape[0]), -1).argmax().item()

    assert syncs(run) == ["_local_scalar_dense", "index", "nonzero", "bincount",
                          "_local_scalar_dense"]

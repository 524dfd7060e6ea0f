"""The product-key search in half precision (issue 62, item 1): queries and sub-keys enter the
search in the model's dtype (bf16/fp16 under --bf16/--fp16/--amp; ``--pkm-search-dtype float32``
keeps float32), the scores are summed in float32 and the top-k, candidate sums and softmax are
float32 (modules/pkm_search.py, ``_ProductTopk`` and the fused kernel of pkm_search_triton.py).

* ``half_search``: the slots and weights against a float64 search on fixed inputs, beside the
  two references' half-precision formulations computed here (Memory+'s bf16 scores, XLM's fp16
  scores); the backward; what "the model's dtype" is (a cast model, autocast, fp32); incremental
  decoding == the full pass for every memory arch in half precision, on both search paths.
* ``batch_invariant``: a token searched alone and inside a batch of 200 gets the same slots and
  bit-equal weights: on the fused kernel (Triton's interpreter here) in every dtype; on the
  PyTorch path wherever the score GEMM is (the stages after it work row by row).

Without a GPU the fused kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
tests/conftest.py)."""

import functools

import pytest
import torch

from fairseq_attnzoo.modules import pkm_search_triton, pkm_triton
from fairseq_attnzoo.modules.pkm import ProductKeyMemory, product_topk
from fairseq_attnzoo.modules.pkm_search import _ProductTopk

from test_pkm_triton import DEVICE, DTYPES  # (the kernel tests' device and dtypes)

HALF = [torch.bfloat16, torch.float16]
needs_triton = pytest.mark.skipif(not pkm_triton.HAS_TRITON,
                                  reason="Triton is not installed (make install adds it)")


# ---- (a) slots and weights against float64, beside the references' formulations --------------

#: the paper shape's search (XLM: n_keys 512, 4 heads, knn 32, k_dim 256) on 2,048 tokens: 8,192
#: (token, head) rows
SHAPE = dict(tokens=2048, heads=4, n_keys=512, knn=32, k_dim=256)


def _reference_formulation(q, keys, knn, dtype):
    """The search as both references write it, in ``dtype``: each half's scores by a matmul
    whose output is ``dtype`` (facebookresearch/memory: einsum in bf16 under FSDP's mixed
    precision; XLM: fp16 under apex), their top-k in ``dtype``, all knn² candidate sums in
    ``dtype`` and their top-k, then the softmax in float32 (XLM's ``F.softmax(scores.float())``).
    In float64 this is the exact search. Returns weights (float64) and slots, [H, N, knn]."""
    n_keys, half = keys.size(2), keys.size(3)
    scores = [torch.einsum("hnd,hkd->hnk", q[..., i * half:(i + 1) * half].to(dtype),
                           keys[:, i].to(dtype)) for i in range(2)]
    (s1, i1), (s2, i2) = (s.topk(knn, -1) for s in scores)
    best, j = (s1.unsqueeze(-1) + s2.unsqueeze(-2)).flatten(-2).topk(knn, -1)
    slots = i1.gather(-1, j // knn) * n_keys + i2.gather(-1, j % knn)
    return torch.softmax(best.to(torch.float64 if dtype == torch.float64 else torch.float32),
                         -1).double(), slots


def _against(ref, got):
    """(share of rows whose slot set differs, mean total-variation distance of the read
    weights) between two searches' (weights, slots) [H, N, knn]: TV = ½ Σ_slot |w_ref − w| over
    the union of both rows' slots."""
    (w0, s0), (w1, s1) = ((w.reshape(-1, w.size(-1)), s.reshape(-1, s.size(-1)).long())
                          for w, s in (ref, got))
    changed = (s0.sort(-1).values != s1.sort(-1).values).any(-1).double().mean().item()
    slots, order = torch.cat([s0, s1], -1).sort(-1)
    w = torch.cat([w0, -w1], -1).gather(-1, order)  # a slot is at most twice: once in each
    a, b = w[:, :-1], w[:, 1:]
    merged = torch.where(slots[:, 1:] == slots[:, :-1], a.abs() + b.abs() - (a + b).abs(), 0.0)
    return changed, (0.5 * (w.abs().sum(-1) - merged.sum(-1))).mean().item()


@functools.lru_cache(maxsize=None)
def search_numerics():
    """{formulation: (share of rows with another slot set, mean TV distance)} against the exact
    (float64) search, on fixed inputs: batch-norm-like queries N(0, 1), XLM's sub-key init
    (the layer's own, seed 0). Ours is :meth:`ProductKeyMemory.lookup` (the PyTorch path, the
    CPU's) with its inputs in float32, bfloat16 and float16."""
    p = SHAPE
    torch.manual_seed(0)
    m = ProductKeyMemory(8, 8, n_keys=p["n_keys"], heads=p["heads"], knn=p["knn"],
                         k_dim=p["k_dim"], kernel="torch", search_kernel="torch")
    g = torch.Generator().manual_seed(62)
    q = torch.randn(p["heads"], p["tokens"], p["k_dim"], generator=g)
    keys = m.keys.detach()
    exact = _reference_formulation(q.double(), keys.double(), p["knn"], torch.float64)
    out = {}
    with torch.no_grad():
        for name, dtype in (("float32 inputs", torch.float32), ("bfloat16 inputs", torch.bfloat16),
                            ("float16 inputs", torch.float16)):
            w, slots = m.lookup(q.to(dtype))
            out[name] = _against(exact, (w.view(p["tokens"], p["heads"], -1).transpose(0, 1),
                                         slots.view(p["tokens"], p["heads"], -1).transpose(0, 1)))
    out["Memory+ bfloat16 scores"] = _against(exact, _reference_formulation(q, keys, p["knn"],
                                                                            torch.bfloat16))
    out["XLM float16 scores"] = _against(exact, _reference_formulation(q, keys, p["knn"],
                                                                       torch.float16))
    return out


@pytest.mark.parametrize("dtype,reference", [(torch.bfloat16, "Memory+ bfloat16 scores"),
                                             (torch.float16, "XLM float16 scores")], ids=str)
def test_half_search_is_nearer_float64_than_the_references_half_scores(dtype, reference):
    """On 8,192 (token, head) rows at the paper's shape, half inputs with float32 sums change a
    slot in fewer rows, and move less read weight (mean TV distance), than the reference that
    searched in that dtype: bf16 against Memory+'s bf16 scores, fp16 against XLM's fp16 scores.
    float32 inputs are nearer than either half. (The numbers: docs/precision.md; ``-s`` prints
    them.)"""
    got = search_numerics()
    print("; ".join(f"{k}: {100 * c:.2f} % of rows, TV {100 * tv:.3f} %"
                    for k, (c, tv) in got.items()))
    ours = got["bfloat16 inputs" if dtype == torch.bfloat16 else "float16 inputs"]
    assert ours[0] <= got[reference][0] and ours[1] <= got[reference][1], got
    assert got["float32 inputs"][0] <= ours[0] and got["float32 inputs"][1] <= ours[1], got
    assert all(a <= b for a, b in zip(got["float16 inputs"], got["bfloat16 inputs"])), got


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_search_gradients_are_float32_math_on_the_rounded_inputs(dtype):
    """The search's backward in half precision: float32 sums of the rounded inputs, rounded once
    into the inputs' dtype -- equal (to that rounding) to float64 autograd through the explicit
    scores of all n_keys² product keys of the same rounded inputs; the scores are float32."""
    g = torch.Generator().manual_seed(7)
    h, n, half, n_keys, knn = 3, 40, 8, 12, 5
    leaves = [torch.randn(h, n, half, generator=g).to(dtype).requires_grad_() for _ in range(2)]
    leaves += [torch.randn(h, n_keys, half, generator=g).to(dtype).requires_grad_()
               for _ in range(2)]
    up = torch.randn(h, n, knn, generator=g)
    scores, idx = product_topk(*leaves, knn)
    assert scores.dtype == torch.float32
    ours = torch.autograd.grad((scores.softmax(-1) * up).sum(), leaves)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    q1, q2, k1, k2 = exact
    full = (torch.einsum("hnd,hkd->hnk", q1, k1).unsqueeze(-1)
            + torch.einsum("hnd,hkd->hnk", q2, k2).unsqueeze(-2)).reshape(h, n, -1)
    ref_scores, ref_idx = full.topk(knn, dim=-1)
    assert torch.equal(idx, ref_idx.int())
    torch.testing.assert_close(scores.double(), ref_scores, rtol=1e-6, atol=1e-6)
    ref = torch.autograd.grad((ref_scores.softmax(-1) * up.double()).sum(), exact)
    rounding = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]  # 2 half-ulps
    for a, b in zip(ours, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=rounding, atol=1e-6)


def _spy_search(monkeypatch):
    """The dtype of every search the layer starts, either path: its sub-keys' (the PyTorch path
    rounds a float32 query to it itself; the fused kernel is handed both in it)."""
    seen = []
    apply, fused = _ProductTopk.apply, pkm_search_triton.search

    def torch_path(query, keys, knn):
        seen.append(keys.dtype)
        return apply(query, keys, knn)

    def fused_path(query, keys, knn):
        assert query.dtype == keys.dtype
        seen.append(keys.dtype)
        return fused(query, keys, knn)

    monkeypatch.setattr(_ProductTopk, "apply", torch_path)
    monkeypatch.setattr(pkm_search_triton, "search", fused_path)
    return seen


@pytest.mark.parametrize("qk_norm", [False, True], ids=["batchnorm", "qk-norm"])
@pytest.mark.parametrize("how", ["cast bf16", "cast fp16", "autocast bf16", "autocast fp16",
                                 "fp32", "cast bf16, search float32"])
def test_half_search_runs_in_the_models_dtype(how, qk_norm, monkeypatch):
    """"The model's dtype" is the dtype the layer computes in: a model cast to bf16/fp16
    (``--bf16``/``--fp16``) searches in it; a float32 model under autocast (``--amp``) searches
    in autocast's dtype; fp32 training in float32; ``search_dtype="float32"`` in float32
    whatever the model's. The search's answer is that of the float32 normalisation (batch norm
    or qk-norm) and the sub-keys, each rounded once; the query's gradient reaches the
    normalisation in float32 and the layer's output is in its compute dtype."""
    seen = _spy_search(monkeypatch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(how.split(",")[0].split()[-1],
                                                               torch.float32)
    kw = dict(search_dtype="float32") if "search float32" in how else {}
    torch.manual_seed(0)
    m = ProductKeyMemory(16, 16, n_keys=12, heads=2, knn=4, k_dim=8, query_batchnorm=not qk_norm,
                         qk_norm=qk_norm, kernel="torch", **kw).to(DEVICE).eval()
    x = torch.randn(15, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if how.startswith("cast"):
        m, x = m.to(dtype), x.to(dtype)
    want = torch.float32 if how == "fp32" or kw else dtype
    with torch.autocast(DEVICE.type, dtype=dtype, enabled=how.startswith("autocast")):
        out = m(x.unsqueeze(1))
        assert m.search_dtype_for(x) == want and seen == [want], seen
        q = m.query(x).detach().requires_grad_()  # the float32 normalisation
        weights, slots = m.lookup(q, want)
    assert q.dtype == torch.float32 and out.dtype == (
        torch.float32 if how == "fp32" else dtype), (q.dtype, out.dtype)
    keys = m.keys.detach().float()
    keys = torch.nn.functional.normalize(keys, dim=-1, eps=1e-6) if qk_norm else keys
    assert torch.equal(m.sub_keys(want), keys.to(want))
    ref_scores, ref_slots = _ProductTopk.apply(q.detach().to(want), keys.to(want), 4)
    assert torch.equal(slots.view_as(ref_slots), ref_slots)
    assert torch.equal(weights.view_as(ref_scores), torch.softmax(ref_scores, -1))
    weights.sum().backward()
    assert q.grad.dtype == torch.float32


def test_half_search_dtype_flag_reaches_the_memory_and_a_bad_value_is_one_line(lm_data):
    """``--pkm-search-dtype`` (default model) reaches every memory of a fairseq model; a module
    given another value refuses it in one line naming the choices."""
    from zoo_testlib import build

    for flags, expected in (([], "model"), (["--pkm-search-dtype", "float32"], "float32")):
        model = build("transformer_lm_pkm", lm_data, flags)[2]
        assert {m.search_dtype for m in model.modules()
                if isinstance(m, ProductKeyMemory)} == {expected}
    with pytest.raises(ValueError, match=r"^PKM search_dtype must be one of model, float32, "
                                         r"got 'bf16'$"):
        ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, search_dtype="bf16")


# ---- (b) batch invariance -----------------------------------------------------------------------

#: a batch of 200 tokens and the positions searched alone (in the fused kernel's blocks of
#: BLOCK_N = 64 tokens, the last of 8: first, inside the third, at the first block's end, in the
#: ragged last block)
BATCH = 3 * pkm_search_triton.BLOCK_N + 8
ALONE = (0, 2 * pkm_search_triton.BLOCK_N + 9, pkm_search_triton.BLOCK_N - 1, BATCH - 1)


def _search_inputs(dtype, exact=False, heads=2, n_keys=32, k_dim=32):
    """Queries [H, BATCH, k_dim] (a view of [N, H, k_dim], as the layer hands them over) and
    sub-keys [H, 2, n_keys, k_dim/2] in ``dtype``. ``exact``: values k/128 with |k| <= 127
    (exact in bf16 and fp16), so that every product and every sum of the score GEMM is exact
    in float32, whatever the order of the sum."""
    g = torch.Generator().manual_seed(11)
    if exact:
        q = torch.randint(-127, 128, (BATCH, heads, k_dim), generator=g) / 128
        keys = torch.randint(-127, 128, (heads, 2, n_keys, k_dim // 2), generator=g) / 128
    else:
        q = torch.randn(BATCH, heads, k_dim, generator=g)
        keys = torch.rand(heads, 2, n_keys, k_dim // 2, generator=g) * 0.5 - 0.25
    return q.to(DEVICE, dtype).transpose(0, 1), keys.to(DEVICE, dtype)


def _alone_and_in_batch(search, q, keys, knn):
    """[(weights, slots) of token i in the batch, the same searched alone] for i in ALONE."""
    weights, slots = search(q, keys, knn)
    return [((weights[i], slots[i]), search(q[:, i:i + 1], keys, knn)) for i in ALONE]


def _torch_search(query, keys, knn):  # the layer's PyTorch path (lookup), token-major
    with torch.no_grad():
        scores, slots = _ProductTopk.apply(query, keys, knn)
        return torch.softmax(scores, -1), slots


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariant_fused_search(dtype):
    """The fused search reduces each token's scores in a fixed order (its blocks of sub-keys,
    the dims of a tl.dot step), so a token searched alone and inside a batch of 200 gets the
    same slots and bit-equal weights, in every input dtype."""
    q, keys = _search_inputs(dtype)
    for (w, s), (w1, s1) in _alone_and_in_batch(pkm_search_triton.search, q, keys, 4):
        assert torch.equal(s1[0], s) and torch.equal(w1[0], w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariant_pytorch_search(dtype):
    """The PyTorch path works row by row after its score GEMM (top-k, candidate sums, softmax):
    where the GEMM gives a token the same scores alone and in a batch, the slots are the same
    and the weights bit-equal, in every dtype -- shown on inputs whose GEMM is exact in any
    summation order. The GEMM itself is the library's: a BLAS or cuBLAS may sum a row in
    another order for another number of rows (MKL on this CPU does for 1-3 rows,
    docs/precision.md), so on other inputs a token alone gets its scores to float32 rounding:
    the same slots (but for near-ties) and weights equal to that rounding."""
    q, keys = _search_inputs(dtype, exact=True)
    for (w, s), (w1, s1) in _alone_and_in_batch(_torch_search, q, keys, 4):
        assert torch.equal(s1[0], s) and torch.equal(w1[0], w)
    q, keys = _search_inputs(dtype)
    for (w, s), (w1, s1) in _alone_and_in_batch(_torch_search, q, keys, 4):
        assert torch.equal(s1[0], s)
        torch.testing.assert_close(w1[0], w, rtol=1e-5, atol=1e-7)


# ---- (c) incremental decoding == the full pass in half precision --------------------------------

MEMORY_ARCHS = ["transformer_pkm", "transformer_lm_pkm", "transformer_lm_memplus",
                "transformer_lm_memplus_llama"]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "autocast_bf16"])
@pytest.mark.parametrize("arch, kernel", [(arch, "torch") for arch in MEMORY_ARCHS] + [
    pytest.param("transformer_pkm", "triton", marks=needs_triton)])
def test_half_search_incremental_decoding_equals_full(arch, precision, kernel, data_for,
                                                      monkeypatch):
    """Every memory arch in half precision, its search in the model's dtype (the PyTorch path;
    the fused kernel, interpreted here, in one arch: the search is the same in every arch, which
    differ in what reads its slots): decoding token by token gives the full pass's log-probs
    within the bound docs/precision.md states for a top-k memory (the sublayer's registered
    ``reduced_precision_step``: a near-tie can swap one of k reads)."""
    import copy

    from test_precision import PRECISIONS, STEP_TOL, _record

    from zoo_testlib import (build, decoder_inputs, incremental_vs_full, lm_extra, sweep_batch,
                             tolerance)

    seen = _spy_search(monkeypatch)
    model_dtype, autocast_dtype = PRECISIONS[precision]
    args, task, model, _ = build(arch, data_for(arch), lm_extra(arch) + [
        "--pkm-search-kernel", kernel])
    m = copy.deepcopy(model).to(DEVICE, model_dtype).eval()
    net = sweep_batch(task, args, split="valid")["net_input"]
    net = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in net.items()}
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=autocast_dtype or torch.bfloat16,
                                         enabled=autocast_dtype is not None):
        tokens, enc = decoder_inputs(m, arch, net)
        d = incremental_vs_full(m, tokens, enc, task.target_dictionary.pad(),
                                lambda x: torch.log_softmax(x.float(), -1))
    half = autocast_dtype or model_dtype
    assert seen and set(seen) == {half}, seen
    _record(f"{arch} {precision} half search {kernel} step {d:.5f}")
    bound = tolerance(args, "reduced_precision_step", STEP_TOL[precision])
    assert d <= bound, f"{arch} {precision} {kernel}: incremental vs full {d:.3g} > {bound}"

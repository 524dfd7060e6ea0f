"""The fused product-key search (modules/pkm_search_triton.py) against its PyTorch reference
(modules/pkm_search.py ``_ProductTopk``): the forward's top-k that filters before it sorts
(tests named ``topk_filter``), the sort-free backward (``sortfree``), the ``auto`` rule, the custom
ops (registered on first use) and the specialisations handed to the sm_90 spill check.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
by conftest); ``ATTNZOO_TEST_DEVICE=cuda`` runs the same tests on a GPU's compiled kernels."""

import logging
import os

import pytest
import torch

from console_server import SERVERS
from fairseq_attnzoo.modules import pkm_search_triton as S
from fairseq_attnzoo.modules import pkm_triton
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.modules.pkm_search import _ProductTopk

# the value kernels' device and tolerances, and the whole-layer check
from test_pkm_triton import DEVICE, DTYPES, _hosted_refusal, _tol, layers_agree

pytestmark = pytest.mark.skipif(not pkm_triton.HAS_TRITON,
                                reason="Triton is not installed (make install adds it)")


@pytest.fixture(autouse=True)
def _seed():
    assert DEVICE.type != "cpu" or pkm_triton.interpreted(), "conftest sets TRITON_INTERPRET"
    torch.manual_seed(0)


def _problem(dtype, heads=2, n=19, k_dim=16, n_keys=12, seed=5):
    """Queries as the layer hands them over (a [H, N, k_dim] view of [N, H·k_dim]) and sub-keys
    [H, 2, n_keys, k_dim/2]; 19 tokens: fewer than a program's 64 (and than a backward block's
    32), so every launch has rows past the end."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(n, heads, k_dim, generator=g).to(DEVICE, dtype).transpose(0, 1)
    keys = torch.randn(heads, 2, n_keys, k_dim // 2, generator=g).to(DEVICE, dtype)
    return query, keys


def _reference(query, keys, knn):
    """The PyTorch path in float32 on the same (rounded) inputs: softmax weights, slots."""
    scores, slots = _ProductTopk.apply(query.float(), keys.float(), knn)
    return torch.softmax(scores, -1), slots


def _exact_scores(query, keys, slots):
    """slots [N, H, knn] -> their scores [N, H, knn] recomputed in float64."""
    n_keys, half = keys.size(2), keys.size(3)
    q, k = query.double().transpose(0, 1), keys.double()  # [N, H, k_dim]
    heads = torch.arange(k.size(0), device=k.device)[None, :, None]
    a, b = slots.long() // n_keys, slots.long() % n_keys
    return ((q[:, :, None, :half] * k[heads, 0, a]).sum(-1)
            + (q[:, :, None, half:] * k[heads, 1, b]).sum(-1))


def _search(query, keys, knn):
    stats = {}
    weights, slots, sub = S._search(query, keys, knn, stats=stats)
    return weights, slots, sub, stats["fallback"]


# ---- the forward: a top-k that filters before it sorts ---------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_filter_search_equals_the_reference(dtype):
    """Random rows: the reference's slots in the reference's order (fp32, fp16 and bf16 inputs;
    scores accumulated in float32), the sub-key pairs behind them, softmax weights to float32
    rounding; knn not a power of two, 2 heads, a ragged last block; the filter's tile suffices
    (no fallback)."""
    query, keys = _problem(dtype)
    weights, slots, sub, fallback = _search(query, keys, 3)
    ref_w, ref_slots = _reference(query, keys, 3)
    assert slots.dtype == sub.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(slots.long(), ref_slots)
    assert torch.equal(sub.long(), torch.stack([ref_slots // 12, ref_slots % 12], 2))
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    assert fallback == 0


@pytest.mark.parametrize("n_keys, k_dim, knn", [(40, 16, 4), (70, 96, 5), (600, 32, 7)],
                         ids=["40 keys", "half 48 (not a power of two)", "600 keys"])
def test_topk_filter_over_several_blocks_of_sub_keys(n_keys, k_dim, knn):
    """n_keys not a multiple of the filter's step (32) nor of the group count; several group
    blocks (600 keys: 38 groups of 16, the last cut short); a half-query of 48 dims (masked
    loads); tokens a multiple of nothing: the reference's slots, weights to float32 rounding."""
    query, keys = _problem(torch.float32, heads=1, n=23, k_dim=k_dim, n_keys=n_keys)
    launch = S.search_launch(k_dim // 2, knn, n_keys, torch.float32)
    assert launch.GROUPS < n_keys and launch.KB < n_keys
    weights, slots, _, fallback = _search(query, keys, knn)
    ref_w, ref_slots = _reference(query, keys, knn)
    assert torch.equal(slots.long(), ref_slots)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    assert fallback == 0


def test_topk_filter_ties_go_to_the_lower_index():
    """The documented tie rule on constructed scores (a one-hot query: a score is one key
    coordinate, exactly): equal half scores -> the lower sub-key id; equal candidate sums -> the
    lower slot; scores one ulp apart keep their order; -0 ties +0; negative scores rank by value.
    A half whose 16 scores all tie keeps more than the filter's tile: the exact fallback runs."""
    n_keys, knn, half = 16, 4, 8
    query = torch.zeros(1, 16, 2 * half)
    query[:, :, 0] = query[:, :, half] = 1
    keys = torch.zeros(1, 2, n_keys, half)
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    # half 1: ids 9 and 3 score one_up and 1.0 (one ulp apart, the higher id ahead), ids 5 and 12
    # tie at 1.0 with id 3 -> 9, 3, 5, 12; every other id scores below
    keys[0, 0, :, 0] = torch.linspace(-3, -2, n_keys)
    keys[0, 0, [9, 3, 5, 12], 0] = torch.tensor([one_up, 1.0, 1.0, 1.0])
    # half 2: -0.0 (id 2) ties +0.0 (id 7); id 11 at -1e-30 is below both; the rest below -1
    keys[0, 1, :, 0] = torch.linspace(-5, -1, n_keys)
    keys[0, 1, [7, 2, 11], 0] = torch.tensor([0.0, -0.0, -1e-30])
    query, keys = query.to(DEVICE), keys.to(DEVICE)
    weights, slots, sub, fallback = _search(query, keys, knn)
    # sums: 9+{2,7} tie at one_up -> slots 9·16+2, 9·16+7; 9+11 = one_up - 1e-30 rounds to one_up:
    # a tie made by rounding -> 9·16+11; then 1.0 + 0 for a in {3, 5, 12}: the lowest slot, 3·16+2
    expected = [9 * n_keys + 2, 9 * n_keys + 7, 9 * n_keys + 11, 3 * n_keys + 2]
    assert slots[:, 0].tolist() == [expected] * 16
    assert sub[0, 0].tolist() == [[9, 9, 9, 3], [2, 7, 11, 2]]
    torch.testing.assert_close(weights[0, 0, :3], torch.full((3,), weights[0, 0, 0].item()))
    assert fallback == 0
    # the half lists alone: a query that reads half 1 only, with all of half 2 tied at 0
    keys[0, 1] = 0
    _, slots, _, fallback = _search(query, keys, knn)
    assert slots[0, 0].tolist() == [9 * n_keys, 9 * n_keys + 1, 9 * n_keys + 2, 9 * n_keys + 3]
    assert fallback == 1  # (half 2 of the one block of tokens)
    query[:, :, 0] = -1  # now the lowest half-1 scores win: linspace(-3, -2) negated, id 0 first
    _, slots, _, _ = _search(query, keys, knn)
    assert slots[0, 0].tolist() == [0, 1, 2, 3]


def _adversarial(kind, n=20, half=8, knn=5):
    """One-hot queries (a half score is one key coordinate, so every sum below is exact in
    float32 and float64 alike) and keys whose scores are: "equal" (every score of both halves),
    "near-ties" (half 1: 48 of 64 scores one ulp apart; half 2: all tied), "one group" (half 1:
    the 8 top scores of 256 all in one of the filter's groups -- sub-keys c, c + GROUPS, ...;
    the others and half 2: multiples of 1/256)."""
    n_keys = 256 if kind == "one group" else 64
    g = torch.Generator().manual_seed(3)
    query = torch.zeros(1, n, 2 * half)
    query[0, :, 0] = query[0, :, half] = 1
    keys = torch.zeros(1, 2, n_keys, half)
    if kind == "equal":
        keys[..., 0] = 0.25
    elif kind == "near-ties":
        ulps = torch.ones(48)
        for i in range(1, 48):
            ulps[i] = torch.nextafter(ulps[i - 1], torch.tensor(2.0))
        keys[0, 0, :, 0] = -1.0
        keys[0, 0, torch.randperm(n_keys, generator=g)[:48], 0] = ulps
    else:
        groups = S.search_launch(half, knn, n_keys).GROUPS
        keys[0, :, :, 0] = torch.randint(0, 256, (2, n_keys), generator=g) / 256
        keys[0, 0, 3::groups, 0] = 2 + torch.arange(n_keys // groups) / 8
    return query.to(DEVICE), keys.to(DEVICE)


@pytest.mark.parametrize("kind", ["equal", "near-ties", "one group"])
def test_topk_filter_adversarial_rows(kind):
    """Rows built against the filter: all scores equal, 48 scores within a few ulps (both keep
    more than the 16-wide tile at knn 5: the exact fallback runs, asserted), the top 8 scores
    all in one group (the filter's tile holds them: no fallback). The slots are the exact top-knn by the tie rule
    (score, then the lower slot), checked on scores recomputed in float64, and the weights are
    the softmax of those scores."""
    query, keys = _adversarial(kind)
    knn = 5
    weights, slots, sub, fallback = _search(query, keys, knn)
    assert (fallback > 0) == (kind != "one group")
    # the exact answer by brute force over all n_keys² slots, in float64, ties: the lower slot
    n_keys, half = keys.size(2), keys.size(3)
    q, k = query[0].double(), keys[0].double()
    every = (q[:, None, :half] @ k[0].T[None]).transpose(1, 2) + q[:, None, half:] @ k[1].T[None]
    every = every.reshape(q.size(0), -1)  # [N, n_keys²], slot a·n_keys + b
    order = torch.argsort(-every, dim=1, stable=True)[:, :knn]
    got = _exact_scores(query, keys, slots)[:, 0]
    want = every.gather(1, order)
    assert torch.equal(got, want), kind  # the same scores (exact sums)
    if kind == "equal":  # all tie: the lowest slots
        assert slots[:, 0].tolist() == [list(range(knn))] * q.size(0)
    else:
        assert torch.equal(slots[:, 0].long(), order)
    torch.testing.assert_close(weights[:, 0].double(), torch.softmax(want, 1), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_filter_search_is_batch_invariant(dtype):
    """A token searched alone and inside a batch (of 70: two programs, the token in the second)
    gets the same slots and bit-equal weights: its scores are summed in an order that does not
    depend on the other tokens."""
    query, keys = _problem(dtype, n=70, n_keys=40)
    batch_w, batch_slots, _, _ = _search(query, keys, 4)
    alone_w, alone_slots, _, _ = _search(query[:, 66:67], keys, 4)
    assert torch.equal(alone_slots, batch_slots[66:67])
    assert torch.equal(alone_w, batch_w[66:67])


# ---- the backward: sort-free ----------------------------------------------------------------

def _reference_grads(query, keys, knn, up):
    """torch.autograd through the reference search's scores: the dense half scores gathered at
    the chosen sub-keys, summed, softmaxed."""
    q = query.detach().float().requires_grad_(True)
    k = keys.detach().float().requires_grad_(True)
    _, slots = _ProductTopk.apply(q.detach(), k.detach(), knn)
    half = k.size(-1)
    n_keys = k.size(2)
    s1 = torch.einsum("hnd,hkd->nhk", q[..., :half], k[:, 0]).gather(-1, slots // n_keys)
    s2 = torch.einsum("hnd,hkd->nhk", q[..., half:], k[:, 1]).gather(-1, slots % n_keys)
    (torch.softmax(s1 + s2, -1) * up).sum().backward()
    return q.grad, k.grad


def _backward_problem(dtype, n=37, n_keys=70, knn=5, k_dim=16):
    query, keys = _problem(dtype, n=n, n_keys=n_keys, k_dim=k_dim)
    up = torch.randn(n, 2, knn, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, slots = _reference(query, keys, knn)  # (the search's answer, without running it)
    sub = torch.stack([slots // n_keys, slots % n_keys], 2).int()
    return query, keys, up, weights, sub


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sortfree_backward_equals_autograd(dtype):
    """The query gradient (a dot of the score gradient with the chosen sub-keys) and the sub-key
    gradient (dSᵀ·q per block of 64 sub-keys, the reads ordered by key block without a sort)
    equal autograd through the reference, in the inputs' dtypes: 37 tokens (a full block of 32
    and a cut one), 70 sub-keys (a full key block and a cut one), knn 5, 2 heads; sub-keys
    chosen by several pairs of a token (a pair shares its a with others) included."""
    query, keys, up, weights, sub = _backward_problem(dtype)
    assert any(len(set(row)) < 5 for row in sub[:, :, 0].reshape(-1, 5).tolist())
    grad_q, grad_k = S.search_backward_op(up, weights, sub, query, keys)
    ref_q, ref_k = _reference_grads(query, keys, 5, up)
    assert grad_q.dtype == grad_k.dtype == dtype and grad_q.shape == query.shape
    assert grad_q.stride() == query.stride()
    torch.testing.assert_close(grad_q.float(), ref_q, **_tol(dtype))
    torch.testing.assert_close(grad_k.float(), ref_k, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sortfree_backward_is_deterministic_across_chunks(dtype, monkeypatch):
    """Over several chunks of tokens (chunks of 32 here: 4 chunks of 100 tokens), the sub-key
    gradient is the chunks' partial sums added in chunk order: two runs are bit-equal, and both
    equal autograd."""
    monkeypatch.setattr(S, "CHUNK_TOKENS", 32)
    query, keys, up, weights, sub = _backward_problem(dtype, n=100, n_keys=40, knn=4)
    runs = [S.search_backward_op(up, weights, sub, query, keys) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref_q, ref_k = _reference_grads(query, keys, 4, up)
    torch.testing.assert_close(runs[0][0].float(), ref_q, **_tol(dtype))
    torch.testing.assert_close(runs[0][1].float(), ref_k, **_tol(dtype))


# ---- the custom ops ---------------------------------------------------------------------------

def test_search_autograd_through_the_custom_op():
    """``search`` is differentiable through the registered op: torch.autograd's gradients of a
    loss on its weights equal the reference's."""
    query, keys = _problem(torch.float32, n=16)
    q, k = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
    up = torch.randn(16, 2, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, slots = S.search(q, k, 3)
    (weights * up).sum().backward()
    ref_q, ref_k = _reference_grads(query, keys, 3, up)
    torch.testing.assert_close(q.grad, ref_q, **_tol(torch.float32))
    torch.testing.assert_close(k.grad, ref_k, **_tol(torch.float32))
    assert not slots.requires_grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_search_ops_fake_shapes_on_meta(dtype):
    """The custom ops' fake implementations (what torch.compile traces with) give the kernels'
    shapes, dtypes and strides on the meta device, and check the keys' shape there too."""
    query = torch.empty(7, 3, 16, device="meta", dtype=dtype).transpose(0, 1)  # [H 3, N 7, 16]
    keys = torch.empty(3, 2, 10, 8, device="meta", dtype=dtype)
    weights, slots, sub = S.search_op(query, keys, 4)
    assert (weights.shape, weights.dtype) == ((7, 3, 4), torch.float32)
    assert (slots.shape, slots.dtype) == ((7, 3, 4), torch.int32)
    assert (sub.shape, sub.dtype) == ((7, 3, 2, 4), torch.int32)
    grad_q, grad_k = S.search_backward_op(weights, weights, sub, query, keys)
    assert grad_q.shape == query.shape and grad_q.stride() == query.stride()
    assert grad_q.dtype == grad_k.dtype == dtype and grad_k.shape == keys.shape
    with pytest.raises(ValueError, match=r"keys must be \[H, 2, n_keys, k_dim/2\]"):
        S.search_op(query, keys[:, :, :, :4], 4)
    with pytest.raises(ValueError, match=r"knn must be in 1..n_keys \(10\), got 11"):
        S.search_op(query, keys, 11)


def test_search_compiles_whole_with_its_backward():
    """``torch.compile(fullgraph=True)`` takes a function calling the search (forward and
    backward through the custom ops' autograd rule: no graph break) and gives eager's result."""
    query, keys = _problem(torch.float32, heads=1, n=16)
    up = torch.randn(16, 1, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def loss(q, k):
        return (S.search(q, k, 3)[0] * up).sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        q, k = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
        value = fn(q, k)
        value.backward()
        results.append((value, q.grad, k.grad))
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref)


_OPS_AFTER_IMPORT = """
import torch
def ours():
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attnzoo::"))
before = ours()
import fairseq_attnzoo.modules.pkm
from fairseq_attnzoo.modules import pkm_search_triton
after_import = ours()
q, k = torch.randn(16, 2, 16).transpose(0, 1), torch.randn(2, 2, 12, 8)
pkm_search_triton.search_op(q, k, 3)
print(before, after_import, ours())
"""


def test_importing_the_memory_registers_no_op():
    """Importing the memory (and the search kernel's module) leaves torch's op registry as it
    was; the custom ops ``attnzoo::pkm_search`` and its backward are registered on first use."""
    # (as python -c, forked from a process that imported torch: tests/console_server.py)
    code, out, err = SERVERS.run("-c", [_OPS_AFTER_IMPORT], timeout=300, cwd=os.getcwd(),
                                 env=dict(os.environ, TRITON_INTERPRET="1"))
    assert code == 0, err[-3000:]
    assert out.split("\n")[0] == (
        "[] [] ['attnzoo::pkm_search', 'attnzoo::pkm_search_backward']")


# ---- the choice: auto, triton, torch ----------------------------------------------------------

class _OnCuda:
    """A stand-in for a CUDA query tensor of ``dtype`` (the rule reads these attributes only)."""

    is_cuda = True
    device = torch.device("cuda")

    def __init__(self, dtype):
        self.dtype = dtype


def test_auto_search_kernel_rule(caplog):
    """auto keys on the search's input dtype, the sub-keys' (the layer hands float32 queries and
    rounds them to it for the kernel): the fused kernel on CUDA for bf16 and fp16 inputs, not for
    float32 ones (their specialisation spills: FP32_PRECISION is None) and never on the CPU;
    each choice said once in the log, with its reason."""
    _, keys = _problem(torch.float32)
    assert S.FP32_PRECISION is None
    S._SAID.clear()
    query = _OnCuda(torch.float32)
    with caplog.at_level(logging.INFO, logger=S.__name__):
        assert S.use_search_kernel("auto", query, keys.bfloat16(), 3)
        assert S.use_search_kernel("auto", query, keys.half(), 3)
        assert not S.use_search_kernel("auto", query, keys, 3)
        for _ in range(2):
            assert not S.use_search_kernel("auto", torch.zeros(2, 4, 16), keys.bfloat16(), 3)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "PKM search_kernel=auto: the fused Triton search (bfloat16 inputs on CUDA)",
        "PKM search_kernel=auto: the fused Triton search (float16 inputs on CUDA)",
        "PKM search_kernel=auto: the PyTorch search (float32 inputs on CUDA: no fused float32 "
        "specialisation compiles without spilling registers)",
        "PKM search_kernel=auto: the PyTorch search (queries on cpu)"]
    assert S.shipped_dtypes() == (torch.bfloat16, torch.float16)


def test_search_kernel_choice_refusals(monkeypatch):
    """triton where the kernel cannot run: one line with the fix, in the module's words and
    (hosted) in the flag's; an unknown choice: one line listing the choices."""
    query, keys = _problem(torch.float32)
    assert S.use_search_kernel("triton", query, keys, 3)
    assert not S.use_search_kernel("torch", query, keys, 3)
    with pytest.raises(ValueError, match=r"search_kernel='triton' cannot run: .*knn <= 128.*"
                                         r"pass search_kernel='torch'") as e:
        S.use_search_kernel("triton", query, keys, 129)
    assert "\n" not in str(e.value) and "--" not in str(e.value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"cannot run: the queries are on cpu"):
        S.use_search_kernel("triton", query, keys, 3)
    _hosted_refusal(r"^--pkm-search-kernel triton cannot run: the queries are on cpu.*"
                    r"--pkm-search-kernel auto or torch", search_kernel="triton")
    with pytest.raises(ValueError, match="PKM search kernel must be one of auto, triton, torch"):
        ProductKeyMemory(16, 16, n_keys=6, heads=2, knn=3, k_dim=8, search_kernel="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_with_search_kernel_equals_memory_without(dtype):
    """A whole layer (batch norm, padding, search, value read) gives the same output and the
    same gradient on every parameter with ``search_kernel="triton"`` and ``"torch"``."""
    layers = layers_agree(dtype, 6, {k: dict(search_kernel=k) for k in ("triton", "torch")},
                          _tol(dtype), kernel="torch")
    assert [f"search_kernel={k}" in repr(m) for k, m in zip(("triton", "torch"), layers)] == [
        True, True]


def test_search_kernel_flag_reaches_the_memory(lm_data):
    """``--pkm-search-kernel`` (default auto) reaches every memory of a fairseq model."""
    from zoo_testlib import build

    for flags, expected in (([], "auto"), (["--pkm-search-kernel", "torch"], "torch")):
        model = build("transformer_lm_pkm", lm_data, flags)[2]
        kernels = {m.search_kernel for m in model.modules() if isinstance(m, ProductKeyMemory)}
        assert kernels == {expected}


def test_sm90_specializations_name_every_shipped_kernel():
    """The specialisations handed to the spill check (tests of the value kernel's file compile
    them): per dtype ``auto`` ships, the search, its pairs and both backward kernels, each
    signature naming the kernel's arguments in order and each constexpr given."""
    specs = list(S.sm90_specializations())
    assert [label for label, *_ in specs] == [
        "search bf16", "search pairs", "search backward query bf16", "search backward keys bf16",
        "search fp16", "search backward query fp16", "search backward keys fp16"]
    for label, kernel, signature, constexprs, warps in specs:
        assert list(signature) == kernel.arg_names, label
        assert {k for k, v in signature.items() if v == "constexpr"} == set(constexprs), label
        assert warps in (1, 2, 4, 8)
    assert specs[0][2]["n_keys"] == "i32:16" and specs[0][2]["heads"] == "i32"

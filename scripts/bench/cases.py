"""Every benchmark row, declared once (docs/performance.md: what each measures, and why), at
``paper`` size (the papers' and people's) and ``tiny`` (shrunk: the CPU dry run of the tests)."""

import itertools
import os
import shlex

import torch
import torch.nn as nn

from fairseq_attnzoo.modules.pkm_triton import SWEEP_BLOCKS  # (its import needs no Triton)
from scripts.bench.rows import USER_DIR, Decode, Kernel, Quality, Side, Train, fwd_bwd

CASES = []
add = CASES.append

#: the stock baseline's sanity floor: (device class, "half" | "fp32", target tokens/s, source).
#: Below it the harness, the environment or the flags are wrong, not the model.
FLOORS = {"transformer-base": [
    ("V100", "half", 40_000, "facebookresearch/fairseq#940: >= 160k wps on 4x V100 --fp16, "
     "transformer_wmt_en_de, 3.5-4k tokens/GPU"),
    ("V100", "fp32", 15_000, "facebookresearch/fairseq#940: ~73k wps on 4x V100 without --fp16"),
    ("H100", "half", 100_000, "fairseq#940's ~40k per V100, scaled to an H100 (at least 2.5x)"),
    ("H200", "half", 100_000, "fairseq#940's ~40k per V100, scaled to an H200 (at least 2.5x)")]}


def randn(*shape, device, dtype, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)


def on(module, device, dtype):
    torch.manual_seed(0)
    return module.to(device, dtype)


def tokens(p, device, dtype, length=128):
    """``p["tokens"]`` time-first tokens of width ``p["d"]`` as sentences of ``length``."""
    t = length if p["tokens"] % length == 0 else p["tokens"]
    return randn(t, p["tokens"] // t, p["d"], device=device, dtype=dtype)


def ffn(p, device, dtype, bias=True):
    """fairseq's position-wise FFN (fc1-ReLU-fc2, d_ff = ``p["ffn"]``)."""
    m = nn.Sequential(nn.Linear(p["d"], p["ffn"], bias=bias), nn.ReLU(),
                      nn.Linear(p["ffn"], p["d"], bias=bias))
    return fwd_bwd(on(m, device, dtype), tokens(p, device, dtype))


class SelfAttention(nn.Module):
    """``att(x, x, x)`` as fairseq's layers call it (optionally with a padding mask), output only."""

    def __init__(self, att, pad=None):
        super().__init__()
        self.att, self.pad = att, pad

    def forward(self, x):
        return self.att(x, x, x, key_padding_mask=self.pad, need_weights=False)[0]


def attn_input(p, device, dtype):
    return randn(p["L"], p["batch"], p["d"], device=device, dtype=dtype, seed=p["L"])


# ---- the device's roofline ------------------------------------------------------------------

def _copy(p, device, dtype):
    src = torch.empty(p["MiB"] << 20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _matmul(p, device, dtype):
    a, b = (randn(p["n"], p["n"], device=device, dtype=dtype, grad=False) for _ in range(2))
    return lambda: a @ b


add(Kernel("device", "copy", {"paper": [dict(MiB=1024)], "tiny": [dict(MiB=8)]}, _copy,
           work=lambda p, dt: ("bytes", 2 * p["MiB"] << 20),
           note="dst.copy_(src): bytes read + written per second, the memory roofline"))
add(Kernel("device", "matmul", {"paper": [dict(n=8192)], "tiny": [dict(n=64)]}, _matmul,
           work=lambda p, dt: ("flops", 2 * p["n"] ** 3), note="a square GEMM in --dtype: the "
           "arithmetic roofline"))


# ---- AOP ------------------------------------------------------------------------------------

def _aop(p, device, dtype):
    from fairseq_attnzoo.modules.aop import AttentionOverParameters, ffn_matching_slots
    from fairseq_attnzoo.modules.aop_triton import why_unavailable

    dk = p["width"] * p["d"] // p["heads"]  # h·d_pk = width·d: transformer_aop(_h16)
    att, x = p.get("attention"), tokens(p, device, dtype)  # (None: torch picks SDPA's backend)
    if att == "triton" and why_unavailable(x, dk, dk):
        raise RuntimeError(f"the Triton kernel cannot run: {why_unavailable(x, dk, dk)}")
    m = on(AttentionOverParameters(p["d"], p["heads"], dk, dk, ffn_matching_slots(
        p["d"], p["ffn"], p["heads"], dk, dk), kernel="sdpa" if att != "triton" else att),
        device, dtype)
    m.token_groups, m.sdpa_backend = p["groups"], None if att == "triton" else att
    return fwd_bwd(m, x)


#: size: (dims, (h_p, width) of AOP1 / AOP2, groups under torch's pick of SDPA backend, groups
#: under each backend alone); the Triton kernel takes the tokens as one group
_AOP = {"paper": (dict(tokens=16384, d=512, ffn=2048), ((8, 1), (16, 2)), (1, 4, 16),
                  (1, 2, 4, 8, 16, 32)),
        "tiny": (dict(tokens=64, d=32, ffn=128), ((4, 1),), (1, 2), (1, 2))}
add(Kernel("aop", "sublayer-vs-ffn", {size: [
    dict(heads=h, width=w, **a, groups=g, **dims) for h, w in hw for a, g in [({}, g) for g in pick]
    + [({"attention": a}, g) for a in ("flash", "cuDNN", "efficient", "math") for g in sweep]
    + [({"attention": "triton"}, 1)]] for size, (dims, hw, pick, sweep) in _AOP.items()},
    _aop, lambda p, dev, dt: ffn(p, dev, dt, bias=False),
    note="AOP1 (h 8) and AOP2 (h 16) with the FFN's weight count vs that FFN; tokens as 1-32 "
         "SDPA batch entries under torch's pick of backend or one backend alone (a row says why "
         "one cannot run), and the Triton kernel (--aop-kernel triton)"))


# ---- PKM -------------------------------------------------------------------------------------

PKM_PAPER = dict(n_keys=512, heads=4, knn=32, k_dim=256, tokens=16384)
PKM_TINY = dict(n_keys=8, heads=2, knn=4, k_dim=16, tokens=32)


def _kernels(device):
    from fairseq_attnzoo.modules.pkm_triton import value_kernel_available as ok

    return ["triton", "torch"] if ok(torch.empty(1, 1, device=device)) else ["torch"]


def _read_problem(p, device, dtype):
    """The value read ``out[n] = Σ_j w[n, j] V[idx[n, j]]``: table, indices, weights."""
    size, m, n, d = p["n_keys"] ** 2, p["heads"] * p["knn"], p["tokens"], p["d"]
    g = torch.Generator().manual_seed(0)
    table = (torch.randn(size, d, generator=g) * d ** -0.5).to(device, dtype)
    idx = torch.randint(0, size, (n, m), generator=g).to(device)
    w = torch.softmax(torch.randn(n, m, generator=g), -1).to(device, dtype)
    return table, idx, w


def _read(p, device, dtype):
    from fairseq_attnzoo.modules.pkm_values import _WeightedRowSum

    if p["kernel"] not in _kernels(device):
        raise RuntimeError(f"{p['kernel']} kernel not available on {device}")
    table, idx, w = _read_problem(p, device, dtype)
    t, ww = table.requires_grad_(True), w.requires_grad_(True)
    fused = p["kernel"] == "triton"
    if p["pass"] == "read":
        return lambda: _WeightedRowSum.apply(t, idx, ww, p["sparse"], fused)
    out = _WeightedRowSum.apply(t, idx, ww, p["sparse"], fused)
    up = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (t, ww), up, retain_graph=True)


def _read_bytes(p, dtype):
    """The read: the bytes its access pattern needs (a table row per read, indices, weights,
    output). The backward: the bytes that must leave DRAM (pkm_triton.backward_traffic)."""
    from fairseq_attnzoo.modules.pkm_triton import backward_traffic

    size, m, n, d = p["n_keys"] ** 2, p["heads"] * p["knn"], p["tokens"], p["d"]
    e = torch.empty(0, dtype=dtype).element_size()
    if p["pass"] == "read":
        return "bytes", n * m * d * e + n * m * (8 + e) + n * d * e
    return "bytes", sum(dram for _, dram, _ in backward_traffic(p, e))


def _grid(base, **axes):  # every combination of the axes' values, the last varying fastest
    return [dict(base, **dict(zip(axes, v))) for v in itertools.product(*axes.values())]


add(Kernel("pkm", "value-read", {
    "paper": _grid(PKM_PAPER, d=(512, 1024), sparse=(False, True), kernel=("triton", "torch"),
                   **{"pass": ("read", "backward")}),
    "tiny": _grid(PKM_TINY, d=(32,), sparse=(False, True),
                  kernel=("triton", "torch"), **{"pass": ("read", "backward")})},
    _read, work=_read_bytes, note="the value read and its backward, |K| 262,144, 4 heads x knn "
    "32, 16,384 tokens; the read's bytes as its access pattern needs them, the backward's as they "
    "leave DRAM"))


def _tune(p, device, dtype):
    from fairseq_attnzoo.modules import pkm_triton

    if "triton" not in _kernels(device):
        raise RuntimeError("no Triton on this device")
    table, idx, w = _read_problem(dict(p, sparse=False), device, dtype)
    up = torch.randn(idx.size(0), p["d"], device=device, dtype=dtype)
    if p["kernel"] == "blocks" and pkm_triton.backward_method(up, table, w) != "blocks":
        raise RuntimeError(f"the blocks backward takes fp16 or bf16, not {str(dtype)[6:]}")
    launch = (pkm_triton.BlockLaunch(*p["launch"]) if p["kernel"] == "blocks"
              else pkm_triton.Launch(*p["launch"]))
    return lambda: pkm_triton.backward(up, table, idx, w, False, True, True, launch, p["kernel"])


add(Kernel("pkm", "launch-sweep", {
    "paper": [dict(PKM_PAPER, d=d, kernel=k, launch=launch) for d in (512, 1024)
              for k, launches in (("rows", [(512, 4, 2)]), ("blocks", SWEEP_BLOCKS))
              for launch in launches],
    "tiny": [dict(PKM_TINY, d=32, kernel="rows", launch=(32, 4, 2)),
             dict(PKM_TINY, d=32, kernel="blocks", launch=(32, 16, 16, 4))]},
    _tune, work=lambda p, dt: _read_bytes(dict(p, sparse=False, **{"pass": "backward"}), dt),
    note="the dense Triton backward: the rows kernel at its launch (cols, rows, warps), the "
         "blocks kernel at each of pkm_triton.SWEEP_BLOCKS (cols, rows, reads, warps)"))


def _memory(p, device, dtype, **kw):  # (initialised on the device: 1M x 1024 takes a CPU seconds)
    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    torch.manual_seed(0)
    with torch.device(device):
        return ProductKeyMemory(p["d"], p["d"], n_keys=p["n_keys"], heads=p["heads"],
                                knn=p["knn"], k_dim=p["k_dim"], **kw).to(dtype)


def _pkm_layer(p, device, dtype):
    if p["impl"].startswith("peer"):
        from product_key_memory import PKM  # lucidrains' product-key-memory 0.3.0, optional

        m = PKM(p["d"], heads=p["heads"], num_keys=p["n_keys"], topk=p["knn"],
                dim_head=p["k_dim"] // 2, use_layernorm="BatchNorm" not in p["impl"])
        m.values.sparse = "sparse" in p["impl"]
        # batch-first; sequences of dim_head tokens (its BatchNorm takes time for channels)
        x = tokens(p, device, dtype, length=p["k_dim"] // 2).transpose(0, 1).contiguous()
        return fwd_bwd(on(m, device, dtype), x.detach().requires_grad_(True))
    if p["impl"].startswith("defaults"):  # "defaults, search float32": --pkm-search-dtype float32
        kw = {"search_dtype": "float32"} if "float32" in p["impl"] else {}
        return fwd_bwd(_memory(p, device, dtype, **kw), tokens(p, device, dtype))
    sparse, kernel = p["impl"].split()[:2]  # "... fused search": --pkm-search-kernel triton
    if kernel not in _kernels(device):
        raise RuntimeError(f"{kernel} kernel not available on {device}")
    m = _memory(p, device, dtype, sparse=sparse == "sparse", kernel=kernel,
                search_kernel="triton" if "fused" in p["impl"] else "torch")
    return fwd_bwd(m, tokens(p, device, dtype))


def _layer_rows(base, keys, ds):  # _IMPLS in --dtype; the defaults (and the float32 search of
    # earlier versions) and the peer in their own dtypes (on CUDA its bf16 backward is refused)
    return (_grid(base, d=ds, impl=_IMPLS) + _grid(base, n_keys=keys, d=ds, dtype=(
        "bf16", "fp16", "fp32"), impl=("defaults",)) + _grid(base, d=ds[:1], dtype=(
            "bf16", "fp16"), impl=("defaults, search float32",)) + _grid(
        base, n_keys=keys, d=ds, dtype=("fp16", "bf16"), impl=("peer LayerNorm",)))


_IMPLS = ("dense triton", "sparse triton", "dense triton fused search", "dense torch",
          "sparse torch", "peer LayerNorm", "peer BatchNorm", "peer LayerNorm sparse")
add(Kernel("pkm", "layer-vs-ffn", {
    "paper": _layer_rows(dict(PKM_PAPER, ffn=0), (512, 1024), (512, 1024)),
    "tiny": _layer_rows(dict(PKM_TINY, ffn=0), (8,), (32,))},
    _pkm_layer, lambda p, dev, dt: ffn(dict(p, ffn=4 * p["d"]), dev, dt),
    note="a whole memory layer (query net, batch norm, product-key search, read), ours and "
         "lucidrains' product-key-memory 0.3.0 (peer, when installed), vs the FFN (d_ff 4d) it "
         "replaces; the defaults (and the peer) in each dtype at 512² and 1024² slots"))


def pkm_parts(m, x):
    """The five parts of layer ``m``'s forward and backward on ``x`` [T, B, d] as it runs them
    (its kernels, its search dtype), each a call; the layer is them and the rest (casts,
    softmax, autograd). scripts/costmodel.py traces the same calls."""
    from fairseq_attnzoo.modules import pkm_triton

    flat = x.detach().reshape(-1, x.size(-1)).requires_grad_()
    dtype, fused = m.search_dtype_for(flat), pkm_triton.use_value_kernel(m.kernel, m.values.weight)
    q = m.query(flat).detach().requires_grad_()
    w, idx = m.lookup(q, dtype)
    wv = w.detach().requires_grad_()
    out = m.values.read(idx, wv, fused)
    up = [torch.randn_like(t) for t in (q, w, out)]
    grad = torch.autograd.grad
    return {"query net": lambda: grad(m.query(flat), (flat, *m.parameters()), up[0],
                                      allow_unused=True),  # (like the layer: no accumulation)
            "search forward": lambda: m.lookup(q, dtype),
            "search backward": lambda: grad(w, (q, m.keys), up[1], retain_graph=True),
            "value read": lambda: m.values.read(idx, wv, fused),
            "value backward": lambda: grad(out, (m.values.weight, wv), up[2], retain_graph=True)}


def _layer_part(p, device, dtype):  # a part, or the five back to back
    parts = pkm_parts(_memory(p, device, dtype), tokens(p, device, dtype))
    return parts.get(p["part"]) or (lambda: [part() for part in parts.values()])


_PARTS = dict(dtype=("bf16", "fp16", "fp32"), part=("query net", "search forward",
              "search backward", "value read", "value backward", "the five"))
add(Kernel("pkm", "layer-parts", {"paper": _grid(dict(PKM_PAPER, d=512), **_PARTS),
                                  "tiny": _grid(dict(PKM_TINY, d=32), **_PARTS)},
    _layer_part, lambda p, dev, dt: fwd_bwd(_memory(p, dev, dt), tokens(p, dev, dt)),
    note="each part of the default memory layer (query net, search forward and backward, value "
         "read and backward; the five back to back) vs the whole layer: ratio = the part's "
         "share; the rest = the layer's ms - the five's"))


def _same_search(q, k, slots, ref):
    """The fused search against the reference here: where the slots differ (the kernel sums in
    another order than cuBLAS, so a near-tie may rank the other way), each row's chosen scores,
    recomputed in float64, are within 1e-5 of the largest; prints how many rows differ."""
    def exact(s):  # slots [N, H, knn] -> their float64 scores [H, N, knn], largest first
        a, b = (x.transpose(0, 1) for x in (s.long() // k.size(2), s.long() % k.size(2)))
        q64, k64, h = q.double()[:, :, None], k.double(), k.size(3)
        i = torch.arange(k.size(0), device=k.device)[:, None, None]
        return ((q64[..., :h] * k64[i, 0, a]).sum(-1) + (q64[..., h:] * k64[i, 1, b]).sum(-1)
                ).sort(-1, True).values
    rows, (got, want) = (slots.long() != ref.long()).any(-1), map(exact, (slots, ref))
    text = (f"{rows.sum()} of {rows.numel()} (token, head) rows chose other slots than the "
            f"reference; largest score gap {(got - want).abs().max() / want.abs().max():.2e}")
    print(f"search check: {text}", flush=True)
    if (got - want).abs().max() > 1e-5 * want.abs().max():
        raise RuntimeError(f"the fused search differs from the reference here: {text}")


def _search(p, device, dtype):
    """The search alone, or its backward: today's (torch.topk) or the fused kernels at the launch
    ``auto`` uses (checked against it here first, with how often the forward's exact fallback
    ran); queries [H, N, k_dim] as a view of [N, H·k_dim], as the layer hands them over."""
    from fairseq_attnzoo.modules import pkm_search_triton as fused
    from fairseq_attnzoo.modules.pkm_search import _ProductTopk

    dt, grad = (dtype if p["inputs"] == "dtype" else torch.float32), p["impl"] == "topk"
    q = randn(p["tokens"], p["heads"], p["k_dim"], device=device, dtype=dt).transpose(0, 1)
    q = q.detach().requires_grad_(grad)
    k = randn(p["heads"], 2, p["n_keys"], p["k_dim"] // 2, device=device, dtype=dt, grad=grad)
    ref = _ProductTopk.apply(q.float(), k.float(), p["knn"])
    if p["impl"] == "topk":
        return (lambda: _ProductTopk.apply(q, k, p["knn"])) if p["pass"] == "forward" else (
            lambda: torch.autograd.grad(ref[0].softmax(-1), (q, k), ref[0], retain_graph=True))
    if "triton" not in _kernels(device):
        raise RuntimeError("no Triton on this device")
    stats = {}
    w, slots, sub = fused._search(q, k, p["knn"], stats=stats)
    print(f"search check: the exact fallback ran for {stats['fallback']} of "
          f"{2 * p['heads'] * -(-p['tokens'] // fused.BLOCK_N)} (token block, head, half)",
          flush=True)
    _same_search(q, k, slots, ref[1])
    if p["pass"] == "forward":
        return lambda: fused._search(q, k, p["knn"])
    return lambda: fused.search_backward_op(w, w, sub, q, k)


def _search_work(p, dtype):  # forward: the score GEMMs; backward: the rows gathered, q, ∂q
    n, e = p["tokens"] * p["heads"], 4 if p["inputs"] == "float32" else dtype.itemsize
    if p["pass"] == "forward":
        return "flops", 2 * n * p["n_keys"] * p["k_dim"]
    return "bytes", (2 * n * p["knn"] * p["k_dim"] + 2 * n * p["k_dim"]) * e


for _pass, _impl in (("forward", "fused"), ("backward", "sortfree")):
    add(Kernel("pkm", f"search-{_pass}", {s: [
        dict(base, n_keys=n, impl=_impl, inputs="dtype", **{"pass": _pass}) for n in keys]
        for s, base, keys in (("paper", PKM_PAPER, (512, 1024)), ("tiny", PKM_TINY, (8,)))},
        _search, lambda p, dev, dt: _search(dict(p, impl="topk", inputs="float32"), dev, dt),
        work=_search_work, note=f"the product-key search's {_pass} vs today's (torch.topk, "
        "float32): the fused Triton kernels on --dtype inputs (forward: the top-k that filters "
        "before it sorts; backward: sort-free), the launch `auto` ships"))


# ---- Synthesizer ----------------------------------------------------------------------------

def _left_pad(p, device):
    g = torch.Generator().manual_seed(4)
    lead = torch.randint(0, p["L"] // 3 + 1, (p["batch"],), generator=g)
    lead[0] = 0
    return (torch.arange(p["L"])[None] < lead[:, None]).to(device) if p["padding"] else None


def _table_kernel(kernel):
    def make(p, device, dtype):
        from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

        m = SynthesizerAttention(p["d"], p["heads"], components=(p["mode"],), max_len=p["N"],
                                 table_kernel=kernel)
        return fwd_bwd(on(SelfAttention(m, _left_pad(p, device)), device, dtype),
                       attn_input(p, device, dtype))
    return make


add(Kernel("synthesizer", "table-kernel", {
    "paper": [dict(mode=m, L=L, batch=8192 // L, d=512, heads=8, N=256, padding=pad)
              for m in ("random", "factorized_random") for L in (32, 64, 128)
              for pad in (False, True)],
    "tiny": [dict(mode=m, L=8, batch=4, d=32, heads=2, N=16, padding=pad)
             for m in ("random", "factorized_random") for pad in (False, True)]},
    _table_kernel("sdpa"), _table_kernel("table"),
    note="Random / Factorized Random, --synth-table-kernel sdpa vs table, a --max-tokens 8192 "
         "batch, with and without left padding: what `auto` should pick on a device"))


# ---- adaptive span -------------------------------------------------------------------------

class SpanBlock(nn.Module):
    """Adaptive-span attention over a block and its cache: ours, or fairseq's example's."""

    def __init__(self, att, memory, key_pe=None):
        super().__init__()
        self.att, self.memory, self.key_pe = att, memory, key_pe

    def forward(self, x):
        if self.key_pe is None:
            return self.att(x, memory=self.memory)[0]
        h = torch.cat([self.memory, x], dim=1)
        return self.att(x, h, h, self.key_pe)


def _span(p, device, dtype):
    from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanAttention

    ratio = (p["window"] - 32) / p["S"]  # max z + ramp = the trimmed window
    x = randn(p["batch"], p["block"], p["d"], device=device, dtype=dtype, seed=2)
    memory = randn(p["batch"], p["window"] - 1 + 64, p["d"], device=device, dtype=dtype, seed=3,
                   grad=False)  # the window + the model's 64-position cache buffer
    if p["impl"] == "fairseq example":
        from fairseq.examples.adaptive_span.adaptive_span_model import MultiHeadSeqAttention

        att = MultiHeadSeqAttention(p["d"], p["heads"], attn_span=p["S"], dropout=0.0,
                                    adapt_span_layer=False, adapt_span_ramp=32,
                                    adapt_span_init=ratio)
        key_pe = nn.Parameter(torch.randn(1, p["d"] // p["heads"], p["S"]))
        return fwd_bwd(on(SpanBlock(att, memory, key_pe), device, dtype), x)
    att = AdaptiveSpanAttention(p["d"], p["heads"], p["S"], ramp=32, span_init=ratio,
                                own_key_pe=True, kernel=p["impl"].split()[1])
    return fwd_bwd(on(SpanBlock(att, memory), device, dtype), x)


add(Kernel("adaptive_span", "sublayer-vs-example", {
    "paper": _grid(dict(batch=64, block=512, d=512, heads=8, S=8192), window=(64, 1024, 4096),
                   impl=("ours sdpa", "ours explicit")),
    "tiny": _grid(dict(batch=2, block=16, d=32, heads=2, S=128), window=(64, 128),
                  impl=("ours sdpa", "ours explicit"))},
    _span, lambda p, dev, dt: _span(dict(p, impl="fairseq example"), dev, dt),
    note="the attention sublayer at the paper's small enwik8 config with every span trimmed to "
         "a window: ours (fused / op by op) vs fairseq's examples/adaptive_span module"))


# ---- end to end: fairseq-train against the stock baseline -------------------------------------

MT = {"paper": "--task translation --share-decoder-input-output-embed --optimizer adam "
               "--adam-betas (0.9,0.98) --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
               "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout 0.1 "
               "--max-tokens 8192 --skip-invalid-size-inputs-valid-test",
      "tiny": "--task translation --optimizer adam --lr 5e-4 --criterion cross_entropy "
              "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 "
              "--encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --encoder-attention-heads 4 "
              "--decoder-attention-heads 4 --max-tokens 512"}
#: --decoder-normalize-before: the bare ``transformer_lm`` arch is post-norm without a final norm;
#: the zoo LMs (fairseq's base_lm_architecture) are pre-norm: the baseline gets their layout
LM = {"paper": "--task language_modeling --sample-break-mode none --tokens-per-sample 512 "
               "--decoder-normalize-before --decoder-layers 12 --decoder-embed-dim 512 "
               "--decoder-ffn-embed-dim 2048 --decoder-attention-heads 8 --optimizer adam "
               "--adam-betas (0.9,0.98) --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
               "--criterion cross_entropy --dropout 0.1 --max-tokens 8192",
      "tiny": "--task language_modeling --sample-break-mode none --tokens-per-sample 16 "
              "--decoder-normalize-before --decoder-layers 2 --decoder-embed-dim 64 "
              "--decoder-ffn-embed-dim 128 --decoder-attention-heads 4 --optimizer adam "
              "--lr 5e-4 --criterion cross_entropy --max-tokens 64"}
#: toy sizes of each family's own flags (an arch refuses the flags of sublayers it does not build)
METHOD_TINY = {"pkm": "--pkm-n-keys 16 --pkm-knn 4 --pkm-k-dim 16", "aop": "--aop-slots 16"}


def _zoo(arch, family, method):
    sizes = {"paper": method.get("paper", ""),
             "tiny": f"{method.get('tiny', '')} {METHOD_TINY.get(family, '')}"}
    return {size: f"--user-dir {USER_DIR} --arch {arch} {flags}".strip()
            for size, flags in sizes.items()}


def _stock(arch):
    return f"--user-dir {USER_DIR} --arch {arch}"


#: the stock baseline itself (stage 1 of a GPU visit): stock fairseq (the plugin never imported)
#: in --precision, against the same with torch's cuDNN attention deprioritized, the plugin
#: enabled as --user-dir enables it, and bf16 through the plugin (stock --bf16 asks for a TPU)
add(Train("baseline", "mt-transformer", "mt", MT, Side("--arch transformer", plugin=False), {
    "plugin off, cuDNN attention deprioritized": Side(
        "--arch transformer", plugin=False, env={"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}),
    "plugin on": Side(_stock("transformer")),
    "plugin on, bf16": Side(_stock("transformer"), precision="bf16")},
    floor="transformer-base", note="stock transformer-base, --max-tokens 8192: the baseline "
    "against its floor, what loading the plugin and cuDNN attention cost it"))
#: every translation arch and every memory LM, against the stock model of its task (one case
#: each: the baseline runs once for all of them)
MT_ARCHS = {a: _zoo(a, {"synth": "synthesizer"}.get(a.split("_")[1], a.split("_")[1]), {})
            for a in ("transformer_synth_dense", "transformer_synth_random",
                      "transformer_synth_factorized_random", "transformer_aop",
                      "transformer_aop_h16", "transformer_collab", "transformer_pkm")}
LM_ARCHS = {a: _zoo(a, "pkm", {"paper": "--pkm-n-keys 512"}) for a in (
    "transformer_lm_pkm", "transformer_lm_memplus", "transformer_lm_memplus_llama")}
LM_ARCHS["attnzoo_lm_llama"] = _zoo("attnzoo_lm_llama", "", {})
add(Train("translation", "train", "mt", MT, _stock("transformer"), MT_ARCHS,
          floor="transformer-base", note="every translation arch vs transformer at "
          "transformer-base, --max-tokens 8192"))
add(Train("lm", "train", "lm", LM, _stock("transformer_lm"), LM_ARCHS, warm="interval",
          note="the memory LMs (262,144 slots) and the Llama-host LMs vs a 12-layer d 512 "
          "transformer_lm, blocks of 512"))
#: decoding as translation users decode (beam 5, and greedy), on the test split; tiny: hypotheses
#: capped at 20 tokens (an untrained toy model would otherwise decode to fairseq's 200)
add(Decode("translation", "decode", "mt", MT, _stock("transformer"), MT_ARCHS, {
    f"beam {k}": {"paper": f"--beam {k} --max-tokens 8192",
                  "tiny": f"--beam {k} --max-tokens 512 --max-len-b 20"} for k in (5, 1)},
    note="fairseq-generate of each arch's transformer-base checkpoint (1,000 updates) vs the "
    "transformer's, test split"))
add(Decode("lm", "eval", "lm", LM, _stock("transformer_lm"), LM_ARCHS, {"eval-lm": {
    "paper": "--tokens-per-sample 512 --max-tokens 8192",
    "tiny": "--tokens-per-sample 16 --max-tokens 64"}},
    note="fairseq-eval-lm of each memory LM's checkpoint (1,000 updates) vs transformer_lm's"))


def _span_commands():
    """(ours, fairseq's examples/adaptive_span) at the paper's small enwik8 config: 12 layers,
    d 512, 8 heads, FFN 2048, span 8192, block 512, batch 64 (tiny: shrunk); same optimizer."""
    import fairseq

    example = os.path.join(os.path.dirname(fairseq.__file__), "examples", "adaptive_span")
    out = {}
    for size, (layers, d, heads, ffn_dim, span, block, batch) in (
            ("paper", (12, 512, 8, 2048, 8192, 512, 64)), ("tiny", (2, 32, 4, 64, 64, 16, 2))):
        common = (f"--tokens-per-sample {block} --batch-size {batch} --lr 0.07 --lr-scheduler "
                  f"fixed --warmup-updates 100 --dropout 0")
        ours = (f"{common} --user-dir {USER_DIR} --task attnzoo_stream_lm --arch "
                f"adaptive_span_lm_small --decoder-layers {layers} --decoder-embed-dim {d} "
                f"--decoder-attention-heads {heads} --decoder-ffn-embed-dim {ffn_dim} --attn-span "
                f"{span} --adaptive-span-ramp 32 --adaptive-span-init 0 --adaptive-span-loss 2e-6 "
                "--criterion attnzoo_span_loss --no-layer-spans --optimizer adagrad_clip "
                "--grad-clip-per-tensor 0.03")
        theirs = (f"{common} --user-dir {example} --task truncated_bptt_lm --arch adaptive_span "
                  f"--n-layer {layers} --d-model {d} --n-head {heads} --d-inner {ffn_dim} "
                  f"--attn-span {span} --emb-dropout 0 --adapt-span-ramp 32 --adapt-span-init 0 "
                  "--aux-loss-scaler 2e-6 --criterion adaptive_span_loss --optimizer "
                  "adagrad_with_grad_clip --adagrad-clip 0.03")
        out[size] = (ours, theirs)
    return out


add(Train("adaptive_span", "vs-example", "lm", "", lambda size: _span_commands()[size][1],
          lambda size: _span_commands()[size][0], warm="interval",  # (fairseq imported first)
          note="adaptive_span_lm vs fairseq's examples/adaptive_span, paper-small enwik8 config"))


def own_arch(arch, flags):
    """``--arch ARCH`` (ours or stock; with ``--flags``, a row labelled by them) against its
    task's stock baseline (A/A: ``transformer``, ``attnzoo_lm`` against ``transformer_lm``)."""
    import fairseq_attnzoo  # noqa: F401  (our arch names)
    from fairseq.models import ARCH_MODEL_REGISTRY, FairseqLanguageModel

    if arch not in ARCH_MODEL_REGISTRY:
        raise SystemExit(f"--arch {arch}: no such fairseq arch: `attnzoo-archs` lists ours")
    if getattr(ARCH_MODEL_REGISTRY[arch], "zoo_task", None) == "attnzoo_stream_lm":
        raise SystemExit(f"--arch {arch} trains with --task attnzoo_stream_lm, which has no stock "
                         "baseline: time it with the case adaptive_span/vs-example")
    lm = issubclass(ARCH_MODEL_REGISTRY[arch], FairseqLanguageModel)
    side = Side({s: f"{v} {flags}" for s, v in _zoo(arch, "", {}).items()})
    return Train("own", arch, "lm" if lm else "mt", LM if lm else MT, _stock(
        "transformer_lm" if lm else "transformer"), {f"{arch} {flags}": side} if flags else side,
        warm="interval" if lm else "epoch", floor=None if lm else "transformer-base")


# ---- quality at equal updates --------------------------------------------------------------

MEMORY_LM = {"paper": "--task language_modeling --tokens-per-sample 128 --sample-break-mode none "
                      "--batch-size 8 --decoder-layers 6 --decoder-embed-dim 128 "
                      "--decoder-ffn-embed-dim 512 --decoder-attention-heads 4 --dropout 0 "
                      "--lr 2e-3 --adam-betas (0.9,0.98) --lr-scheduler inverse_sqrt "
                      "--warmup-updates 100 --clip-norm 1.0 --batch-size-valid 8 "
                      f"--max-valid-steps 100 --user-dir {USER_DIR}",
             "tiny": "--task language_modeling --tokens-per-sample 16 --sample-break-mode none "
                     "--batch-size 2 --decoder-layers 2 --decoder-embed-dim 32 "
                     "--decoder-ffn-embed-dim 64 --decoder-attention-heads 4 --lr 2e-3 "
                     f"--batch-size-valid 2 --max-valid-steps 2 --user-dir {USER_DIR}"}
_MEM = {"paper": "--pkm-n-keys 128 --pkm-heads 4 --pkm-knn 16",
        "tiny": "--pkm-n-keys 8 --pkm-heads 2 --pkm-knn 4 --pkm-k-dim 16"}
#: XLM: values with their own Adam, constant lr 1e-3, betas (0.9, 0.999), no weight decay
XLM = ("--optimizer pkm_adam --pkm-values-lr 1e-3 --pkm-values-lr-schedule constant "
       "--pkm-values-betas (0.9,0.999) --pkm-values-weight-decay 0")
#: the Memory+ code (facebookresearch/memory): dense value gradients, AdamW (0.9, 0.95), weight
#: decay 0.1, value lr 1e-3 under the model's schedule
MEMPLUS = ("--optimizer pkm_adam --pkm-sparse false --pkm-values-lr 1e-3 "
           "--pkm-values-lr-schedule follow --pkm-values-betas (0.9,0.95) "
           "--pkm-values-weight-decay 0.1")
#: the Llama host at attnzoo_lm's parameters: a SwiGLU hidden of 344 (--decoder-ffn-embed-dim 516,
#: multiple of 8) gives 197,888 a layer against the fairseq host's 198,272 (tiny: 8,544 / 8,768)
_LLAMA = {"paper": "--decoder-ffn-embed-dim 516 --swiglu-multiple-of 8",
          "tiny": "--decoder-ffn-embed-dim 72 --swiglu-multiple-of 8"}
_PKM_LLAMA_FFN = {"paper": "swiglu,swiglu,swiglu,pkm,swiglu,swiglu", "tiny": "swiglu,pkm"}
_PKM3_LLAMA_FFN = {"paper": "swiglu,pkm,swiglu,pkm,swiglu,pkm", "tiny": "swiglu,pkm"}
_RATIO, _ONE = "--pkm-values-lr-ratio 10", {"paper": "--pkm-decoder-layers 3", "tiny": ""}
_MEMPLUS_SPLITS = {"value-lr ratio 10 (the reference's)": dict.fromkeys(_ONE, _RATIO),
                   "one memory layer (the middle)": _ONE,
                   "value-lr ratio 10 and one memory layer": {s: f"{_RATIO} {_ONE[s]}" for s in _ONE}}
_PKM = {s: f"{_MEM[s]} {XLM}" + (" --pkm-k-dim 64" if s == "paper" else "") for s in _MEM}
_PKM_LLAMA = {s: f"--arch transformer_lm_pkm --norm rmsnorm --rope --rope-theta 500000 "  # (the
               f"--no-proj-bias --no-token-positional-embeddings --decoder-ffn "  # host's flags)
               f"{_PKM_LLAMA_FFN[s]} {_LLAMA[s]} {_PKM[s]}" for s in _MEM}
add(Quality("pkm", "memory-lm", "lm", MEMORY_LM, {
    "dense (attnzoo_lm)": "--arch attnzoo_lm --optimizer adam",
    "dense, Llama host (attnzoo_lm_llama, equal parameters)": {
        s: f"--arch attnzoo_lm_llama {_LLAMA[s]} --optimizer adam" for s in _MEM},
    "transformer_lm_pkm, XLM recipe": {s: f"--arch transformer_lm_pkm {_PKM[s]}" for s in _MEM},
    "transformer_lm_pkm, Llama host, XLM recipe": _PKM_LLAMA,
    "transformer_lm_memplus, memory-code recipe (dense values)": {
        s: f"--arch transformer_lm_memplus {_MEM[s]} {MEMPLUS}" for s in _MEM},
    "transformer_lm_memplus_llama, memory-code recipe": {
        s: f"--arch transformer_lm_memplus_llama {_LLAMA[s]} {_MEM[s]} {MEMPLUS}" for s in _MEM},
    # what separates Memory+ from PKM: the value-lr ratio (MEMPLUS: 0.5x --lr, the reference's
    # 10x) and the memory count (3 of 6 layers, Memory+'s "spread"; the reference 3 of 24)
    **{f"transformer_lm_memplus_llama, memory-code recipe, {what}": {
        s: f"--arch transformer_lm_memplus_llama {_LLAMA[s]} {_MEM[s]} " + (  # (ratio or 1e-3)
            MEMPLUS.replace("--pkm-values-lr 1e-3", flags[s]) if _RATIO in flags[s] else
            f"{MEMPLUS} {flags[s]}") for s in _MEM} for what, flags in _MEMPLUS_SPLITS.items()},
    "transformer_lm_pkm, Llama host, XLM recipe, three memory layers (as Memory+)": {
        s: _PKM_LLAMA[s].replace(_PKM_LLAMA_FFN[s], _PKM3_LLAMA_FFN[s]) for s in _MEM}},
    updates={"paper": 1000, "tiny": 4},
    note="dense vs PKM vs Memory+ character LM on data/wiki-gensim, in fairseq's host and the "
    "Llama host (RMSNorm, SwiGLU, RoPE, no biases): valid bits per byte"))


def _precision_runs(task):
    """Every zoo arch of ``task`` at the demo size (scripts/demo/config.py), 100 updates."""
    def runs():
        from fairseq_attnzoo.cli.archs import zoo_archs
        from scripts.demo import config as demo

        if task == "translation":
            common = demo.COMMON + " --task translation"
        elif task == "language_modeling":
            common = ("--task language_modeling --sample-break-mode none --tokens-per-sample 128 "
                      "--max-tokens 2048 --decoder-layers 4 --decoder-embed-dim 128 "
                      "--decoder-ffn-embed-dim 512 --decoder-attention-heads 4 --dropout 0 "
                      "--optimizer adam --lr 0.001 --lr-scheduler inverse_sqrt "
                      "--warmup-updates 50 --clip-norm 1.0")
        else:
            common = demo.LM_COMMON
        return {arch: f"--user-dir {USER_DIR} --arch {arch} {common} "
                      + " ".join(shlex.quote(f) for f in demo.method_flags(arch))
                      + (" --synth-max-len 128" if "synth" in arch and task != "translation"
                         else "")
                for arch in zoo_archs(task=task)}
    return runs


for _task, _data in (("translation", "mt"), ("language_modeling", "lm"),
                     ("attnzoo_stream_lm", "lm")):
    add(Quality("precision", f"every-arch-{_task}", _data, "", _precision_runs(_task),
                updates={"paper": 100, "tiny": 2},
                note="every zoo arch of the task at the demo size, in --precision: valid loss, "
                     "loss-scale overflows"))


#: --ddp-backend fully_sharded (fairscale's FSDP: CUDA only) against pytorch_ddp on one GPU for
#: the memory archs whose tables FSDP may hold (a shared pool is refused), plain Adam (pkm_adam
#: takes no flat parameters), fp32 (fairseq's FSDP refuses --bf16): equal losses (docs/pkm.md,
#: "Which --ddp-backend"); fairscale wants a process group even on one GPU: both sides make one
_GROUP = ("--distributed-init-method tcp://127.0.0.1:29517 --distributed-no-spawn "
          "--distributed-rank 0")
for _data, _common, _arch in (("lm", LM, "transformer_lm_pkm"), ("mt", MT, "transformer_pkm")):
    add(Quality("pkm", f"fsdp-{_data}", _data, _common, {f"{_arch}, {ddp}": {
        s: f"{f} {_GROUP} --ddp-backend {ddp}" + (" --distributed-backend gloo" * (s == "tiny"))
        for s, f in _zoo(_arch, "pkm", {}).items()} for ddp in ("pytorch_ddp", "fully_sharded")},
        updates={"paper": 20, "tiny": 2}, cuda_only="fully_sharded",
        note=f"{_arch}: --ddp-backend fully_sharded vs pytorch_ddp, one GPU, fp32, 20 updates"))

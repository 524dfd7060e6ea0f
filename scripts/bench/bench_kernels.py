#!/usr/bin/env python
"""Sublayer benchmarks at the sizes of the GPU targets (not a test; numbers for docs/gpu.md).

Stages, each printed and appended to ``--out`` as a markdown table when it finishes (a run cut
off by a time limit keeps the tables of the stages it finished):

``copy``
    the device's copy bandwidth: ``dst.copy_(src)`` of a 1 GiB tensor, bytes read + written per
    second (the physical roofline of a memory-bound op).
``pkm_read``
    the PKM value read ``out[n] = Σ_j w[n, j] V[idx[n, j]]`` and its backward (value and weight
    gradients), dense and sparse, with the fused Triton kernels (``--pkm-kernel triton``) and the
    PyTorch path (``torch``): |K| = 262,144 slots, 4 heads × knn 32 reads a token, 16,384 tokens,
    d 512 and 1024, in ``--dtype``. Bytes moved, counted as the access pattern needs them:
    read = one table row per read + the indices and weights + the output;
    backward = one output-gradient row per read + one table row per distinct row read (the
    weight gradient) + the value gradient written (dense: |K| rows; sparse: the rows read) + the
    indices, weights and weight gradient. "% copy" = (bytes / time) / copy bandwidth.
``pkm_tune``
    the Triton read and its dense backward, both methods (``pkm_triton.BACKWARDS``: a program
    per table row, or per block of sorted reads), at the ``pkm_read`` shapes under every launch
    configuration (columns per program: 256 to the whole row; reads per step; warps), the
    module's default marked: the numbers that pick ``pkm_triton.read_launch``,
    ``backward_launch`` and ``BACKWARD`` for a device.
``pkm_layer``
    a whole PKM layer (query net + batch norm, product-key search, read), forward + backward, ours
    (dense/sparse values × triton/torch) against lucidrains' ``product-key-memory`` (peer, when
    importable: LayerNorm, BatchNorm, and LayerNorm with sparse values) at the same config.
``aop``
    AOP₁ (h 8, d_pk = d_pv = 64, n_p 1536: ``transformer_aop``) and AOP₂ (h 16, d_pk = 64, n_p 512:
    ``transformer_aop_h16``) against the FFN of the same weight count (d 512, FFN 2048, no
    biases), forward + backward; the 16,384 tokens as 1, 4 and 16 SDPA batch entries
    (``AttentionOverParameters.token_groups``: the fused backward's parallelism).

``span``
    the adaptive-span attention sublayer at the paper's small enwik8 configuration (d 512, 8
    heads, block 512, S 8192, batch 64; the block's queries and the cache of previous positions
    the model keeps), forward + backward and peak memory, with every span set so that the
    trimmed window is 64 (the spans' initial value), 1024 or 4096 positions: ours through
    torch's fused attention (``--adaptive-span-kernel sdpa``) and op by op (``explicit``) against
    fairseq's ``examples/adaptive_span`` attention (``MultiHeadSeqAttention``) at the same window.

``synth_gather``
    Synthesizer Random's pad-aware gather of R by advanced indexing (before) and ``index_select``.
``synth_tables``
    Synthesizer Random and Factorized Random layers, ``--synth-table-kernel sdpa`` against
    ``table``, a transformer-base batch of sentences of 32, 64 and 128 tokens, with and without
    padding: the numbers behind ``auto``'s choice per device.
``sdpa_shapes``
    torch's fused attention (``scaled_dot_product_attention``) under each of its backends that
    this device has (torch's own choice, then cuDNN, flash, memory-efficient; the CPU: its choice
    and math), forward + backward in ``--dtype``, at the shapes and layouts a translation model
    gives it: the self-attention of a ``--max-tokens 8192`` batch (8 heads × 64, with the
    encoder's padding mask) as fairseq's attention hands it over (views of time-first
    projections; the float [B, H, 1, T] mask torch's ``multi_head_attention_forward`` makes) and
    as the zoo's does (views of batch-first copies; a [B, 1, 1, T] mask), AOP₁'s attention over
    1,536 parameter slots (all the batch's tokens as one sequence), and fairseq's decoder
    self-attention (its future mask merged with the padding: [B, H, T, T]). For each, the
    first call at each of several shapes the process has not seen (a new batch's) and the calls
    at a shape it has: cuDNN builds an execution graph per shape, so a run whose batches keep
    changing shape (fairseq's) pays the first-call column, a long run mostly the second.

``--size tiny --device cpu`` runs every stage at toy shapes (the harness's test); the Triton
rows then need ``TRITON_INTERPRET=1`` (interpreted kernels, timings meaningless).

    python -m scripts.bench.bench_kernels --device cuda --dtype bf16 --out docs/kernels.md
"""

import argparse
import os
import statistics

import torch
import torch.nn as nn

from scripts.bench.benchlib import format_table, module_timer, peak_memory_mb, time_pair, timer
from fairseq_attnzoo.modules import pkm_triton
from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanAttention
from fairseq_attnzoo.modules.aop import AttentionOverParameters, ffn_matching_slots
from fairseq_attnzoo.modules.pkm import ProductKeyMemory, _WeightedRowSum

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: (|K| = n_keys², heads, knn, k_dim, tokens, value dims, copy MiB) per size
SIZES = {"paper": dict(n_keys=512, heads=4, knn=32, k_dim=256, tokens=16384, dims=(512, 1024),
                       copy_mib=1024, ffn=2048, token_groups=(1, 4, 16),
                       span=dict(batch=64, block=512, d=512, heads=8, max_span=8192,
                                 windows=(64, 1024, 4096)),
                       synth=dict(heads=8, max_len=512, batch=256, length=32, max_pad=12,
                                  d=512, table_len=256, tokens=8192, lengths=(32, 64, 128)),
                       sdpa=dict(batch_tokens=8192, lengths=(17, 23, 31, 42, 57, 77, 101, 127),
                                 tokens=(5000, 5600, 6200, 6800, 7400, 8000))),
         "tiny": dict(n_keys=8, heads=2, knn=4, k_dim=16, tokens=32, dims=(32,), copy_mib=8,
                      ffn=256, token_groups=(1, 2),
                      span=dict(batch=2, block=16, d=32, heads=2, max_span=128, windows=(64, 128)),
                      synth=dict(heads=2, max_len=16, batch=4, length=8, max_pad=3, d=32,
                                 table_len=16, tokens=32, lengths=(8, 16)),
                      sdpa=dict(batch_tokens=64, lengths=(5, 7), tokens=(16, 24)))}


def median_ms(fn, device, repeats):
    """Median milliseconds of ``fn()`` over ``repeats`` calls after a warm-up."""
    return median_runs(timer(fn, device), repeats)


def median_runs(run, repeats):
    for _ in range(min(2, repeats)):  # warm-up (Triton compiles at the first call)
        run()
    return 1000 * statistics.median(run() for _ in range(repeats))


def copy_bandwidth(args, device) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` (GB/s)."""
    n = args.cfg["copy_mib"] << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, args.repeats)
    return 2 * n / ms / 1e6


def kernels(device):
    """The value-read paths to time on this device."""
    probe = torch.empty(1, 1, device=device)
    return ["triton", "torch"] if pkm_triton.available(probe) else ["torch"]


def _read_problem(args, d, device, dtype, g):
    """The value read at the config's size: table, indices, weights, output gradient, and the bytes
    the read and (dense, sparse) backward move (module docstring)."""
    c = args.cfg
    size, m, n = c["n_keys"] ** 2, c["heads"] * c["knn"], c["tokens"]
    e = torch.empty(0, dtype=dtype).element_size()
    table = (torch.randn(size, d, generator=g) * d ** -0.5).to(device, dtype)
    idx = torch.randint(0, size, (n, m), generator=g).to(device)
    w = torch.softmax(torch.randn(n, m, generator=g), -1).to(device, dtype)
    up = torch.randn(n, d, generator=g).to(device, dtype)
    distinct = int(torch.unique(idx).numel())
    small = n * m * (8 + 2 * e)  # indices, weights, weight gradient
    read_bytes = n * m * d * e + n * m * (8 + e) + n * d * e
    back_bytes = {sparse: n * m * d * e + distinct * d * e + (distinct if sparse else size) * d * e
                  + small for sparse in (False, True)}
    return (table, idx, w, up), read_bytes, back_bytes


def pkm_read_rows(args, device, dtype, bandwidth):
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for d in args.cfg["dims"]:
        (table, idx, w, up), read_bytes, back_bytes = _read_problem(args, d, device, dtype, g)
        for sparse in (False, True):
            for kernel in kernels(device):
                fused = kernel == "triton"
                t = table.detach().requires_grad_(True)
                ww = w.detach().requires_grad_(True)
                fwd = median_ms(lambda: _WeightedRowSum.apply(t, idx, ww, sparse, fused), device,
                                args.repeats)
                out = _WeightedRowSum.apply(t, idx, ww, sparse, fused)
                bwd = median_ms(lambda: torch.autograd.grad(out, (t, ww), up, retain_graph=True),
                                device, args.repeats)
                rows.append({
                    "d": d, "values": "sparse" if sparse else "dense", "kernel": kernel,
                    "read ms": fwd, "read GB/s": read_bytes / fwd / 1e6,
                    "read % copy": 100 * read_bytes / fwd / 1e6 / bandwidth,
                    "backward ms": bwd, "backward GB/s": back_bytes[sparse] / bwd / 1e6,
                    "backward % copy": 100 * back_bytes[sparse] / bwd / 1e6 / bandwidth})
                del out
    return rows


def launches(d, rows_per_step, warps):
    """The launch configurations pkm_tune tries for a row of d values: column chunks from 256 to
    the whole row, tiles of at most 16,384 elements."""
    widest = pkm_triton._pow2(d)
    cols = [c for c in (256, 512, 1024, 2048) if c <= widest] or [widest]
    return [pkm_triton.Launch(c, r, wp) for c in cols for r in rows_per_step for wp in warps
            if c * r <= 16384]


def pkm_tune_rows(args, device, dtype, bandwidth, d):
    """The Triton read and its dense backward for value dim ``d`` under each launch configuration
    (column chunk, reads per step, warps), with the module's default marked: which configuration
    the kernels should launch on this device."""
    if "triton" not in kernels(device):
        return []
    g = torch.Generator(device="cpu").manual_seed(0)
    m = args.cfg["heads"] * args.cfg["knn"]
    (table, idx, w, up), read_bytes, back_bytes = _read_problem(args, d, device, dtype, g)
    # (kind, the launch to mark as the module's default or None, launches to try, bytes, run)
    stages = [("read", pkm_triton.read_launch(d, m), launches(d, (8, 16, 32), (2, 4, 8)),
               read_bytes, lambda cfg: pkm_triton.read(table, idx, w, cfg))]
    for method in pkm_triton.BACKWARDS:
        default = pkm_triton.backward_launch(d, method)
        stages.append((
            f"backward {method}", default if method == pkm_triton.BACKWARD else None,
            launches(d, (4, 8, 16), (2, 4, 8)) + [default], back_bytes[False],
            lambda cfg, method=method: pkm_triton.backward(up, table, idx, w, False, True, True,
                                                           cfg, method)))
    rows = []
    for kind, marked, tries, nbytes, run in stages:
        for cfg in sorted(set(tries) | ({marked} if marked else set())):
            ms = median_ms(lambda: run(cfg), device, args.repeats)
            rows.append({"d": d, "kernel": kind, "cols": cfg.cols, "reads/step": cfg.rows,
                         "warps": cfg.warps, "default": "yes" if cfg == marked else "",
                         "ms": ms, "% copy": 100 * nbytes / ms / 1e6 / bandwidth})
    return rows


def _tokens(args, d, device, dtype, batch_first=False, length=128):
    n = args.cfg["tokens"]
    t = length if n % length == 0 else n
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(t, n // t, d, generator=g)
    x = x.transpose(0, 1).contiguous() if batch_first else x
    return x.to(device, dtype).requires_grad_(True)


def peer_memory(args, d, use_layernorm, sparse):
    from product_key_memory import PKM

    c = args.cfg
    m = PKM(d, heads=c["heads"], num_keys=c["n_keys"], topk=c["knn"], dim_head=c["k_dim"] // 2,
            use_layernorm=use_layernorm)
    m.values.sparse = sparse
    return m


def peer_mode_ms(args, d, use_layernorm, sparse, device, dtype, x_dtype, autocast):
    """Median fwd+bwd milliseconds of the peer in one mode, or why it did not run."""
    try:
        torch.manual_seed(0)
        peer = peer_memory(args, d, use_layernorm, sparse).to(device, dtype)
        # sequences of dim_head tokens: without a mask the peer's BatchNorm1d(dim_head) gets its
        # queries as [sequences·2·heads, time, dim_head] and takes the time axis for its channels,
        # so that mode runs only when the two are equal (128 = 256 / 2 at the paper's config)
        x = _tokens(args, d, device, x_dtype, batch_first=True, length=args.cfg["k_dim"] // 2)
        return median_runs(module_timer(peer, (x,), False, device, autocast), args.repeats)
    except ImportError:
        return "not installed"
    except Exception as exc:  # a peer mode that does not run in this dtype/device
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


PEERS = (("peer LayerNorm", True, False), ("peer BatchNorm", False, False),
         ("peer LayerNorm sparse", True, True))


def pkm_layer_rows(args, device, dtype):
    c = args.cfg
    rows = []
    for d in c["dims"]:
        peers, peer_modes = {}, {}
        for name, ln, sparse in PEERS:
            peers[name] = peer_mode_ms(args, d, ln, sparse, device, dtype, dtype, None)
            peer_modes[name] = DTYPE_NAMES[dtype]
            if isinstance(peers[name], str) and dtype != torch.float32 and "not" not in peers[name]:
                # e.g. bf16 on CUDA: the peer's nn.EmbeddingBag has no bf16 weight gradient;
                # its half-precision mode is then float32 weights under autocast
                peers[name] = peer_mode_ms(args, d, ln, sparse, device, torch.float32,
                                           torch.float32, dtype)
                peer_modes[name] = f"fp32 weights, {DTYPE_NAMES[dtype]} autocast"
        for sparse in (False, True):
            for kernel in kernels(device):
                torch.manual_seed(0)
                m = ProductKeyMemory(d, d, n_keys=c["n_keys"], heads=c["heads"], knn=c["knn"],
                                     k_dim=c["k_dim"], sparse=sparse, kernel=kernel)
                m = m.to(device, dtype)
                x = _tokens(args, d, device, dtype)
                ms = median_runs(module_timer(m, (x,), False, device), args.repeats)
                row = {"d": d, "values": "sparse" if sparse else "dense", "kernel": kernel,
                       "ours ms": ms}
                for name, peer_ms in peers.items():
                    row[f"{name} mode"] = peer_modes[name]
                    row[f"{name} ms"] = peer_ms
                    row[f"{name} / ours"] = peer_ms / ms if isinstance(peer_ms, float) else ""
                rows.append(row)
    return rows


def aop_rows(args, device, dtype):
    c = args.cfg
    d, ffn_dim = c["dims"][0], c["ffn"]
    rows = []
    for heads, width in ((8, 1), (16, 2)):  # transformer_aop, transformer_aop_h16: h·d_pk = w·d
        head_dim = width * d // heads
        slots = ffn_matching_slots(d, ffn_dim, heads, head_dim, head_dim)
        torch.manual_seed(0)
        aop = AttentionOverParameters(d, heads, head_dim, head_dim, slots).to(device, dtype)
        ffn = nn.Sequential(nn.Linear(d, ffn_dim, bias=False), nn.ReLU(),
                            nn.Linear(ffn_dim, d, bias=False)).to(device, dtype)
        x = _tokens(args, d, device, dtype)
        for groups in c["token_groups"]:
            aop.token_groups = groups
            a_ms, f_ms = time_pair(module_timer(aop, (x,), False, device),
                                   module_timer(ffn, (x,), False, device), repeats=args.repeats)
            rows.append({"case": f"AOP h {heads}, n_p {slots}", "token groups": groups, "d": d,
                         "FFN": ffn_dim, "params": sum(p.numel() for p in aop.parameters()),
                         "FFN params": sum(p.numel() for p in ffn.parameters()),
                         "AOP ms": a_ms, "FFN ms": f_ms, "ratio": a_ms / f_ms,
                         "target": "<= 1.15"})
    return rows


class _SpanBlock(nn.Module):
    """An adaptive-span attention over a block and the cache before it (what a layer runs in
    training), returning the attention output only: ours, or fairseq's example's module."""

    def __init__(self, att, memory, key_pe=None):
        super().__init__()
        self.att, self.memory, self.key_pe = att, memory, key_pe

    def forward(self, x):
        if self.key_pe is None:  # ours
            return self.att(x, memory=self.memory)[0]
        h = torch.cat([self.memory, x], dim=1)  # fairseq's TransformerSeqLayer
        return self.att(x, h, h, self.key_pe)


def synth_gather_rows(args, device, dtype):
    """Synthesizer Random's pad-aware logits R[h, qpos, kpos] for a left-padded batch, forward +
    backward: ours (``index_select`` of the flattened table; backward ``index_add_``) against
    advanced indexing (backward: a sorted ``index_put_``), the gather before this change. The
    default shape is a transformer-base batch of --max-tokens 8192 (256 sentences of 32)."""
    from fairseq_attnzoo.modules.synthesizer import _select_positions

    c = args.cfg["synth"]
    h, n, b, t = c["heads"], c["max_len"], c["batch"], c["length"]
    g = torch.Generator(device="cpu").manual_seed(3)
    table = torch.randn(h, n, n, generator=g).to(device, dtype).requires_grad_(True)
    pad = torch.randint(0, c["max_pad"] + 1, (b,), generator=g)
    pos = (torch.arange(t)[None] - pad[:, None]).clamp(min=0).to(device)
    weights = torch.randn(b, h, t, t, generator=g).to(device, dtype)
    heads = torch.arange(h, device=device)
    ways = {"index_select (ours)": lambda: _select_positions(
                table.flatten(1, 2), pos[:, :, None] * n + pos[:, None, :]),
            "advanced indexing (before)": lambda: table[
                heads[None, :, None, None], pos[:, None, :, None], pos[:, None, None, :]]}
    outs = {name: way() for name, way in ways.items()}
    assert torch.equal(*outs.values())

    def step(way):
        table.grad = None
        (way() * weights).sum().backward()

    ours, before = time_pair(timer(lambda: step(ways["index_select (ours)"]), device),
                             timer(lambda: step(ways["advanced indexing (before)"]), device),
                             repeats=args.repeats)
    shape = f"h {h}, N {n}, {b} x {t} tokens, left pad <= {c['max_pad']}"
    return [{"gather": name, "shape": shape, "fwd+bwd ms": ms, "vs before": ms / before}
            for name, ms in (("index_select (ours)", ours), ("advanced indexing (before)", before))]


class _SelfAttention(nn.Module):
    """``att`` called as fairseq's self-attention with a fixed padding mask."""

    def __init__(self, att, pad):
        super().__init__()
        self.att, self.pad = att, pad

    def forward(self, x):
        return self.att(x, x, x, key_padding_mask=self.pad)[0]


def synth_table_rows(args, device, dtype):
    """Synthesizer Random and Factorized Random, one self-attention layer forward + backward,
    with ``--synth-table-kernel sdpa`` (dot products through the fused kernel) against ``table``
    (materialized logits): a transformer-base batch (--max-tokens 8192 as sentences of each
    length), no padding or the encoder's left padding (up to a third of the length). Timed
    alternately; the ratio says which kernel ``auto`` should pick on this device."""
    from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

    c = args.cfg["synth"]
    d, h, n = c["d"], c["heads"], c["table_len"]
    rows = []
    for mode in ("random", "factorized_random"):
        for length in c["lengths"]:
            b = c["tokens"] // length
            g = torch.Generator(device="cpu").manual_seed(4)
            x = torch.randn(length, b, d, generator=g).to(device, dtype).requires_grad_(True)
            lead = torch.randint(0, length // 3 + 1, (b,), generator=g)
            lead[0] = 0
            left = (torch.arange(length)[None] < lead[:, None]).to(device)
            for padding, pad in (("none", None), ("left", left)):
                timers = {}
                for kernel in ("sdpa", "table"):
                    torch.manual_seed(0)
                    m = SynthesizerAttention(d, h, components=(mode,), max_len=n,
                                             table_kernel=kernel).to(device, dtype).train()
                    timers[kernel] = module_timer(_SelfAttention(m, pad), (x,), False, device)
                sdpa, table = time_pair(timers["sdpa"], timers["table"], repeats=args.repeats)
                rows.append({"mode": mode, "tokens": f"{b} x {length}", "padding": padding,
                             "sdpa ms": sdpa, "table ms": table, "sdpa / table": sdpa / table})
    return rows


def span_rows(args, device, dtype):
    c = args.cfg["span"]
    ramp, s = 32, c["max_span"]
    g = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(c["batch"], c["block"], c["d"], generator=g).to(device, dtype)
    x.requires_grad_(True)
    rows = []
    for window in c["windows"]:
        ratio = (window - ramp) / s  # max z + R = window: the trimmed window is `window`
        # the cache the model keeps: the window + 64 positions (its --adaptive-span-cache-buffer)
        memory = torch.randn(c["batch"], window - 1 + 64, c["d"], generator=g).to(device, dtype)
        timed = {}
        for kernel in ("sdpa", "explicit"):
            torch.manual_seed(0)
            att = AdaptiveSpanAttention(c["d"], c["heads"], s, ramp=ramp, span_init=ratio,
                                        own_key_pe=True, kernel=kernel)
            assert att.mask.window(att.mask.spans()) == window
            timed[f"ours {kernel}"] = _SpanBlock(att, memory).to(device, dtype)
        try:
            from fairseq.examples.adaptive_span.adaptive_span_model import MultiHeadSeqAttention

            torch.manual_seed(0)
            example = MultiHeadSeqAttention(c["d"], c["heads"], attn_span=s, dropout=0.0,
                                            adapt_span_layer=False, adapt_span_ramp=ramp,
                                            adapt_span_init=ratio)
            key_pe = nn.Parameter(torch.randn(1, c["d"] // c["heads"], s))
            timed["fairseq example"] = _SpanBlock(example, memory, key_pe).to(device, dtype)
        except ImportError:
            pass
        ms = {name: median_runs(module_timer(m, (x,), False, device), args.repeats)
              for name, m in timed.items()}
        mb = {name: peak_memory_mb(lambda: module_timer(m, (x,), False, device)(), device)
              for name, m in timed.items()}
        base = "fairseq example" if "fairseq example" in ms else "ours explicit"
        for name, m in timed.items():
            kept = (m.att.mask.window(m.att.mask.spans()) if m.key_pe is None
                    else s - m.att.attn.adaptive_span.get_trim_len())  # as rounded in its dtype
            rows.append({"window": window, "attention": name, "keys kept": kept,
                         "fwd+bwd ms": ms[name],
                         "speed vs " + base: ms[base] / ms[name], "peak MB": mb[name],
                         "memory vs " + base: mb[name] / mb[base] if mb[base] > 0 else ""})
    return rows


def sdpa_backends(device):
    """(name, context manager factory) of the SDPA backends to try on ``device``: torch's choice
    first, then each fused backend on CUDA (the CPU has one fused kernel and the math path)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
             ("efficient", SDPBackend.EFFICIENT_ATTENTION)) if device.type == "cuda" else (
             ("math", SDPBackend.MATH),)
    return [("torch's choice", contextlib.nullcontext)] + [
        (name, lambda b=backend: sdpa_kernel(b)) for name, backend in names]


#: sdpa_shapes' cases: (kind, row name)
SDPA_CASES = (("fairseq", "self-attention, fairseq's layout (time-first), padding mask"),
              ("zoo", "self-attention, the zoo's layout (batch-first), padding mask"),
              ("aop", "attention over 1536 parameter slots (AOP₁)"),
              ("causal", "decoder self-attention, fairseq's layout, causal + padding mask"))


def _sdpa_call(shape, i, device, dtype):
    """Inputs and a forward + backward of SDPA for case ``shape`` = (kind, b, t), 8 heads of 64,
    laid out as each caller hands them over (cuDNN's graphs depend on the strides too): fairseq's
    self-attention (kind "fairseq": views of time-first [t, b, 512] projections and, for the
    encoder's left padding, the additive [b, 8, 1, t] mask torch's ``multi_head_attention_forward``
    makes), the zoo's (kind "zoo": views of batch-first [b, t, 512] copies, an additive [b, 1, 1,
    t] mask of the dtype's finite minimum) or AOP₁'s (kind "aop": all t tokens as one batch-first
    sequence of queries over [1, 8, 1536, 64] keys and values that are parameters). ``i`` seeds
    the data."""
    kind, b, t = shape
    heads, dk = 8, 64
    g = torch.Generator(device="cpu").manual_seed(i)

    def leaf(*size):
        return torch.randn(*size, generator=g).to(device, dtype).requires_grad_(True)

    mask = None
    if kind == "aop":
        q = leaf(1, t, heads, dk).transpose(1, 2)
        k, v = leaf(1, heads, 1536, dk), leaf(1, heads, 1536, dk)
    else:
        lead = torch.randint(0, t // 3 + 1, (b,), generator=g)
        pad = (torch.arange(t)[None, :] < lead[:, None])[:, None, None, :]
        if kind in ("fairseq", "causal"):
            q, k, v = (leaf(t, b, heads * dk).view(t, b * heads, dk).transpose(0, 1)
                       .view(b, heads, t, dk) for _ in range(3))
            if kind == "causal":  # right-padded targets, fairseq's future mask merged in
                pad = pad.flip(-1)
            mask = torch.zeros(b, 1, 1, t).masked_fill(pad, float("-inf"))
            if kind == "causal":
                mask = mask + torch.triu(torch.full((t, t), float("-inf")), 1)
            mask = mask.expand(b, heads, -1, t).contiguous().to(device, dtype)
        else:
            q, k, v = (leaf(b, t, heads * dk).view(b, t, heads, dk).transpose(1, 2)
                       for _ in range(3))
            mask = torch.zeros(b, 1, 1, t).masked_fill(pad, torch.finfo(dtype).min)
            mask = mask.to(device, dtype)
    grad = torch.randn(q.shape[:-1] + (v.size(-1),), generator=g).to(device, dtype)

    def call():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(grad)

    return call


def sdpa_shape_rows(args, device, dtype):
    """``sdpa_shapes``: per case and backend, over several shapes the process has not seen
    (medians over the shapes): the first forward + backward at the shape, the same call again
    once the shape is known (median of ``--repeats``), and their difference, the cost of a new
    shape. Every backend gets shapes of its own (torch's choice may be cuDNN, whose graph cache
    the cuDNN row would otherwise find filled)."""
    import warnings

    c = args.cfg["sdpa"]
    rows = []
    for case, (kind, name) in enumerate(SDPA_CASES):
        sizes = c["tokens"] if kind == "aop" else c["lengths"]
        for index, (backend, context) in enumerate(sdpa_backends(device)):
            # shapes unseen by this process: each case's and backend's lengths shifted apart
            shift = 4 * case + index
            shapes = [("aop", 1, t + 8 * shift) if kind == "aop" else
                      (kind, c["batch_tokens"] // (t + shift), t + shift) for t in sizes]
            # and a warm-up at a shape of its own (libraries load, handles are made at the
            # first call of a backend)
            warm_up = (kind, 1, 8 + shift)
            row = {"case": name,
                   "shapes": (f"{shapes[0][1]} x {shapes[0][2]} .. {shapes[-1][1]} x "
                              f"{shapes[-1][2]}"), "backend": backend}
            try:
                with warnings.catch_warnings(), context():
                    warnings.simplefilter("ignore")  # (torch explains each kernel it skips)
                    _sdpa_call(warm_up, 0, device, dtype)()
                    first, seen = [], []
                    for i, shape in enumerate(shapes):  # its first call, then it again
                        run = timer(_sdpa_call(shape, i, device, dtype), device)
                        first.append(1000 * run())
                        seen.append(median_runs(run, args.repeats))
            except RuntimeError as e:  # a backend that cannot take this case
                rows.append({**row, "first call ms": "n/a: " + str(e).splitlines()[0][:80]})
                continue
            rows.append({**row, "first call ms": statistics.median(first),
                         "seen shape ms": statistics.median(seen),
                         "cost of a new shape ms": statistics.median(
                             a - b for a, b in zip(first, seen))})
    return rows


#: environment variables of torch's that the report's head line names when set: cuDNN's
#: attention then builds one graph for a range of sequence lengths instead of one per shape
#: (an opt-in of torch >= 2.9, pytorch/pytorch#155958; the sdpa_shapes stage run with and without)
ENV_NOTED = ("TORCH_CUDNN_SDPA_AVOID_RECOMPILE",)

STAGES = ("copy", "pkm_read", "pkm_tune", "pkm_layer", "aop", "span", "synth_gather",
          "synth_tables", "sdpa_shapes")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--size", choices=sorted(SIZES), default="paper")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="append the tables to this markdown file")
    args = p.parse_args(argv)
    args.cfg = SIZES[args.size]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = (f"device {name}, torch {torch.__version__}, {args.dtype}, size {args.size}, "
            f"medians of {args.repeats}")
    for var in ENV_NOTED:  # settings of torch's that change what a stage measures
        if os.environ.get(var):
            head += f", {var}={os.environ[var]}"
    print(head, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{head}\n")
    bandwidth = None
    for stage in args.stages:
        if stage == "copy" or (stage in ("pkm_read", "pkm_tune") and bandwidth is None):
            bandwidth = copy_bandwidth(args, device)
            rows = [{"stage": "copy", "bytes": args.cfg["copy_mib"] << 20,
                     "GB/s (read + write)": bandwidth}]
            if stage == "copy":
                emit(args, "copy bandwidth", rows)
                continue
        if stage == "pkm_read":
            rows = pkm_read_rows(args, device, dtype, bandwidth)
        elif stage == "pkm_tune":  # a table per value dim (the sweep is the longest stage)
            for d in args.cfg["dims"]:
                emit(args, f"pkm_tune d {d}", pkm_tune_rows(args, device, dtype, bandwidth, d))
            continue
        elif stage == "pkm_layer":
            rows = pkm_layer_rows(args, device, dtype)
        elif stage == "span":
            rows = span_rows(args, device, dtype)
        elif stage == "synth_gather":
            rows = synth_gather_rows(args, device, dtype)
        elif stage == "synth_tables":
            rows = synth_table_rows(args, device, dtype)
        elif stage == "sdpa_shapes":
            rows = sdpa_shape_rows(args, device, dtype)
        else:
            rows = aop_rows(args, device, dtype)
        emit(args, stage, rows)


def emit(args, title, rows):
    table = f"\n{title}\n\n{format_table(rows)}"
    print(table, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table)


if __name__ == "__main__":
    main()

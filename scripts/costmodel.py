"""The cost model of a layer, op by op, from a trace on the ``meta`` device (no compute: the paper
shapes trace on any machine).

A layer (a module and its inputs, built on ``meta``) runs forward and backward under a
``TorchDispatchMode`` that records every ATen op: where it was called (the innermost function of
``fairseq_attnzoo``, or in the backward the autograd node), the bytes it reads and writes, and
its FLOPs by ``torch.utils.flop_counter``'s formulas (matmuls, attention; other ops count 0).
Bytes are counted as an op needs them, not as a cache might save them: every input read once and
every output written once, views and fresh allocations free, a gather (``index_select``,
``gather``, embedding bags) reading one source element or row per index, a scatter touching one
target element per source element, a fill writing without reading. The floor of an op on an
H100 is ``max(bytes / bandwidth, FLOPs / peak)``, with the datasheet's peaks (:data:`H100`).

The tables sit in docs/pkm.md and docs/aop.md between ``<!-- costmodel: LAYER -->`` and
``<!-- /costmodel -->`` (the block mechanism of :mod:`scripts.bench.tables`)::

    python -m scripts.costmodel            # rewrite the tables
    python -m scripts.costmodel --check    # (a test runs this)

The fused product-key search's kernels are modelled by their compiled code instead (ATen sees one
custom op): :func:`search_model`, ``python -m scripts.costmodel search`` (the table between
``<!-- kernelmodel: search -->`` and ``<!-- /kernelmodel -->`` in docs/performance.md; it compiles
the kernels, a few minutes on a CPU, so no test runs it).
"""

import contextlib
import json
import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from scripts.bench.cases import pkm_parts
from scripts.bench.harness import REPO
from scripts.bench import tables

DOCS = [os.path.join(REPO, "docs", "pkm.md"), os.path.join(REPO, "docs", "aop.md")]

#: NVIDIA H100 SXM5 (80 GB HBM3), from NVIDIA's "H100 Tensor Core GPU" datasheet: memory bandwidth
#: 3.35 TB/s; dense (no structured sparsity) BF16/FP16 Tensor Core 989.4 TFLOP/s; FP32 (no TF32,
#: torch's default for float32 matmuls) 66.9 TFLOP/s. The harness's own device rows
#: (``device/copy``, ``device/matmul`` in docs/benchmarks.jsonl) measured 2.98 TB/s and 751 TFLOP/s.
H100 = {"bandwidth": 3.35e12, "flops": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12,
                                        torch.float32: 66.9e12}}
H100_SOURCE = ("NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989.4 TFLOP/s dense BF16/FP16, "
               "66.9 TFLOP/s FP32 (no TF32)")

#: ops whose tensor inputs are not read (sizes, allocations, fills)
NO_READ = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like",
           "new_zeros", "new_ones", "new_full", "zero_", "fill_"}
#: ops that allocate without writing
NO_WRITE = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
#: gathers: argument positions of the sources and of the index; a source is read once per
#: index -- an element (the output's bytes) or, for the embedding bags, a row -- not whole
GATHERS = {"index_select": ((0,), 2), "gather": ((0,), 2), "embedding": ((0,), 1),
           "_embedding_bag": ((0,), 1), "_embedding_bag_forward_only": ((0,), 1),
           "_embedding_bag_per_sample_weights_backward": ((0, 1), 2)}
#: scatters: argument position of the target, of the source; one target element per source
#: element is read and written
SCATTERS = {"scatter_add_": (0, 3), "scatter_add": (0, 3), "index_copy_": (0, 3),
            "index_copy": (0, 3), "index_add_": (0, 3), "index_put_": (0, 2)}


def _bytes(t: torch.Tensor) -> int:
    """The bytes of a tensor as an op reads it: a broadcast (stride 0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


@dataclass
class Op:
    phase: str  # "forward" | "backward"
    site: str  # the function (or autograd node) that called it
    name: str  # the ATen op
    read: int
    written: int
    flops: int
    dtype: torch.dtype  # of its first floating input (the peak its FLOPs run at)

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def floor_s(self, device=H100) -> float:
        peak = device["flops"].get(self.dtype, device["flops"][torch.float32])
        return max(self.bytes / device["bandwidth"], self.flops / peak)


def op_cost(func, args, kwargs, out) -> Optional[Tuple[int, int, int]]:
    """(bytes read, bytes written, FLOPs) of one ATen call, None for a view (no data moves)."""
    schema = func._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return None
    name = func.overloadpacket.__name__
    if name == "_unsafe_view" or name == "detach":
        return None
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    flops = (flop_registry[func.overloadpacket](  # (less an out_dtype: bmm.dtype's formula
        *[a for a in args if not isinstance(a, torch.dtype)], **kwargs, out_val=out)  # is bmm's)
        if func.overloadpacket in flop_registry else 0)
    read = 0 if name in NO_READ else sum(_bytes(t) for t in ins)
    written = 0 if name in NO_WRITE else sum(t.numel() * t.element_size() for t in outs)
    if name in GATHERS:
        sources, at = GATHERS[name]
        index = args[at]
        for src in (args[i] for i in sources):
            gathered = (outs[0].numel() * outs[0].element_size() if name in ("index_select",
                        "gather", "embedding") else index.numel() * src[0].numel()
                        * src.element_size())
            read += gathered - _bytes(src)
    elif name in SCATTERS:
        target, source = (args[i] for i in SCATTERS[name])
        touched = source.numel() * target.element_size()
        read += touched - _bytes(target)
        written += touched - target.numel() * target.element_size()
    return read, written, flops


def _site(package: str) -> str:
    """The innermost function of ``package`` on the stack (its qualified name) and the code of
    the line it is at, else the autograd node running (a builtin derivative in the backward),
    else the caller."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if package in code.co_filename:
            line = linecache.getline(code.co_filename, frame.f_lineno).strip()
            line = line if len(line) <= 48 else line[:45] + "..."
            return f"{code.co_qualname.split('.<locals>')[0]}: `{line}`".replace("|", "\\|")
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else "(caller)"


class Trace(TorchDispatchMode):
    """Records every ATen op with its costs (:class:`Op`) into ``ops``; ``phase`` labels them."""

    def __init__(self, package: str = "fairseq_attnzoo"):
        super().__init__()
        self.ops: List[Op] = []
        self.phase = "forward"
        self.package = os.sep + package + os.sep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            floats = [t.dtype for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.ops.append(Op(self.phase, _site(self.package), func.overloadpacket.__name__,
                               *cost, floats[0] if floats else torch.float32))
        return out


def trace(build: Callable, setup: Callable = contextlib.nullcontext) -> List[Op]:
    """The ops of a warm forward and backward of ``build() -> (module, inputs)`` on ``meta``
    (the output's gradient given, so no loss ops), under the context ``setup()``: the second
    step, after one that made the layer's cached constants."""
    with setup(), torch.device("meta"):
        module, inputs = build()
        for _ in range(2):
            module.zero_grad(set_to_none=True)  # (no accumulation into the first step's)
            for t in inputs:
                t.grad = None
            rec = Trace()
            with rec:
                out = module(*inputs)
                rec.phase = "backward"
                torch.autograd.backward(out, torch.empty_like(out))
    return rec.ops


@dataclass
class Layer:
    """A layer to model: ``build(p) -> (module, inputs)`` on the current (meta) device at
    parameters ``p``; ``shapes``: name -> parameters (the first is the table's); ``growth``: the
    parameters doubled for the growth columns; ``records``: (case, shape substrings[, the
    baseline's name: default the FFN it replaces]) of the benchmark records that measured it."""
    name: str
    title: str
    build: Callable
    shapes: Dict[str, dict]
    growth: Tuple[str, ...] = ()
    setup: Callable = contextlib.nullcontext
    records: List[tuple] = field(default_factory=list)
    budget: Optional[int] = None  # bytes the paper shape may move, forward and backward
    # kernels a trace cannot run, modelled: (layer, its traced rows by shape) -> text
    modelled: Optional[Callable[["Layer", Dict[str, Dict[tuple, dict]]], str]] = None
    #: ``parts(module, *inputs) -> {name: call}``: the layer's parts, each traced alone at the
    #: first shape (a table of their floors; the rest = the layer less their sum)
    parts: Optional[Callable] = None


def rows(ops: List[Op]) -> Dict[tuple, dict]:
    """The ops summed by (pass, where, op), in order of first call."""
    out: Dict[tuple, dict] = {}
    for op in ops:
        if not op.bytes and not op.flops:  # an allocation
            continue
        r = out.setdefault((op.phase, op.site, op.name),
                           {"calls": 0, "bytes": 0, "flops": 0, "floor": 0.0})
        r["calls"] += 1
        r["bytes"] += op.bytes
        r["flops"] += op.flops
        r["floor"] += op.floor_s()
    return out


def model(layer: Layer) -> Dict[str, Dict[tuple, dict]]:
    """Rows of every shape, and of the first shape with each ``growth`` parameter doubled."""
    first = next(iter(layer.shapes.values()))
    shapes = dict(layer.shapes)
    for g in layer.growth:
        shapes[f"{g} x2"] = dict(first, **{g: 2 * first[g]})
    return {k: rows(trace(lambda p=p: layer.build(p), layer.setup)) for k, p in shapes.items()}


def part_rows(layer: Layer, whole: Dict[tuple, dict]) -> List[dict]:
    """A row per part of the layer (:attr:`Layer.parts`) at its first shape: its ops' bytes,
    FLOPs and floor, each part traced alone after one untraced call; then the rest (the layer's
    forward and backward, ``whole``: :func:`model`'s rows of that shape, less the parts) and the
    layer."""
    p = next(iter(layer.shapes.values()))
    out = []
    with layer.setup(), torch.device("meta"):
        module, inputs = layer.build(p)
        for name, call in layer.parts(module, *inputs).items():
            call()  # (the cached constants)
            rec = Trace()
            with rec:
                call()
            out.append({"part": name, **_summed(rows(rec.ops).values())})
    whole = _summed(whole.values())
    rest = {k: round(whole[k] - sum(r[k] for r in out), 6) or 0 for k in whole}
    return out + [{"part": "the rest", **rest}, {"part": "**the layer**", **whole}]


def _summed(rs) -> dict:
    rs = list(rs)
    return {"calls": sum(r["calls"] for r in rs), "MB": sum(r["bytes"] for r in rs) / 1e6,
            "GFLOP": sum(r["flops"] for r in rs) / 1e9,
            "floor µs": sum(r["floor"] for r in rs) * 1e6}


def total_bytes(layer: Layer, shape: Optional[str] = None) -> int:
    p = layer.shapes[shape or next(iter(layer.shapes))]
    return sum(op.bytes for op in trace(lambda: layer.build(p), layer.setup))


def _growth(base: dict, other: Optional[dict]) -> str:
    if other is None:
        return "–"
    return f"×{other['floor'] / base['floor']:.2f}" if base["floor"] else "–"


def measured(layer: Layer, records) -> List[str]:
    """One line per benchmark record of the layer's first shape (the latest of each row)."""
    latest = {}
    for r in records:  # (a record's baseline: the FFN it replaces, unless the entry names it)
        for case, parts, *baseline in layer.records:
            if r["case"] == case and all(s in r["row"].get("shape", "") for s in parts) \
                    and r["row"].get("ms") is not None:
                latest[(r["device"], r["row"]["shape"])] = r, (baseline or ["the FFN it "
                                                                            "replaces"])[0]
    out = []
    for (device, shape), (r, baseline) in latest.items():
        row = r["row"]
        base = (f"; {baseline} {row['baseline ms']:.2f} ms (ratio {row['ratio']:.2f})"
                if row.get("baseline ms") else "")
        out.append(f"- {device}, `{r['case']}` {shape}: {row['ms']:.2f} ms{base} "
                   f"(commit {r['commit']}, {r['run']})\n")
    return out


def _cell(column: str, v) -> str:
    return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def render(layer: Layer, records) -> str:
    models = model(layer)
    names = list(layer.shapes)
    out = [f"{layer.title}. {H100_SOURCE}; floor = max(bytes / bandwidth, FLOPs / peak at the op's "
           "dtype), summed over the ops (no overlap). Growth: the floor with that parameter "
           "doubled, over the floor here (– : the op is not there).\n\n"]
    for i, shape in enumerate(names):
        table = []
        for key, r in models[shape].items():
            row = {"pass": key[0], "where": key[1], "op": key[2], "calls": r["calls"],
                   "MB": r["bytes"] / 1e6, "GFLOP": r["flops"] / 1e9, "floor µs": r["floor"] * 1e6}
            if i == 0:
                for g in layer.growth:
                    row[f"{g} ×2"] = _growth(r, models[f"{g} x2"].get(key))
            table.append(row)
        rs = models[shape].values()
        total = {"pass": "**total**", **_summed(rs)}
        if i == 0:
            for g in layer.growth:
                other = models[f"{g} x2"].values()
                grown = sum(r["floor"] for r in other) / sum(r["floor"] for r in rs)
                total[f"{g} ×2"] = f"×{grown:.2f}"
        table.append(total)
        out.append(f"**{shape}**: `{json.dumps(layer.shapes[shape])}`\n\n")
        out.append(tables.format_table(table, cell=_cell) + "\n")
    if layer.modelled:
        out.append(layer.modelled(layer, models))
    if layer.parts:
        out.append(f"**By part** ({names[0]}: the calls of the benchmark case `pkm/layer-parts`, "
                   "each traced alone; the rest = the layer less the parts: 0 where the parts "
                   "hold every op of the layer, as here, so that the rest of a measured layer "
                   "is the host's: dispatch, autograd):\n\n")
        out.append(tables.format_table(part_rows(layer, models[names[0]]), cell=_cell) + "\n")
    lines = measured(layer, records)
    out.append(("Measured (docs/benchmarks.jsonl, the latest record of each row):\n"
                + "".join(lines)) if lines else "No benchmark record of this shape yet.\n")
    if layer.budget:
        out.append(f"\nBudget (tests/test_costmodel.py): the first shape moves at most "
                   f"{layer.budget / 1e9:.2f} GB forward and backward.\n")
    return "".join(out)


# ---- the layers ------------------------------------------------------------------------------

def _pkm(p):
    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    m = ProductKeyMemory(p["d"], p["d"], n_keys=p["n_keys"], heads=p["heads"], knn=p["knn"],
                         k_dim=p["k_dim"], kernel="torch").to(torch.bfloat16).train()
    x = torch.empty(128, p["tokens"] // 128, p["d"], dtype=torch.bfloat16, requires_grad=True)
    return m, (x,)


@contextlib.contextmanager
def _pkm_setup():
    """The search as it runs on CUDA (meta tensors are not CUDA ones): one chunk of tokens, the
    half-precision score GEMM writing float32 itself."""
    from fairseq_attnzoo.modules import pkm_search as search

    saved = search._SCORE_CHUNK, search.HALF_GEMM_ON
    search._SCORE_CHUNK, search.HALF_GEMM_ON = 1 << 62, search.HALF_GEMM_ON + ("meta",)
    try:
        yield
    finally:
        search._SCORE_CHUNK, search.HALF_GEMM_ON = saved


def _aop(p):
    from fairseq_attnzoo.modules.aop import AttentionOverParameters, ffn_matching_slots

    dk = p["width"] * p["d"] // p["heads"]
    slots = ffn_matching_slots(p["d"], p["ffn"], p["heads"], dk, dk)
    m = AttentionOverParameters(p["d"], p["heads"], dk, dk, slots).to(torch.bfloat16).train()
    m.token_groups = p["groups"]
    x = torch.empty(128, p["tokens"] // 128, p["d"], dtype=torch.bfloat16, requires_grad=True)
    return m, (x,)


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` (no mask, no dropout) as the fused flash kernel, whose
    meta kernels and FLOP formulas torch has: on ``meta`` SDPA would pick its math fallback,
    which materialises the scores that a GPU's fused kernels never write."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None
                and not kwargs.get("dropout_p") and not kwargs.get("is_causal") and len(args) == 3):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                *args, 0.0, False, False, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def _value_kernels(layer: Layer, models: Dict[str, Dict[tuple, dict]]) -> str:
    """The Triton value backward (what CUDA runs instead of the ``_WeightedRowSum.backward``
    rows above), modelled: its DRAM bytes and floor against the traced PyTorch path's."""
    out = ["\n**The value backward on CUDA, modelled** (`pkm_triton.backward_traffic`; the "
           "Triton kernels of modules/pkm_triton.py, which a trace on `meta` cannot run; bf16: "
           "the blocks kernel). DRAM: each tensor once; the output gradient's row gathers are "
           "served from L2 (it fits) and count in no floor. Floor = DRAM bytes / bandwidth.\n\n"]
    from fairseq_attnzoo.modules.pkm_triton import backward_traffic

    for shape, p in layer.shapes.items():
        steps = backward_traffic(p, 2)
        table = [{"step": step, "DRAM MB": dram / 1e6, "L2 gathers MB": l2 / 1e6,
                  "floor µs": dram / H100["bandwidth"] * 1e6} for step, dram, l2 in steps]
        dram, l2 = sum(s[1] for s in steps), sum(s[2] for s in steps)
        value_sites = ("_WeightedRowSum.backward", "read_dots", "row_ranges")
        traced = sum(r["floor"] for (phase, site, _), r in models[shape].items()
                     if phase == "backward" and site.split(":")[0] in value_sites)
        table.append({"step": "**total**", "DRAM MB": dram / 1e6, "L2 gathers MB": l2 / 1e6,
                      "floor µs": dram / H100["bandwidth"] * 1e6})
        out.append(f"*{shape}*: the PyTorch path's value backward above counts every gather as "
                   f"DRAM: floor {traced * 1e6:,.1f} µs.\n\n")
        out.append(tables.format_table(table, cell=_cell) + "\n")
    return "".join(out)


PKM_SHAPE = dict(tokens=16384, n_keys=512, heads=4, knn=32, k_dim=256, d=512)
LAYERS = {l.name: l for l in [
    Layer("pkm", "ProductKeyMemory (dense values, PyTorch value path, search as on CUDA: one "
          "chunk), bf16, forward and backward", _pkm,
          {"paper shape": PKM_SHAPE,
           "1M slots (the memory code's n_keys 1024, d 1024)": dict(PKM_SHAPE, n_keys=1024,
                                                                   d=1024)},
          growth=("n_keys", "knn", "d"), setup=_pkm_setup, parts=pkm_parts,
          records=[("pkm/layer-vs-ffn", ("n_keys 512,", "knn 32,", "tokens 16384,", "d 512,",
                                         "impl dense")),
                   ("pkm/layer-vs-ffn", ("n_keys 512,", "knn 32,", "tokens 16384,", "d 512,",
                                         "impl defaults")),
                   ("pkm/layer-parts", ("n_keys 512,", "knn 32,", "tokens 16384,", "d 512,"),
                    "the whole layer"),
                   ("pkm/value-read", ("n_keys 512,", "knn 32,", "tokens 16384,", "d 512,",
                                       "sparse False"))],
          # the trace with the bf16 search (14.35 GB: the query rounded for the search and
          # widened again for the sub-key gradient, 0.2 GB, against 0.03 GB less read by the
          # score GEMM; 14.18 GB with the float32 search, 14.31 GB with int64 ids before that)
          # and less than half an [H, N, n_keys] float32 block written and read (0.27 GB): a
          # change that materialises one more such tensor, or goes back to int64 ids, fails it
          budget=int(14.42e9), modelled=_value_kernels),
    Layer("aop", "AttentionOverParameters (AOP₁: 8 heads, d_pk 64, the FFN's weight count, one "
          "token group), bf16, forward and backward", _aop,
          {"paper shape": dict(tokens=16384, d=512, ffn=2048, heads=8, width=1, groups=1)},
          growth=("tokens", "d"), setup=_FusedAttention,
          records=[("aop/sublayer-vs-ffn", ("heads 8, width 1, groups 1,",))])]}


# ---- the fused search's kernels, from their compiled code ------------------------------------

#: NVIDIA H200 SXM (GH100: 132 SMs of 4 warp schedulers, 1,980 MHz boost; 4.8 TB/s HBM3e), from
#: NVIDIA's H200 datasheet and the H100 architecture whitepaper (the same SM configuration)
H200 = {"sms": 132, "schedulers": 4, "clock": 1.98e9, "bandwidth": 4.8e12}
H200_SOURCE = ("NVIDIA H200 SXM: 132 SMs × 4 warp schedulers × 1.98 GHz (one warp instruction a "
               "scheduler a cycle), 4.8 TB/s HBM3e")
#: the fused search forward of commit 7605095 (16 tokens a program, knn rounds of max-extraction
#: over packed int64 tiles), the kernel of the record `pkm/search-forward` bf16 block 256 at the
#: paper shape: 2.119 ms (H200, docs/benchmarks.jsonl). Compiled as :func:`search_model` compiles
#: (sm_90, the runtime's alignment) it runs 72,344 instructions a warp (its loops weighted by
#: their trip counts) on 16,384 warps: 1.185e9 warp instructions, so it issued at 53.5 % of the
#: H200's peak rate; the same efficiency turns the new kernels' instruction counts into time.
#: (:func:`old_search_forward_instructions` recomputes the count from git.)
CALIBRATION = {"commit": "7605095", "ms": 2.119, "warp_instructions": 1.185e9}


@dataclass
class Kernel:
    """One launch at a shape: ``spec`` (label, kernel, signature, constexprs, warps) as
    :func:`~fairseq_attnzoo.modules.pkm_search_triton.sm90_specializations` yields it (the
    constexprs may be overridden), its programs, the trip count of each loop of its SASS in
    address order (a loop inside another runs its count each time the outer one turns), and the
    bytes it moves to or from DRAM (first touch)."""
    spec: tuple
    programs: int
    trips: List[float]
    bytes: float
    note: str = ""


def sass(spec) -> Tuple[List[Tuple[int, str]], dict]:
    """(address, instruction) of a specialisation compiled for sm_90 (as the spill check
    compiles it: scripts/sm90.py), and its resource usage (``sm90.disassemble``'s)."""
    import re

    from scripts.sm90 import compile_sm90, disassemble

    _, kernel, signature, constexprs, warps = spec
    used, text = disassemble(compile_sm90(kernel, signature, constexprs, warps).asm["cubin"])
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    return code, used


def loops(code) -> List[Tuple[int, int]]:
    """(first, last) address of every loop: a branch back to an earlier address."""
    import re

    out = []
    for address, op in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) <= address:
            out.append((int(target.group(1), 16), address))
    return sorted(out)


def warp_instructions(code, trips: List[float]) -> float:
    """Instructions a warp runs: each weighted by the trip counts of the loops around it."""
    spans = loops(code)
    if len(spans) != len(trips):
        raise ValueError(f"the SASS has {len(spans)} loops, the model gives {len(trips)} trip "
                         "counts: update the trip counts in search_model()")
    total = 0.0
    for address, _ in code:
        weight = 1.0
        for (first, last), n in zip(spans, trips):
            if first <= address <= last:
                weight *= n
        total += weight
    return total


def _reads_steps(block_n: int, knn: int, n_keys: int, key_block: int, reads: int) -> float:
    """E[⌈reads of a key block / READS⌉]: the tl.dot steps of a key-gradient program for one
    token block, its block_n·knn pairs' sub-keys uniform over n_keys (random keys), sampled."""
    import numpy as np

    blocks = -(-n_keys // key_block)
    counts = np.random.default_rng(0).multinomial(block_n * knn, [1 / blocks] * blocks, 20000)
    return float(np.ceil(counts / reads).mean())


def search_kernels(tokens=16384, heads=4, n_keys=512, knn=32, k_dim=256,
                   dtype=torch.bfloat16) -> Dict[str, List[Kernel]]:
    """The fused search's launches at a shape, forward and backward (random rows: no fallback;
    the forward's kernel compiled with FALLBACK=False, the branch that does not run)."""
    from fairseq_attnzoo.modules import pkm_search_triton as S

    half, e = k_dim // 2, dtype.itemsize
    specs = {label: spec for label, *spec in S.sm90_specializations(half, knn, n_keys)}
    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    L = S.search_launch(half, knn, n_keys, dtype)
    rows, pairs = tokens * heads, tokens * heads * L.KNN
    search = specs[f"search {t}"]
    search = (f"search {t}", search[0], search[1], dict(search[2], FALLBACK=False), search[3])
    blocks = -(-tokens // S.GRAD_BLOCK_N)
    buckets = -(-n_keys // S.KEY_BLOCK)
    chunk = S.CHUNK_TOKENS // S.GRAD_BLOCK_N
    chunks = -(-blocks // chunk)
    reads = 12 * rows * 2 * L.KNN  # id, g, token (int32, float32, int32) of every pair
    partial = 4 * chunks * heads * 2 * n_keys * half
    return {"forward": [
        Kernel(search, -(-tokens // L.BLOCK_N) * heads,
               [n_keys / L.GROUPS, n_keys / L.KB] * 2 + [0],
               rows * k_dim * e + rows * 2 * (L.TILE + L.KNN) * 8,
               "per half: group maxima, τ, the scores >= τ to the tile, its top-k"),
        Kernel(("search pairs",) + tuple(specs["search pairs"]),
               -(-tokens // S.PAIRS_BLOCK_N) * heads, [knn, 0],
               rows * 2 * L.KNN * 8 + rows * knn * (4 + 4 + 8),
               "candidate pairs, their top-k, the softmax")],
        "backward": [
        Kernel((f"search backward query {t}",) + tuple(specs[f"search backward query {t}"]),
               blocks * heads, [buckets, S.GRAD_BLOCK_N * L.KNN / S.QUERY_READS] * 2 + [0],
               rows * knn * (4 + 4 + 8 + 4) + rows * k_dim * e + reads,
               "∂L/∂score, the reads by key block, ∂L/∂q"),
        Kernel((f"search backward keys {t}",) + tuple(specs[f"search backward keys {t}"]),
               2 * heads * buckets * chunks,
               [chunk, _reads_steps(S.GRAD_BLOCK_N, knn, n_keys, S.KEY_BLOCK, S.READS), 0],
               reads + rows * k_dim * e + partial, "∂L/∂C per key block and chunk of tokens"),
        Kernel(None, 0, [], partial + 4 * heads * 2 * n_keys * half,
               "the chunks' partial sums (torch.sum)")]}


def search_model(**shape) -> List[dict]:
    """Per kernel of the fused search at ``shape`` (the paper's by default): registers, spills,
    warp instructions, bytes, and the expected H200 time: the slower of the instructions at the
    calibrated issue rate and the bytes at the DRAM bandwidth."""
    rate = H200["sms"] * H200["schedulers"] * H200["clock"]
    efficiency = CALIBRATION["warp_instructions"] / (CALIBRATION["ms"] * 1e-3 * rate)
    out = []
    for pass_, kernels in search_kernels(**shape).items():
        for k in kernels:
            row = {"pass": pass_, "kernel": k.spec[0] if k.spec else "torch.sum", "does": k.note}
            issue_ms = 0.0
            if k.spec:
                code, res = sass(k.spec)
                instructions = warp_instructions(code, k.trips) * k.programs * k.spec[4]
                issue_ms = instructions / (rate * efficiency) * 1e3
                row.update({"registers": res["registers"], "stack B": res["stack"],
                            "LDL/STL": res["local ops"], "G warp instr": instructions / 1e9})
            memory_ms = k.bytes / H200["bandwidth"] * 1e3
            row.update({"MB": k.bytes / 1e6, "issue ms": issue_ms, "memory ms": memory_ms,
                        "expected ms": max(issue_ms, memory_ms)})
            out.append(row)
    return out


def old_search_forward_instructions() -> float:
    """:data:`CALIBRATION`'s instruction count, recomputed from the kernel at its commit."""
    import importlib.util
    import subprocess
    import tempfile

    source = subprocess.run(["git", "show", f"{CALIBRATION['commit']}:fairseq_attnzoo/modules/"
                             "pkm_search_triton.py"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(source)
        f.flush()
        spec = importlib.util.spec_from_file_location("fairseq_attnzoo.modules._old_search",
                                                      f.name)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        kernel = old._kernels()[0]  # (Triton reads the source while the file exists)
    block_d, dot_d, key_block, knn_p, pairs = old.search_launch(128, 32, 512)
    names = ["q", "keys", "scratch", "w_out", "slot_out", "sub_out", "n", "heads", "n_keys",
             "knn", "stride_qh", "stride_qn"]
    types = ["*bf16", "*bf16", "*i64", "*fp32", "*i32", "*i32"] + ["i32"] * 6
    constexprs = dict(HALF=128, BLOCK_N=16, BLOCK_D=block_d, DOT_D=dot_d, KEY_BLOCK=key_block,
                      KNN=knn_p, PAIRS=pairs, PRECISION="tf32", UPCAST=False)
    signature = dict(zip(names, types), **{k: "constexpr" for k in constexprs})
    code, _ = sass(("old", kernel, signature, constexprs, 4))
    # loops by first address: key blocks (half 1), the knn rounds in one, the same for half 2,
    # the pair index, the candidate rounds, the exit trap
    per_warp = warp_instructions(code, [512 / key_block, 32, 512 / key_block, 32, 32, 32, 0])
    return per_warp * (16384 // 16) * 4 * 4


def write_search_model(path: str) -> int:
    rows = search_model()
    total = {p: sum(r["expected ms"] for r in rows if r["pass"] == p)
             for p in ("forward", "backward")}
    cell = (lambda c, v: f"{v:.3f}" if isinstance(v, float) and c.endswith(("ms", "instr"))
            else f"{v:,.1f}" if isinstance(v, float) else str(v))
    text = (f"The model (not a measurement): {H200_SOURCE}; each kernel compiled for sm_90 at the "
            "paper shape (bf16, 16,384 tokens, n_keys 512, 4 heads, knn 32, k_dim 256), its SASS "
            "instructions weighted by the trip counts of their loops on random rows, at the issue "
            f"efficiency the record of commit {CALIBRATION['commit']}'s forward gives "
            f"({CALIBRATION['ms']} ms for {CALIBRATION['warp_instructions'] / 1e9:.3f} G warp "
            "instructions); expected = the slower of that and the DRAM bytes at the bandwidth "
            "(L2 traffic not modelled). `python -m scripts.costmodel search`.\n\n"
            + tables.format_table(rows, cell=cell)
            + f"\nExpected: forward {total['forward']:.2f} ms, backward {total['backward']:.2f} "
            "ms.\n")
    with open(path) as f:
        old = f.read()
    new = tables.update(old, [], "kernelmodel", lambda name, _: text)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
        print(f"updated {path}")
    return 0


def update(text: str, records) -> str:
    return tables.update(text, records, "costmodel", lambda name, rs: render(LAYERS[name], rs))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["search"]:
        return write_search_model(os.path.join(REPO, "docs", "performance.md"))
    return tables.main(argv, __doc__, DOCS, update, "scripts.costmodel")


if __name__ == "__main__":
    sys.exit(main())

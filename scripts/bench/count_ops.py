"""Count the aten ops, copy-like ops and bytes of one forward+backward of each attention module.

A CPU stand-in for GPU kernel counts: most aten ops that are not views are a kernel launch on a GPU, and
every copy-like op moves the whole tensor through memory once more. Self-attention at d 512,
8 heads, T 64, B 16 (transformer-base), with a key padding mask (left-padded, as fairseq's
sources), and once as the decoder's causal self-attention (fairseq's float -inf future mask plus
a right-padded key padding mask). Modules are called as fairseq's layers call them: time-first
``[T, B, C]``, ``need_weights=False``, training mode, attention dropout 0 (transformer_base).

    python -m scripts.bench.count_ops [--repeats 5] [--only collab]

Columns: ``aten ops`` every ``aten::`` op the profiler records (nested calls included);
``copies`` copy-like ops (``aten::copy_``, ``contiguous``, ``clone``, ``cat``, ``to``/``_to_copy``,
``masked_fill``; an expand is counted where it is materialised, by the copy), counted once per
outermost call (``to -> _to_copy -> copy_`` is one), leaving out ``to``/``contiguous`` calls that
return their input and copies of 0-dim scalars; ``MB alloc`` the bytes the CPU allocator handed out
(profiler memory events); ``ms`` the median CPU wall time of ``--repeats`` runs, unprofiled.
"""

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from fairseq.modules.multihead_attention import MultiheadAttention

from fairseq_attnzoo.models.synthesizer import VARIANTS
from fairseq_attnzoo.modules.collab import CollaborativeAttention
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

D, HEADS, T, B, MAX_LEN = 512, 8, 64, 16, 256
COPY_OPS = {"aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::to",
            "aten::_to_copy", "aten::masked_fill", "aten::masked_fill_", "aten::expand_copy"}


def modules():
    """(name, factory, supports causal self-attention)"""
    yield "fairseq mha", lambda: MultiheadAttention(D, HEADS, self_attention=True), True
    for dk in (512, 256):
        yield f"collab D̃k={dk}", lambda dk=dk: CollaborativeAttention(D, HEADS, dk), True
    for variant, (components, freeze) in VARIANTS.items():
        yield (f"synth_{variant}", lambda c=components, f=freeze: SynthesizerAttention(
            D, HEADS, components=c, max_len=MAX_LEN, freeze_random=f), True)


def inputs(causal: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, B, D, generator=g, requires_grad=True)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    lengths[0] = T
    pos = torch.arange(T)
    if causal:  # decoder: right-padded targets, fairseq's buffered_future_mask
        pad = pos[None, :] >= lengths[:, None]
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)
    else:  # encoder: left-padded sources
        pad = pos[None, :] < (T - lengths)[:, None]
        mask = None
    grad = torch.randn(T, B, D, generator=g)
    return x, pad, mask, grad


def step(module, x, pad, mask, grad):
    module.zero_grad(set_to_none=True)
    x.grad = None
    out, _ = module(query=x, key=x, value=x, key_padding_mask=pad, need_weights=False,
                    attn_mask=mask)
    out.backward(grad)


def _outermost_copies(events):
    counts = Counter()
    for e in events:
        if e.name not in COPY_OPS:
            continue
        if e.name in ("aten::to", "aten::contiguous") and not e.cpu_children:
            continue  # already the right dtype / layout: returns its input, copies nothing
        if e.name != "aten::cat" and e.input_shapes and e.input_shapes[0] == []:
            continue  # a 0-dim scalar (a Python number wrapped for an op)
        parent, inner = e.cpu_parent, False
        while parent is not None:
            if parent.name in COPY_OPS:
                inner = True
                break
            parent = parent.cpu_parent
        if not inner:
            counts[e.name] += 1
    return counts


def measure(factory, causal: bool, repeats: int):
    torch.manual_seed(0)
    module = factory().train()
    args = inputs(causal)
    for _ in range(2):
        step(module, *args)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step(module, *args)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    copies = _outermost_copies(events)
    alloc = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]" and e.nbytes() > 0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(module, *args)
        times.append(time.perf_counter() - t0)
    return {"aten ops": len(aten), "copies": sum(copies.values()), "detail": copies,
            "MB alloc": alloc / 2**20, "ms": 1000 * statistics.median(times)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--only", default="", help="substring of the module names to run")
    parser.add_argument("--detail", action="store_true", help="list the copy-like ops by name")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"d {D}, {HEADS} heads, T {T}, B {B}, forward+backward, CPU fp32, "
          f"torch {torch.__version__}, 1 thread\n")
    print("| module | mask | aten ops | copies | MB alloc | ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, factory, causal_ok in modules():
        if args.only not in name:
            continue
        for causal in (False, True) if causal_ok else (False,):
            r = measure(factory, causal, args.repeats)
            mask = "causal+pad" if causal else "pad"
            print(f"| {name} | {mask} | {r['aten ops']} | {r['copies']} | {r['MB alloc']:.1f} "
                  f"| {r['ms']:.2f} |", flush=True)
            if args.detail:
                print("|  | " + ", ".join(f"{k[6:]} {v}" for k, v in sorted(r["detail"].items()))
                      + " | | | | |")


if __name__ == "__main__":
    main()

"""Adaptive-span attention layer with every span fixed at S/8 vs the same layer with full span.

Paper layer: d 512, 8 heads, block M = 512, maximum span S = 8192; batch 1 on CPU. Inputs as in
training: the block plus the cache the model keeps for it (full span: S - 1 = 8191 previous
positions; span S/8: the trimmed window + 64 buffer = 1151). Forward+backward. Goal: <= 0.30x the
time (the gain comes only from trimming keys/values/cache to the span), and lower peak memory
(extra columns: peak MB of one forward+backward, Linux VmHWM on CPU, CUDA allocator on GPU)."""

import os
import subprocess
import sys

import torch

from scripts.bench.benchlib import SublayerCase, peak_memory_mb, register_case
from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanAttention

D, HEADS, M, S, B = 512, 8, 512, 8192, 1


def layer(ratio: float):
    """The attention layer with all spans z = ratio * S, and its inputs (block + kept cache)."""
    def make():
        torch.manual_seed(0)
        att = AdaptiveSpanAttention(D, HEADS, S, ramp=32, span_init=ratio, own_key_pe=True)
        cache = att.mask.cache_size(buffer=64)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(B, M, D, generator=g, requires_grad=True)
        memory = torch.randn(B, cache, D, generator=g)
        return att, (x, None, memory)
    return make


def peak_mb(ratio: float, device=None) -> float:
    """Peak memory of one forward+backward of ``layer(ratio)``."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    att, (x, _, mem) = layer(ratio)()
    att, x, mem = att.to(device), x.detach().to(device).requires_grad_(), mem.to(device)

    def step():
        att(x, None, mem)[0].sum().backward()

    return peak_memory_mb(step, device)


def _cpu_peak_mb_subprocess(ratio: float) -> float:
    """CPU peak in a fresh process with a fixed malloc mmap threshold, so that freed tensors go back
    to the OS and the resident high-water mark follows live memory (glibc's adaptive threshold
    would otherwise keep freed blocks of an earlier, larger run resident)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    code = ("from scripts.bench.cases import adaptive_span as m; "
            "print(m.peak_mb({0!r}, m.torch.device('cpu')))").format(ratio)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=repo)  # python -c imports from its working directory
    return float(out.stdout.strip().splitlines()[-1])


def _extra():
    if torch.cuda.is_available():
        full, eighth = peak_mb(1.0), peak_mb(1 / 8)
    else:
        full, eighth = _cpu_peak_mb_subprocess(1.0), _cpu_peak_mb_subprocess(1 / 8)
    return {"peak MB span S/8": eighth, "peak MB full span": full, "peak ratio": eighth / full}


register_case(SublayerCase(
    group="self_attn", name="adaptive span S/8 vs full span", candidate=layer(1 / 8),
    baseline=layer(1.0), note="d 512, 8 heads, M 512, S 8192, batch 1 (cache 1151 vs 8191)",
    target=0.30, extra=_extra))

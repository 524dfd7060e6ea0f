"""Product-key memory layer (|K| = 512² = 262,144 slots, 4 heads, knn 32, k_dim 256, values d=512)
vs the FFN it replaces (512→2048→512), 4096 tokens, forward+backward.
Goals: sparse <= 1.5x, dense <= 2.0x the FFN (docs/pkm.md, Measured).

Extra columns: peak memory (MB) of one training update of the memory -- forward, backward and
the value-table step of ``pkm_adam`` (after a warm-up step, so Adam's moment tables, 2 × 512 MB,
already exist and are not counted) -- with sparse and with dense value gradients, at 4096 and at
512 tokens. CUDA: allocator peak; CPU: rise of the resident high-water mark (benchlib.peak_memory_mb).

Peer rows (optional): lucidrains ``product-key-memory`` 0.3.0 at the same config (``dim_head`` =
one half-query = k_dim/2 = 128), LayerNorm queries (its default), BatchNorm queries, and LayerNorm
with its value bag switched to sparse gradients. Skipped with one line when it is not importable;
docs/benchmarks.md says how to install it beside the venv."""

import torch
import torch.nn as nn

from scripts.bench.benchlib import SublayerCase, peak_memory_mb, register_case
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.optim.pkm_optimizer import SparseDenseAdam

D, FFN, T, B = 512, 2048, 128, 32  # 4096 tokens


def _x(batch=B):
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, batch, D, generator=g, requires_grad=True)


def ffn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, FFN), nn.ReLU(), nn.Linear(FFN, D)), (_x(),)


def pkm(sparse):
    def make():
        torch.manual_seed(0)
        return ProductKeyMemory(D, D, n_keys=512, heads=4, knn=32, k_dim=256, sparse=sparse), (_x(),)
    return make


def update_peak_mb(sparse, batch=B, device=torch.device("cpu")):
    """Peak memory of forward + backward + value update (second step), T·batch tokens."""
    m, _ = pkm(sparse)()
    m, x = m.to(device), _x(batch).detach().to(device).requires_grad_(True)
    opt = SparseDenseAdam([m.values.weight], lr=1e-3)

    def step():
        m(x).sum().backward()
        opt.step()

    step()  # allocates Adam's moments
    m.zero_grad(set_to_none=True)  # outside the measured call: frees of older blocks would hide peaks
    peak = peak_memory_mb(step, device)
    m.zero_grad(set_to_none=True)
    return peak


def _extra():
    # extra() gets no device: measure on the GPU when there is one (bench.py --device cuda)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"update peak MB sparse": update_peak_mb(True, device=dev),
            "update peak MB dense": update_peak_mb(False, device=dev),
            "@512 tokens sparse": update_peak_mb(True, 4, dev),
            "@512 tokens dense": update_peak_mb(False, 4, dev)}


register_case(SublayerCase(group="ffn", name="pkm sparse values vs ffn", candidate=pkm(True),
                           baseline=ffn, note="4096 tokens, |K| 262144, h4 k32 d_q256", target=1.5,
                           extra=_extra))
register_case(SublayerCase(group="ffn", name="pkm dense values vs ffn", candidate=pkm(False),
                           baseline=ffn, note="4096 tokens, |K| 262144, h4 k32 d_q256", target=2.0))


def peer(use_layernorm, sparse=False):
    def make():
        from product_key_memory import PKM

        torch.manual_seed(0)
        m = PKM(D, heads=4, num_keys=512, topk=32, dim_head=128, use_layernorm=use_layernorm)
        m.values.sparse = sparse
        return m, (_x().detach().transpose(0, 1).contiguous().requires_grad_(True),)  # [B, T, D]
    return make


try:
    import product_key_memory  # noqa: F401
except ImportError:
    print("pkm: peer rows skipped: lucidrains product-key-memory not importable "
          "(install: docs/benchmarks.md)")
else:
    for _name, _ln, _sparse in (("LayerNorm", True, False), ("BatchNorm", False, False),
                                ("LayerNorm, sparse values", True, True)):
        register_case(SublayerCase(
            group="ffn", name=f"pkm peer: product-key-memory 0.3.0 ({_name}) vs ffn",
            candidate=peer(_ln, _sparse), baseline=ffn,
            note="same config; peer, not ours"))

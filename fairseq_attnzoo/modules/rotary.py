"""Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer"), the Llama form.

Each head's features are taken in adjacent pairs (x_{2i}, x_{2i+1}) and the pair at position m is
rotated by the angle m·θ_i, θ_i = theta^(-2i/d):

    x'_{2i}   = x_{2i} cos(mθ_i) - x_{2i+1} sin(mθ_i)
    x'_{2i+1} = x_{2i} sin(mθ_i) + x_{2i+1} cos(mθ_i)

so a rotated query at m and a rotated key at n score q·R(n-m)·k: a function of n - m only. Under
incremental decoding the tokens of a step sit at positions ``offset, offset+1, ...`` where
``offset`` is the number of cached positions (:attr:`.attention.AttnContext.offset`); rotating them
from 0 again would make every step see its keys at the wrong distance.

Angles and the rotation are computed in float32 and cast back once (as the reference rotates
``.float()`` and ``type_as`` back). Imports torch only.
"""

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor


def rotary_angles(positions: Tensor, dim: int, theta: float = 10000.0) -> Tensor:
    """Angles m·θ_i, float32 ``[*positions.shape, dim // 2]``."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device,
                                       dtype=torch.float32)[: dim // 2] / dim)
    return positions.to(torch.float32).unsqueeze(-1) * inv_freq


def apply_rotary(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate adjacent feature pairs of ``x [..., d]`` by ``angles [..., d/2]`` (broadcast: e.g.
    ``x [B, H, T, d]`` with ``angles [T, d/2]``); float32 inside, ``x``'s dtype out."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = angles.cos(), angles.sin()
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE for heads of size ``dim`` with base ``theta``; no parameters (checkpoints of a model
    with and without it hold the same tensors). Call with ``x [B, H, T, d]`` and the position of
    its first token (``offset``: the cached length when decoding incrementally)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary position embeddings turn feature pairs: dim {dim} is odd; "
                             "use an even head size embed_dim / num_heads (CollaborativeAttention: "
                             "an even key_dim), or rope_theta=None")
        self.dim, self.theta = dim, float(theta)
        self._angles: Optional[Tensor] = None  # float32 [T_max, d/2], grown on demand

    def angles(self, offset: int, length: int, device) -> Tensor:
        end = offset + length
        table = self._angles
        if table is None or table.size(0) < end or table.device != torch.device(device):
            size = max(end, 2 * (0 if table is None else table.size(0)), 64)
            table = rotary_angles(torch.arange(size, device=device), self.dim, self.theta)
            self._angles = table
        return table[offset:end]

    def forward(self, x: Tensor, offset: int = 0, seq_dim: int = -2) -> Tensor:
        """``x [..., T, d]`` (``seq_dim=-2``) or ``[..., T, H, d]`` (``seq_dim=-3``), its first
        token at position ``offset``."""
        angles = self.angles(offset, x.size(seq_dim), x.device)
        return apply_rotary(x, angles.view(angles.size(0), *[1] * (-seq_dim - 2), angles.size(1)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta:g}"

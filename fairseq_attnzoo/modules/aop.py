"""Attention over parameters (AOP): the position-wise FFN as attention over trainable memory.

The FFN ``ReLU(x W1) W2`` is a read from a key-value memory with ReLU instead of softmax. AOP makes
that read a real attention: per head i, the token's query ``q_i = x W_q,i`` attends over n_p
*persistent* keys ``K_i`` and values ``V_i`` that are parameters, not projections of the sequence::

    AOP(x) = Concat_i( softmax(q_i K_iᵀ) V_i ) W_o            q_i: [d_pk], K_i: [n_p, d_pk], V_i: [n_p, d_pv]

It is position-wise (every token reads the same memory), so there is no mask and nothing to cache
in incremental decoding.

Scaling (the paper's "keys and values scaled up by √d_model"), two forms from tensor2tensor's
history of ``parameter_attention``, selected by ``scale_at``:

* ``"use"`` (default; the code of the paper's time, 2017-06-21 to 2018-06-11): K, V are stored
  N(0, d^-½) and multiplied in the forward pass by constants, keys by √h_p, values by √d;
* ``"init"`` (tensor2tensor since commit da8d5756, 2018-06-11, "move gaussian initialiser
  multiplication into standard deviation"): the constants are folded into the initialiser,
  K ~ N(0, √h_p·d^-½), V ~ N(0, 1), used as stored.

Both give the same function at initialisation (the keys the queries see are N(0, h_p/d), = 1/√d_pk
when h_p·d_pk = d, which is why the logits get no extra 1/√d_pk; the values are N(0, 1)), but with
Adam a constant at use multiplies the effective step: one step moves V ≈ √d (22.6× at d=512) more in
the "use" form. No biases (tensor2tensor's ``dense(..., use_bias=False)`` since 2017-11-28; the
parameter count then equals the FFN's weights exactly: see :func:`aop_num_params`). Dropout drops
whole memory rows (value vectors, per head, shared by all tokens of the batch, rescaled by 1/(1-p))
-- tensor2tensor's "cheaper form of attention dropout" -- which keeps the fused SDPA kernel usable.

The attention runs through ``F.scaled_dot_product_attention`` (``kernel="sdpa"``, the default and
the reference) or through the Triton kernel of :mod:`.aop_triton` (``kernel="triton"``: CUDA, or
Triton's interpreter on the CPU), whose backward splits the sum over tokens into chunks.
"""

import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .feedforward import ZooFeedForward
from .pkm_triton import KernelUnavailable


SCALE_AT = ("use", "init")
#: how the attention over the memory runs: torch's SDPA (reference, default) or the Triton kernel
KERNELS = ("sdpa", "triton")
#: SDPA's backends (``AttentionOverParameters.sdpa_backend``) by their torch.nn.attention names
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cuDNN": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def aop_num_params(embed_dim: int, heads: int, key_dim: int, value_dim: int, slots: int) -> int:
    """Weights of one AOP sublayer: W_q (d·h·d_pk) + K (h·n_p·d_pk) + V (h·n_p·d_pv) + W_o (h·d_pv·d)."""
    return (embed_dim * heads * key_dim + heads * slots * key_dim + heads * slots * value_dim
            + heads * value_dim * embed_dim)


def ffn_matching_slots(embed_dim: int, ffn_dim: int, heads: int, key_dim: int,
                       value_dim: int) -> int:
    """The largest n_p whose AOP weights do not exceed the FFN's 2·d·d_ff:
    d·(c_k + c_v) + n_p·(c_k + c_v) = 2·d·d_ff with c = h_p·d_p, so n_p = d·(2·d_ff - c_k - c_v) /
    (c_k + c_v) (exact when it divides; h_p·d_pk = h_p·d_pv = d gives n_p = d_ff - d)."""
    width = heads * (key_dim + value_dim)
    return embed_dim * (2 * ffn_dim - width) // width


class AttentionOverParameters(ZooFeedForward):
    """Attention over h_p × n_p persistent key/value slots (a drop-in FFN), time-first [T, B, C]."""

    def __init__(self, embed_dim: int, heads: int = 8, key_dim: int = 64, value_dim: int = 64,
                 slots: int = 1536, dropout: float = 0.0, scale_at: str = "use",
                 token_bucket: int = 0, kernel: str = "sdpa"):
        super().__init__()
        # user-facing checks (one line naming the flag) are the fairseq options' validate()
        assert min(heads, key_dim, value_dim, slots) > 0, (heads, key_dim, value_dim, slots)
        assert token_bucket >= 0, token_bucket
        assert 0.0 <= dropout < 1.0 and scale_at in SCALE_AT, (dropout, scale_at)
        assert kernel in KERNELS, f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}"
        self.embed_dim = embed_dim
        self.heads = heads  # h_p
        self.key_dim = key_dim  # d_pk
        self.value_dim = value_dim  # d_pv
        self.slots = slots  # n_p
        self.dropout = dropout
        self.scale_at = scale_at
        self.q_proj = nn.Linear(embed_dim, heads * key_dim, bias=False)  # W_q
        self.keys = nn.Parameter(torch.empty(heads, slots, key_dim))  # K
        self.values = nn.Parameter(torch.empty(heads, slots, value_dim))  # V
        self.out_proj = nn.Linear(heads * value_dim, embed_dim, bias=False)  # W_o
        # tensor2tensor's "scaled up" constants √h_p (keys) and √d (values): multiplied at use, or
        # folded into the initialiser's standard deviation (see module docstring)
        constants = (math.sqrt(heads), math.sqrt(embed_dim))
        self.key_scale, self.value_scale = constants if scale_at == "use" else (1.0, 1.0)
        self._init_std = tuple(embed_dim ** -0.5 * (1.0 if scale_at == "use" else c)
                               for c in constants)
        #: the N tokens go to SDPA as this many batch entries of N/g tokens sharing the memory
        #: (1: one sequence of all tokens; falls back to 1 when g does not divide N). Same
        #: function; what changes is the fused kernels' parallelism: their backward runs one
        #: block per (entry, head, block of slots), so one entry gives only h·n_p/block blocks
        #: (the benchmark case aop/sublayer-vs-ffn measures the choices)
        self.token_groups = 1
        #: in training the attention runs over the N tokens padded with zero queries to a
        #: multiple of this (0: not padded). Same function and gradients (a padded row's output
        #: is dropped, so its gradient is zero); what changes is how many shapes the attention
        #: kernel sees: cuDNN's builds an execution graph for each new one, and fairseq's
        #: batches keep changing N
        self.token_bucket = token_bucket
        #: None: torch picks SDPA's backend; or one of :data:`SDPA_BACKENDS` alone (the
        #: benchmark case aop/sublayer-vs-ffn times each at 1-32 token groups)
        self.sdpa_backend = None
        #: "sdpa" or "triton" (see the module docstring); a plain attribute, not in state dicts
        self.kernel = kernel
        self.reset_parameters()

    def reset_parameters(self):
        # t2t transformer_base's "uniform_unit_scaling" (fan_avg, uniform, gain 1) = glorot uniform
        nn.init.xavier_uniform_(self.q_proj.weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.normal_(self.keys, 0.0, self._init_std[0])
        nn.init.normal_(self.values, 0.0, self._init_std[1])

    def _dropped_values(self, c: float) -> Tensor:
        """V with whole rows dropped, times ``c`` and dropout's 1/(1-p), in one
        multiply of the table (both constants ride on the small keep mask)."""
        # one keep/drop decision per (head, slot), shared by every token: drops memory rows
        keep = torch.empty(self.heads, self.slots, 1, device=self.values.device,
                           dtype=self.values.dtype)
        keep.bernoulli_(1.0 - self.dropout)
        return self.values * keep.mul_(c / (1.0 - self.dropout))

    def _dropping(self) -> bool:
        return self.training and self.dropout > 0

    def _values(self) -> Tensor:
        """V as the attention reads it ``[h, n_p, d_pv]``: scaled by its constant and, in
        training, with whole rows dropped."""
        c = self.value_scale
        if self._dropping():
            return self._dropped_values(c)
        return self.values * c if c != 1.0 else self.values

    def memory(self):
        """The effective keys ``[h, n_p, d_pk]`` and values ``[h, n_p, d_pv]`` (scaled, and with
        whole rows of V dropped in training). The forward reads the same keys through the
        attention's logit scale instead of a scaled copy."""
        k = self.keys * self.key_scale if self.key_scale != 1.0 else self.keys
        return k, self._values()

    def _memory_and_output(self):
        """(V as the attention reads it, W_o as the output projection uses it): the value
        constant c goes where it costs least. With dropout it rides on the keep mask (V is
        multiplied anyway); otherwise it scales the smaller of V ``[h, n_p, d_pv]`` and
        W_o ``[d, h·d_pv]`` -- (c·softmax(qKᵀ)V) W_o = softmax(qKᵀ)V (c·W_o) -- never the
        ``[N, h·d_pv]`` output."""
        c, w = self.value_scale, self.out_proj.weight
        if self._dropping():
            return self._dropped_values(c), w
        if c == 1.0:
            return self.values, w
        if w.numel() < self.values.numel():
            return self.values, w * c
        return self.values * c, w

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        # position-wise: [T, B, C] is just T·B independent tokens; pads are computed and ignored
        # (the mask checked all the same: a mask of another layout is a mistake upstream)
        self.padding(x, padding_mask)
        t, b, _ = x.shape
        n = t * b
        q = self.q_proj(x).view(n, self.heads, self.key_dim)
        if self.kernel == "triton":
            return self._forward_triton(q, t, b)
        bucket = self.token_bucket if self.training else 0  # (decoding steps repeat one N)
        padded = n + (-n) % bucket if bucket else n
        if padded != n:  # zero queries after the tokens (the rows dropped below)
            q = F.pad(q, (0, 0, 0, 0, 0, padded - n))
        g = self.token_groups if padded % self.token_groups == 0 else 1
        q = q.view(g, padded // g, self.heads, self.key_dim).transpose(1, 2)
        # the memory [h, n_p, d], shared by the g entries [g, h, N/g, d_pk] (unsqueezed for one
        # entry: an expand's backward would be a reduction kernel over a dimension of size 1)
        v, w_o = self._memory_and_output()
        k, v = self.keys.unsqueeze(0), v.unsqueeze(0)
        if g > 1:
            k, v = k.expand(g, -1, -1, -1), v.expand(g, -1, -1, -1)
        # softmax(q (√h_p K)ᵀ) V over the n_p slots: the key constant √h_p (which replaces
        # 1/√d_pk) is the kernel's logit scale, so no scaled copy of K is made
        y = self._sdpa(q, k, v)
        y = y.transpose(1, 2).reshape(padded, self.heads * self.value_dim)
        if padded != n:  # (unpadded: no slice, whose backward would zero-fill and copy)
            y = y[:n]
        return F.linear(y.view(t, b, self.heads * self.value_dim), w_o)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``F.scaled_dot_product_attention`` with the logit scale √h_p, under
        :attr:`sdpa_backend` alone if set (its backward follows the forward's backend); where that
        backend cannot run, one line naming it and torch's first reason."""
        if self.sdpa_backend is None:
            return F.scaled_dot_product_attention(q, k, v, scale=self.key_scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.sdpa_backend])), \
                warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            try:
                return F.scaled_dot_product_attention(q, k, v, scale=self.key_scale)
            except RuntimeError as e:  # (torch warns its reasons, then raises "No available ...")
                why = [str(w.message) for w in told if "because" not in str(w.message)] or [str(e)]
                raise RuntimeError(f"AOP's SDPA backend {self.sdpa_backend} cannot run "
                                   f"{str(q.dtype)[6:]} on {q.device.type}: "
                                   f"{why[0].strip().splitlines()[0]}") from None

    def _forward_triton(self, q: Tensor, t: int, b: int) -> Tensor:
        """The Triton kernel over all t·b tokens (no grouping or bucket: it compiles once per
        head size, and its backward chunks the tokens itself); c is applied inside it."""
        from . import aop_triton

        why = aop_triton.why_unavailable(q, self.key_dim, self.value_dim)
        if why is not None:
            raise KernelUnavailable(why, "AttentionOverParameters", "kernel", "'sdpa'")
        v, c = ((self._dropped_values(self.value_scale), 1.0) if self._dropping()
                else (self.values, self.value_scale))
        k, v = self.keys.to(q.dtype), v.to(q.dtype)  # (autocast: q is in the autocast dtype)
        y = aop_triton.attention(q, k, v, self.key_scale, c)
        return self.out_proj(y.view(t, b, self.heads * self.value_dim))

    def extra_repr(self) -> str:
        return (f"h_p={self.heads}, d_pk={self.key_dim}, d_pv={self.value_dim}, n_p={self.slots}, "
                f"dropout={self.dropout}, scale_at={self.scale_at}"
                + (f", token_bucket={self.token_bucket}" if self.token_bucket else "")
                + (f", kernel={self.kernel}" if self.kernel != "sdpa" else ""))

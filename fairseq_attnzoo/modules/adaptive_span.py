"""Adaptive attention span (Sukhbaatar, Grave, Bojanowski & Joulin, ACL 2019).

Every head h learns its own span z_h in [0, S]. Attention weights at distance x (0 = the current
token, 1 = the previous one, ...) are multiplied by a soft mask and renormalised:

    m_z(x) = clamp((R + z - x) / R, 0, 1)                                   (ramp R, paper eq. 2)
    a_tx = m_z(t - x) exp(s_tx) / sum_r m_z(t - r) exp(s_tr)                (paper eq. 3)

which is exactly ``softmax(s + log m)`` (log 0 = -inf): that is how it is computed here. The
logits s_tx = q_t . (k_x + p_{t-x}) / sqrt(d_h) use learned relative position embeddings
``key_pe [1, d_h, S]`` (Transformer-XL style; shared by the layers of a model) and keys/values of
the current block plus a cache of previous hidden states. The training loss gets
``lambda * sum_layers mean_h z_h`` (the reference's L1 penalty: coefficient x S x mean span ratio).

Speed and memory follow the learned span because keys, values, position embeddings and the cache are
*trimmed* to the largest span (+ ramp) of the layer, in steps of ``trim_chunk`` (64) positions:
masked weights are exactly zero, so trimmed and untrimmed results are identical.

Relative logits use the "skew" trick (Dai et al. 2019; reference ``_skew/_unskew``): the content
logits q K^T of M queries against the W = M + L - 1 keys of the window are computed as one matmul in
*key layout* ``[M, W]`` and reshaped (no gather) into *distance layout* ``[M, L]``, where column j
holds distance L - 1 - j; position logits q P and the span mask live in distance layout; the
attention weights are skewed back to key layout for the weighted sum of values. When the window is
short compared to the block, queries go in chunks of c against overlapping windows of c + L - 1
keys (``chunk_size``), so the key-layout tensors shrink from M x (M + L - 1) to M x (c + L - 1).
With ``kernel="sdpa"`` (the default on CUDA) the chunks go to torch's fused
``scaled_dot_product_attention`` instead, the key-independent logits (positions, log-mask,
padding) skewed into an additive bias; the op-by-op path (``attend``) is its reference.

Differences from the reference code, on purpose: the window includes the current token (distance
0; the reference attends to the S previous tokens only), so m_z(0) = 1 and a token always sees
itself (``exclude_self=True`` gives the reference's window: distances 1..S, with m_z evaluated at
distance - 1 as the reference's mask template does); missing history (start of a stream, left
padding, padding) is masked out instead of being zero vectors; the renormalisation has no 1e-8
epsilon (it is a log-mask inside the softmax). ``renorm=False`` reproduces fairseq's
``examples/adaptive_span`` port instead, which multiplies the softmax over the trimmed window by m
without renormalising (weights sum to less than 1; results then depend slightly on the trimming).

Options: ``dynamic=True`` makes the span input dependent, z_t = S * sigmoid(v . x_t + b) per head
(the paper's "dynamic attention span" extension); ``persistent_slots=N`` adds All-Attention
persistent memory vectors (:mod:`.persistent_memory`) inside the same softmax (the span mask
applies to the context only).

torch only (plus :mod:`.base` for the shared finite mask value).
"""

import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import bool_mask
from .constrained import UnitIntervalParameter
from .persistent_memory import PersistentMemory
from .precision import Float32Module, float32_region, mask_value


#: how the band attention is computed (``AdaptiveSpanAttention(kernel=)``, fairseq
#: ``--adaptive-span-kernel``): "sdpa" = torch's fused attention with the position logits and span
#: mask as a bias, "explicit" = op by op (the reference), "auto" = sdpa on CUDA where it applies
KERNELS = ("auto", "sdpa", "explicit")


# ---------------------------------------------------------------------------------------------
# key layout <-> distance layout
# ---------------------------------------------------------------------------------------------
def unskew(x: Tensor, span: int) -> Tensor:
    """Key layout -> distance layout, as a strided view (no copy).

    ``x [..., M, W]`` with ``W = M + span - 1`` holds logits of query i against key i' where query i
    sits at key position i + span - 1. Returns ``[..., M, span]`` whose column j is key i + j, i.e.
    distance ``span - 1 - j``: row i of the result starts i elements later than row i of ``x``."""
    *batch, m, w = x.shape
    x = x.contiguous()
    return x.as_strided((*batch, m, span), (*x.stride()[:-2], w + 1, 1), x.storage_offset())


def skew(x: Tensor, fill: float = 0.0, align: int = 1) -> Tensor:
    """Distance layout -> key layout, the inverse of :func:`unskew` (``fill`` off the band).

    ``x [..., M, L]`` -> ``[..., M, M + L - 1]`` with ``out[..., i, i + j] = x[..., i, j]``. With
    ``align > 1`` the rows are allocated ``align``-element aligned (the result is a slice of that
    storage: fused attention kernels take such a bias without copying it)."""
    *batch, m, span = x.shape
    w = m + span - 1
    out = x.new_full((*batch, m, -(-w // align) * align), fill)[..., :w]
    out.as_strided((*batch, m, span), (*out.stride()[:-2], out.stride(-2) + 1, 1)).copy_(x)
    return out


class _Windows(torch.autograd.Function):
    """``x [..., T, d]`` -> overlapping windows ``[..., n, size, d]`` starting every ``step`` rows
    (a copy). The backward adds the window gradients back with one slice-add per window (autograd's
    generic ``unfold`` backward is several times slower on CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, size: int, step: int) -> Tensor:
        ctx.size, ctx.step, ctx.length = size, step, x.size(-2)
        return x.unfold(-2, size, step).transpose(-1, -2).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_zeros(*grad.shape[:-3], ctx.length, grad.size(-1))
        for j in range(grad.size(-3)):
            out[..., j * ctx.step: j * ctx.step + ctx.size, :] += grad[..., j, :, :]
        return out, None, None


def windows(x: Tensor, size: int, step: int) -> Tensor:
    """Overlapping windows of the rows of ``x`` (see :class:`_Windows`)."""
    if size == x.size(-2):
        return x.unsqueeze(-3)  # one window: a view
    return _Windows.apply(x, size, step)


# ---------------------------------------------------------------------------------------------
# the span: mask, trimming, penalty
# ---------------------------------------------------------------------------------------------
class AdaptiveMask(Float32Module):
    """Learned spans of the heads of one layer and their soft mask m_z(x).

    Reduced precision: the spans (and the dynamic-span predictor) stay float32 inside an fp16/bf16
    model and z, the distances and the ramp are computed in float32 (autocast off), so the mask is
    the float32 mask: in float16 distances above 2,048 are not all representable, and a bfloat16
    span fraction near 5,000/8,192 rounds to a multiple of 32 positions -- the whole ramp.

    Args:
        num_heads: H
        max_span: S, the maximum span (size of the relative position table)
        ramp: R, the length of the soft ramp (paper: 32)
        init: initial z / S (reference default 0)
        span_loss: lambda, coefficient of the L1 span penalty
        trim_chunk: keys are trimmed to the span in steps of this many positions (0 = never trim)
        dynamic: z_t = S * sigmoid(v . x_t + b), input dependent (paper section 3.2)
        embed_dim: input size of the dynamic span predictor
    """

    def __init__(self, num_heads: int, max_span: int, ramp: int = 32, init: float = 0.0,
                 span_loss: float = 0.0, trim_chunk: int = 64, dynamic: bool = False,
                 embed_dim: Optional[int] = None):
        super().__init__()
        self.num_heads = num_heads
        self.max_span = max_span
        self.ramp = ramp
        self.span_loss = span_loss
        self.trim_chunk = trim_chunk
        self.dynamic = dynamic
        if dynamic:
            if embed_dim is None:
                raise ValueError("a dynamic span needs embed_dim")
            # z_t = S sigmoid(v.x_t + b); v = 0 and sigmoid(b) = max(init, 1%) at the start
            self.span_proj = nn.Linear(embed_dim, num_heads)
            nn.init.zeros_(self.span_proj.weight)
            p = min(max(init, 0.01), 0.99)
            nn.init.constant_(self.span_proj.bias, math.log(p / (1 - p)))
            self.span = None  # (a plain attribute: fairseq lists None parameters as "shared")
        else:
            # z / S per head, kept in [0, 1] after every update (a UnitIntervalParameter:
            # see modules/constrained.py; reference scale: Adagrad's step size is per parameter, so this
            # scale sets how fast spans move)
            self.span = UnitIntervalParameter(torch.full((num_heads,), float(init)))
        self._last_z: Optional[Tensor] = None  # dynamic spans of the last forward (for the loss)

    # -- the span ----------------------------------------------------------------------------
    def spans(self, x: Optional[Tensor] = None) -> Tensor:
        """z in positions, float32: ``[H]``, or ``[B, H, M]`` for dynamic spans of queries
        ``x [B, M, C]``."""
        if not self.dynamic:
            return self.span.float() * self.max_span
        with float32_region(x.device):
            z = self.max_span * torch.sigmoid(self.span_proj(x.float())).transpose(1, 2)
        self._last_z = z
        return z

    def window(self, z: Tensor, z_max: Optional[float] = None) -> int:
        """Number of distances kept after trimming: the smallest L >= ceil(max z + R), L <= S, with
        S - L a multiple of ``trim_chunk`` (reference: trim in chunks of 64 positions).

        ``z_max``: max z already on the host (see :func:`host_span_maxima`); otherwise it is read
        from ``z``, a device -> host copy (on a GPU, a synchronisation)."""
        s = self.max_span
        if not self.trim_chunk:
            return s
        if z_max is None:
            z_max = float(z.detach().max()) if z.numel() else 0.0
        needed = min(s, max(1, math.ceil(z_max + self.ramp)))
        return s - ((s - needed) // self.trim_chunk) * self.trim_chunk

    def cache_size(self, buffer: int = 0, z_max: Optional[float] = None) -> int:
        """Previous positions worth keeping for the next call: the current window (+ ``buffer``
        positions in case the spans grow, reference: 64), minus the current token."""
        if self.dynamic:
            return self.max_span - 1
        return min(self.max_span, self.window(self.spans(), z_max) + buffer) - 1

    def log_mask(self, z: Tensor, span: int) -> Tensor:
        """log m_z(x) for the distance-layout columns x = span-1, ..., 0, in float32 (whatever
        the model's dtype: distances and spans need integer resolution up to S).

        ``[H, 1, span]`` for per-head spans, ``[B, H, M, span]`` for dynamic spans."""
        with float32_region(z.device):
            x = torch.arange(span - 1, -1, -1, device=z.device, dtype=torch.float32)
            # z is kept in [0, S] after every step; the clamp only guards the forward (m(0) = 1)
            z = z.float().clamp(0, self.max_span)
            z = z.view(-1, 1, 1) if z.dim() == 1 else z.unsqueeze(-1)
            m = ((self.ramp + z - x) / self.ramp).clamp(0, 1)  # m_z(x) = clamp((R+z-x)/R, 0, 1)
            tiny = torch.finfo(m.dtype).tiny
            return torch.where(m > 0, m.clamp(min=tiny).log(), torch.full_like(m, float("-inf")))

    # -- training helpers ----------------------------------------------------------------------
    def loss(self) -> Tensor:
        """lambda * mean_h z_h (for dynamic spans: the mean z_t of the last forward pass)."""
        if self.dynamic:
            if self._last_z is None:
                return self.span_proj.bias.new_zeros(())
            return self.span_loss * self._last_z.mean()
        return self.span_loss * self.max_span * self.span.float().mean()

    @torch.no_grad()
    def clamp_(self):
        """Keep z in [0, S]. Under fairseq's trainer the model does this after every update; in a
        PyTorch loop ``attach_projection(optimizer)`` (modules/constrained.py) does it after every
        step of that optimizer; call it after editing spans by hand."""
        if not self.dynamic:
            self.span.project_()

    @torch.no_grad()
    def current_spans(self) -> Tensor:
        """z per head in positions (dynamic: mean over the last forward's tokens), detached."""
        if self.dynamic:
            if self._last_z is None:
                return torch.sigmoid(self.span_proj.bias) * self.max_span
            return self._last_z.float().mean(dim=(0, 2))
        return self.spans().float().clamp(0, self.max_span)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, S={self.max_span}, R={self.ramp}, "
                f"lambda={self.span_loss}, "
                f"trim_chunk={self.trim_chunk}, dynamic={self.dynamic}")


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
class SpanBand:
    """The band attention of :class:`AdaptiveSpanAttention` (a part of it, read on its own):
    scaled queries ``q [B, H, M, d]`` over the window of keys at distances 0..span-1, whose logits
    are the content ``q k`` plus the relative position logits and the span's log-mask
    (:meth:`position_logits`), in query chunks (:meth:`chunk_size`); through torch's fused
    attention (:meth:`attend_sdpa`) or op by op (:meth:`attend`, the reference), as
    :meth:`uses_sdpa` decides. It reads the module's ``mask`` (the spans), ``persistent``
    (All-Attention's slots), ``renorm``, ``dropout``, ``max_span``, ``head_dim``, ``query_chunk``
    and ``kernel``."""

    def chunk_size(self, m: int, span: int) -> int:
        """Query chunk c minimising the cost of the band attention, estimated as ~10 passes over
        the M x (c + span - 1) logits plus, when chunked, copies of the key/value windows
        (2 d / c passes). Multiples of ``query_chunk`` dividing M; c = M is no chunking."""
        best, best_cost = m, m + span - 1
        c = self.query_chunk
        while c and c < m:
            cost = (c + span - 1) * (1 + 0.2 * self.head_dim / c)
            if m % c == 0 and cost < best_cost:
                best, best_cost = c, cost
            c *= 2
        return best

    def uses_sdpa(self, q: Tensor) -> bool:
        """Whether the band goes through torch's fused attention (``kernel``: "sdpa" always,
        "auto" on CUDA when the options allow it, "explicit" never)."""
        if self.kernel == "auto":
            return q.is_cuda and self.renorm and self.persistent is None
        return self.kernel == "sdpa"

    def _band_front(self, q: Tensor, k: Tensor, v: Tensor, span: int, pad: Optional[Tensor]):
        """Keys/values of the whole window ``W = M + span - 1``: missing history before the first
        key is zero vectors, masked (``pad`` grows accordingly)."""
        b, m = q.size(0), q.size(2)
        front = m + span - 1 - k.size(2)
        if front > 0:
            k = F.pad(k, (0, 0, front, 0))
            v = F.pad(v, (0, 0, front, 0))
            pad = torch.cat([torch.ones(b, front, dtype=torch.bool, device=q.device),
                             pad if pad is not None else
                             torch.zeros(b, k.size(2) - front, dtype=torch.bool, device=q.device)],
                            dim=1)
        return k, v, pad

    def position_logits(self, q: Tensor, z: Tensor, span: int, key_pe: Tensor,
                        pad: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The logits that do not depend on the keys, in distance layout and float32: ``q_t
        p_{t-x}`` (relative position) + ``log m_z(t-x)`` (span; when renormalising), masked keys
        set to the finite mask value. Returns them ``[B, H, M, span]`` and ``log m``."""
        b, _, m, _ = q.shape
        pe = key_pe[:, :, self.max_span - span:].to(q.dtype)  # distances span-1 .. 0
        logits = torch.matmul(q, pe.unsqueeze(0)).float()
        log_m = self.mask.log_mask(z, span)
        if self.renorm:
            logits.add_(log_m)
        if pad is not None:  # (not checked for any(): a host read, a GPU synchronisation)
            idx = (torch.arange(m, device=q.device).unsqueeze(1)
                   + torch.arange(span, device=q.device).unsqueeze(0))  # key index of (i, j)
            # the model dtype's mask value (when narrower than float32): it survives the fused
            # path's rounding to that dtype, and both paths then add the content logits to it
            value = max(mask_value(q.dtype), mask_value(logits.dtype))
            logits.masked_fill_(pad[:, idx].unsqueeze(1), value)
        return logits, log_m

    def attend_sdpa(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor, span: int, key_pe: Tensor,
                    pad: Optional[Tensor]) -> Tensor:
        """:meth:`attend` through ``F.scaled_dot_product_attention`` (on CUDA a fused kernel of
        torch's choice, memory-efficient or cuDNN: no attention matrix kept for the backward,
        dropout inside): each query chunk is one batch entry against its window of keys, and the
        position logits + log-mask go in as an additive bias in key layout, ``-inf`` off the band
        (built in float32, then rounded once to the model's dtype; the kernel accumulates in
        float32)."""
        b, h, m, d = q.shape
        k, v, pad = self._band_front(q, k, v, span, pad)
        c = self.chunk_size(m, span)
        n, w = m // c, c + span - 1
        logits, _ = self.position_logits(q, z, span, key_pe, pad)
        # [B, H, n, c, span] -> key layout [B, n, H, c, w] (rows 16-aligned), as [B n, H, c, w]
        bias = skew(logits.to(q.dtype).view(b, h, n, c, span).transpose(1, 2), float("-inf"), 16)
        bias = bias.view(b * n, h, c, w)

        def rows(x: Tensor) -> Tensor:  # [B, H, T, d] -> [B, T, H d]
            return x.transpose(1, 2).reshape(b, x.size(2), h * d)

        def heads(x: Tensor, size: int) -> Tensor:  # [.., size, H d] -> [B n, H, size, d]
            return x.reshape(b * n, size, h, d).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(rows(q), c), heads(windows(rows(k), w, c), w), heads(windows(rows(v), w, c), w),
            attn_mask=bias,
            dropout_p=self.dropout if self.training else 0.0, scale=1.0)
        return out.transpose(1, 2).reshape(b, m, h * d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor, span: int, key_pe: Tensor,
               pad: Optional[Tensor]) -> Tensor:
        """Band attention of ``q [B, H, M, d]`` (scaled) over the window: ``k, v [B, H, T, d]`` end
        at the last query; distances 0..span-1; ``pad [B, T]`` True = masked key. Returns
        ``[B, M, H d]``. The explicit path, op by op: the reference of :meth:`attend_sdpa`."""
        b, _, m, _ = q.shape
        k, v, pad = self._band_front(q, k, v, span, pad)
        # queries in chunks of c: chunk n sees keys [n c, n c + c + span - 1) (window copies), so
        # the key-layout tensors are M x (c + span - 1) instead of M x (M + span - 1)
        c = self.chunk_size(m, span)
        n = m // c
        k_win = windows(k, c + span - 1, c)  # [B, H, n, c + span - 1, d]
        v_win = windows(v, c + span - 1, c)
        q_win = q.view(b, q.size(1), n, c, q.size(-1))
        # s_tx = [q_t p_{t-x} (relative position) + log m_z(t-x) (span), masked keys set to the
        # mask value] + q_t k_x (content, key layout -> distance layout); summed in float32 (the
        # log-mask needs it; the softmax is float32 anyway). The content is added after the
        # masking, as the fused kernel adds it to its bias: the two paths agree on every row
        logits, log_m = self.position_logits(q, z, span, key_pe, pad)
        logits.add_(unskew(torch.matmul(q_win, k_win.transpose(-1, -2)), span)
                    .reshape(b, q.size(1), m, span))
        if self.persistent is not None:
            # one softmax over context + persistent slots; the span mask touched the context only
            logits = torch.cat([logits, self.persistent.logits(q).float()], dim=-1)
        probs = torch.softmax(logits, dim=-1)  # float32
        if not self.renorm:  # fairseq port: softmax over the trimmed window, then times m
            m_ctx = log_m.exp()
            if self.persistent is not None:
                m_ctx = torch.cat([m_ctx.expand(*probs.shape[:-1], span),
                                   m_ctx.new_ones(*probs.shape[:-1], probs.size(-1) - span)], -1)
            probs = probs * m_ctx
        probs = probs.to(q.dtype)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        ctx = probs[..., :span].reshape(b, q.size(1), n, c, span)
        out = torch.matmul(skew(ctx), v_win).reshape(q.shape)
        if self.persistent is not None:
            out = out + self.persistent.read(probs[..., span:])
        return out.transpose(1, 2).reshape(b, m, -1)


class AdaptiveSpanAttention(SpanBand, nn.Module):
    """Multi-head attention over a sliding window of S positions with learned spans; batch-first
    ``x [B, M, C]`` (unlike the time-first [T, B, C] of the package's other modules).

    ``forward(x, key_pe, memory=None, past_kv=None, key_padding_mask=None)``:

    * ``x [B, M, C]``: the current block (queries; also keys/values for itself)
    * ``key_pe [1, d_h, S]``: relative position embeddings, column S-1-d = distance d
      (None: use this module's own table, built with ``own_key_pe=True``)
    * ``memory [B, T_m, C]``: hidden states of the previous positions (Transformer-XL cache), or
    * ``past_kv``: projected keys and values ``[B, H, T_m, d_h]`` of the previous positions
      (incremental decoding)
    * ``key_padding_mask [B, T_m + M]`` (True = pad, or any mask ``nn.MultiheadAttention``
      takes) over previous + current positions

    Returns ``(out [B, M, C], (k, v))`` where ``(k, v)`` are previous + current keys/values when
    ``past_kv`` was given (to be cached), else None.

    Here: the projections, the spans and the window they need (:meth:`forward`), the window's keys
    and values from the memory or the decoding cache (:meth:`window_keys_values`); the attention
    over the window is the part :class:`SpanBand`.
    """

    def __init__(self, embed_dim: int, num_heads: int, max_span: int, ramp: int = 32,
                 span_init: float = 0.0, span_loss: float = 0.0, dropout: float = 0.0,
                 trim_chunk: int = 64, dynamic: bool = False, persistent_slots: int = 0,
                 own_key_pe: bool = False, query_chunk: int = 64, renorm: bool = True,
                 exclude_self: bool = False, kernel: str = "auto"):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}: "
                             "choose num_heads dividing embed_dim")
        if kernel not in KERNELS:
            raise ValueError(f"adaptive-span kernel must be one of {', '.join(KERNELS)}, "
                             f"got {kernel!r}")
        if kernel == "sdpa" and (persistent_slots > 0 or not renorm):
            raise ValueError("kernel='sdpa' needs the renormalised span mask and no persistent "
                             "memory (renorm=True, persistent_slots=0): pass those, or "
                             "kernel='auto'")
        self.kernel = kernel
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.max_span = max_span
        self.dropout = dropout
        self.query_chunk = query_chunk
        self.renorm = renorm
        self.exclude_self = exclude_self  # window = the S previous tokens (reference), not 0..S-1
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_normal_(lin.weight)
        self.mask = AdaptiveMask(num_heads, max_span, ramp, span_init, span_loss, trim_chunk,
                                 dynamic, embed_dim)
        self.persistent = (PersistentMemory(persistent_slots, num_heads, self.head_dim)
                           if persistent_slots > 0 else None)
        # a model shares one table between its layers; standalone use gets its own
        self.key_pe = nn.Parameter(torch.randn(1, self.head_dim, max_span)) if own_key_pe else None

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, S={self.max_span}, renorm={self.renorm}, "
                f"exclude_self={self.exclude_self}, kernel={self.kernel}")

    def split_heads(self, x: Tensor) -> Tensor:
        """[B, T, H*d] -> [B, H, T, d]"""
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    @staticmethod
    def _check_layout(x: Tensor, memory: Optional[Tensor], past_kv, key_padding_mask):
        """Batch-first inputs: where the batch sizes of x, memory, past_kv and the padding mask
        disagree (a time-first x [M, B, C] passed), one line saying so."""
        b, m = x.shape[:2]
        prev = memory if memory is not None else (past_kv[0] if past_kv is not None else None)
        n_prev = 0 if prev is None else prev.size(-2)
        wrong = None
        if prev is not None and prev.size(0) != b:
            wrong = f"{'memory' if memory is not None else 'past_kv'} has batch size {prev.size(0)}"
        elif key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, n_prev + m):
            wrong = (f"key_padding_mask has shape {list(key_padding_mask.shape)}, not [B, T_m + M]"
                     f" = [{b}, {n_prev + m}]")
        if wrong:
            raise ValueError(f"AdaptiveSpanAttention takes batch-first x [B, M, C] (got "
                             f"{list(x.shape)}) and {wrong}: pass x as [B, M, C] (transpose a "
                             "time-first [M, B, C]) and masks as [B, T]")

    def cache_size(self, buffer: int = 0, z_max: Optional[float] = None) -> int:
        """Previous positions worth keeping for the next call (see :meth:`AdaptiveMask.cache_size`);
        one more when the window excludes the current token."""
        return min(self.max_span, self.mask.cache_size(buffer, z_max) + int(self.exclude_self))

    def forward(self, x: Tensor, key_pe: Optional[Tensor] = None, memory: Optional[Tensor] = None,
                past_kv: Optional[Tuple[Tensor, Tensor]] = None,
                key_padding_mask: Optional[Tensor] = None, z_max: Optional[float] = None):
        if memory is not None and past_kv is not None:
            raise ValueError("give either memory (hidden states) or past_kv (keys/values), "
                             "not both")
        key_pe = self.key_pe if key_pe is None else key_pe
        if key_pe is None:
            raise ValueError("AdaptiveSpanAttention needs relative position embeddings: pass "
                             f"key_pe [1, d_h = {self.head_dim}, S = {self.max_span}] to forward, "
                             "or build the module with own_key_pe=True")
        self._check_layout(x, memory, past_kv, key_padding_mask)
        key_padding_mask = bool_mask(key_padding_mask)
        m = x.size(1)
        if m == 0:  # no positions: an empty output, the cache as it was
            return self.out_proj(x), past_kv
        z = self.mask.spans(x)
        prev = memory if memory is not None else (past_kv[0] if past_kv is not None else None)
        n_prev = 0 if prev is None else prev.size(-2)
        # L window columns: distances 0..L-1, or 1..L when the current token is excluded (shift)
        shift = int(self.exclude_self)
        span = min(self.mask.window(z, z_max), max(1, n_prev + m - shift))
        keep = min(n_prev, span - 1 + shift)  # previous positions inside the window
        pad = None
        if key_padding_mask is not None:
            pad = key_padding_mask[:, n_prev - keep:key_padding_mask.size(1) - shift]

        k, v, new_kv = self.window_keys_values(x, memory, past_kv, keep)
        if shift:  # the window ends one position before each query
            k, v = k[:, :, :-1], v[:, :, :-1]
        q = self.split_heads(self.q_proj(x)) * self.head_dim ** -0.5
        attend = self.attend_sdpa if self.uses_sdpa(q) else self.attend
        return self.out_proj(attend(q, k, v, z, span, key_pe, pad)), new_kv

    def window_keys_values(self, x: Tensor, memory: Optional[Tensor],
                           past_kv: Optional[Tuple[Tensor, Tensor]], keep: int):
        """Keys and values ``[B, H, keep + M, d_h]`` of the window's last ``keep`` previous
        positions and the block ``x``: from the decoding cache ``past_kv``, which is returned
        extended by the block (to be cached), or projected from the previous hidden states
        ``memory`` (the Transformer-XL cache; then None is returned for the cache)."""
        if past_kv is not None:
            n_prev = past_kv[0].size(-2)
            k_all = torch.cat([past_kv[0], self.split_heads(self.k_proj(x))], dim=2)
            v_all = torch.cat([past_kv[1], self.split_heads(self.v_proj(x))], dim=2)
            return k_all[:, :, n_prev - keep:], v_all[:, :, n_prev - keep:], (k_all, v_all)
        h = x
        if keep:
            h = torch.cat([memory[:, memory.size(1) - keep:].to(x.dtype), x], dim=1)
        return self.split_heads(self.k_proj(h)), self.split_heads(self.v_proj(h)), None


class FeedForward(nn.Module):
    """fc1 - ReLU - dropout - fc2 (the references' FeedForwardLayer; xavier-uniform weights as
    fairseq's examples/adaptive_span, the model may re-initialise them)."""

    def __init__(self, embed_dim: int, ffn_dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        nn.init.xavier_uniform_(self.fc1.weight)
        nn.init.xavier_uniform_(self.fc2.weight)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.dropout, self.training))


class AdaptiveSpanLayer(nn.Module):
    """Post-norm layer as in the reference, batch-first ``x [B, M, C]``: h = LN(x + Attn(x));
    y = LN(h + FFN(h)).

    ``ffn_dim = 0`` drops the FFN: with ``persistent_slots > 0`` this is the All-Attention layer."""

    def __init__(self, embed_dim: int, num_heads: int, ffn_dim: int, max_span: int,
                 ramp: int = 32, span_init: float = 0.0, span_loss: float = 0.0,
                 dropout: float = 0.0, trim_chunk: int = 64, dynamic: bool = False,
                 persistent_slots: int = 0, renorm: bool = True, exclude_self: bool = False,
                 kernel: str = "auto"):
        super().__init__()
        self.attn = AdaptiveSpanAttention(embed_dim, num_heads, max_span, ramp, span_init,
                                          span_loss, dropout, trim_chunk, dynamic, persistent_slots,
                                          renorm=renorm, exclude_self=exclude_self, kernel=kernel)
        self.attn_norm = nn.LayerNorm(embed_dim)
        self.ffn = FeedForward(embed_dim, ffn_dim, dropout) if ffn_dim > 0 else None
        self.ffn_norm = nn.LayerNorm(embed_dim) if ffn_dim > 0 else None

    # what a layer stack needs to plan windows and caches (see modules/span_stack.py)
    def span_mask(self) -> AdaptiveMask:
        """This layer's learned spans (a stack reads the maxima of all its layers at once)."""
        return self.attn.mask

    def cache_size(self, buffer: int = 0, z_max: Optional[float] = None) -> int:
        """Previous positions worth keeping for the next call (window - 1, + ``buffer``)."""
        return self.attn.cache_size(buffer, z_max)

    def empty_kv(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Keys and values of no previous positions, ``[B, H, 0, d_h]`` (first decoding step)."""
        empty = x.new_zeros(x.size(0), self.attn.num_heads, 0, self.attn.head_dim)
        return empty, empty

    def forward(self, x: Tensor, key_pe: Tensor, memory: Optional[Tensor] = None,
                past_kv: Optional[Tuple[Tensor, Tensor]] = None,
                key_padding_mask: Optional[Tensor] = None, z_max: Optional[float] = None):
        a, new_kv = self.attn(x, key_pe, memory, past_kv, key_padding_mask, z_max)
        h = self.attn_norm(x + a)
        if self.ffn is not None:
            h = self.ffn_norm(h + self.ffn(h))
        return h, new_kv


# ---------------------------------------------------------------------------------------------
# model-wide helpers (criterion, task, plots)
# ---------------------------------------------------------------------------------------------
def span_masks(model: nn.Module) -> Iterator[AdaptiveMask]:
    """Every :class:`AdaptiveMask` of a model, in layer order."""
    for mod in model.modules():
        if isinstance(mod, AdaptiveMask):
            yield mod


def host_span_maxima(masks: List[AdaptiveMask], extra: Sequence[Tensor] = ()
                     ) -> Tuple[List[Optional[float]], List[float]]:
    """max z of each mask as a Python float (None for dynamic spans: they depend on the layer's
    input), read in one device -> host copy for all of them together with the values of the
    ``extra`` tensors (a forward pass needs the maxima to size each layer's window; read one by
    one, each would be a GPU synchronisation). Returns the maxima and the extra values, flattened,
    as floats (integers up to 2**53 exactly)."""
    static = [m for m in masks if not m.dynamic]
    parts = [t.detach().reshape(-1).double() for t in extra]
    if static:
        with torch.no_grad():
            parts.append(torch.stack([m.spans().detach().max() for m in static]).double())
    values = torch.cat(parts).tolist() if parts else []
    n_extra = sum(t.numel() for t in extra)
    maxima = iter(values[n_extra:])
    return [None if m.dynamic else next(maxima) for m in masks], values[:n_extra]


def span_penalty(model: nn.Module) -> Optional[Tensor]:
    """lambda * sum over layers of the mean span, a float32 scalar (zero where every lambda is 0,
    so ``loss + span_penalty(model)`` always works; None if the model has no adaptive span)."""
    masks = list(span_masks(model))
    if not masks:
        return None
    losses = [m.loss() for m in masks if m.span_loss > 0]
    if not losses:
        return next(masks[0].parameters()).new_zeros((), dtype=torch.float32)
    return torch.stack(losses).sum()


def clamp_spans(model: nn.Module) -> int:
    """Clamp every span into [0, S] by hand; returns the number of span modules. (Not needed after
    updates of fairseq's trainer, after which the model projects its ``UnitIntervalParameter``s --
    on fairseq's fp32 master copies too, see :mod:`fairseq_attnzoo.compat.mixed_precision` -- nor
    after steps of an optimizer given ``attach_projection``.)"""
    masks = list(span_masks(model))
    for m in masks:
        m.clamp_()
    return len(masks)


def layer_spans(model: nn.Module) -> List[Tensor]:
    """Per layer, the span z of each head (in positions)."""
    return [m.current_spans() for m in span_masks(model)]

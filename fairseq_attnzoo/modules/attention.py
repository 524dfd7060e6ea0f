"""The attention half of the extension point: masks, the incremental-decoding cache, positions,
and the base class every attention replacement derives from.

Everything that is easy to get subtly wrong is written here once:

* **Masking**: key padding masks (``True`` = pad; every form ``nn.MultiheadAttention`` takes, made
  bool by :func:`bool_mask`) and fairseq's causal ``attn_mask`` (float ``-inf`` above the
  diagonal, or bool) are merged into one boolean "blocked" mask, and turned into additive
  logits with a *finite* minimum (:func:`.precision.mask_value`), so a fully padded query row
  yields a uniform distribution instead of NaN.
* **Incremental decoding**: per-token tensors (keys, values, synthesized inputs, ...) are appended to
  a cache kept in fairseq's ``incremental_state`` dict through :class:`FairseqIncrementalState`
  (fairseq's own helper), and reordered along the batch dimension for beam search.
* **Positions**: pad-aware absolute positions (left-padded sources get the same positions as
  unpadded ones), for methods that index tables by position (Synthesizer).

A subclass of :class:`ZooAttention` keeps fairseq's ``MultiheadAttention`` call signature, so it
drops into fairseq's transformer layers, and implements only :meth:`ZooAttention.compute` with the
help of an :class:`AttnContext`.

Imports torch only (fairseq's incremental-state helper is used when fairseq is importable, an
equivalent stand-in otherwise), so the modules work and test without fairseq.
"""

import contextlib
import contextvars
import uuid
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .precision import compute_dtype, mask_value

try:  # fairseq's helper, so our state lives in fairseq's incremental_state exactly like its MHA's
    from fairseq.incremental_decoding_utils import FairseqIncrementalState
except ImportError:  # pragma: no cover - torch-only use

    class FairseqIncrementalState(object):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._incremental_state_id = str(uuid.uuid4())

        def get_incremental_state(self, incremental_state, key):
            full = "{}.{}".format(self._incremental_state_id, key)
            return None if incremental_state is None else incremental_state.get(full)

        def set_incremental_state(self, incremental_state, key, value):
            if incremental_state is not None:
                incremental_state["{}.{}".format(self._incremental_state_id, key)] = value
            return incremental_state


IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


#: float mask entries at or below this are blocked: -inf, and fairseq's finite stand-ins (-1e8,
#: or -1e4 in float16) for it
BLOCKED_AT = -1e4


def bool_mask(mask: Optional[Tensor], name: str = "key_padding_mask",
              check: bool = True) -> Optional[Tensor]:
    """A mask in any form ``nn.MultiheadAttention`` takes, as the bool mask it stands for (True =
    masked; a bool mask as it is): an integer mask (uint8 too) as bool (nonzero = masked); a float
    mask as the additive mask it is (0 attends, -inf or another large negative masks). A float
    mask with any other entry (a soft bias, 1.0 meant as True) stands for no bool mask: refused in
    one line (``check``; the values are read to the host, for float masks only). Every module of
    the package takes its padding masks through this function."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0
    blocked = mask <= BLOCKED_AT
    if check:
        odd = ~(blocked | (mask == 0))
        if bool(odd.any()):
            raise ValueError(
                f"{name} of dtype {str(mask.dtype).replace('torch.', '')} is an additive mask (0 "
                f"attends, -inf masks) but holds {mask[odd][0].item()!r}: pass a bool mask "
                "(True = pad), 0/1 integers, or only 0 and -inf")
    return blocked


def positions_from_padding(padding_mask: Optional[Tensor], length: int, device=None) -> Tensor:
    """Absolute positions 0,1,2,... of non-pad tokens ([B, T] or [1, T] if no mask); pads get 0.
    ``padding_mask``: bool (:func:`bool_mask` makes one of any other).

    Matches fairseq's ``make_positions`` up to the offset, so left-padded and unpadded copies of a
    sentence see the same positions."""
    if padding_mask is None:
        return torch.arange(length, device=device).unsqueeze(0)
    keep = (~padding_mask).long()
    return ((torch.cumsum(keep, dim=1) - 1) * keep).clamp_(min=0)


_SCOPE: "contextvars.ContextVar[Optional[list]]" = contextvars.ContextVar("attnzoo_masks",
                                                                         default=None)


@contextlib.contextmanager
def mask_scope():
    """Derive what comes from a forward pass's masks (pad-aware positions, the boolean and
    additive masks, a method's own) once for all its layers, and drop it with the pass. fairseq
    hands every layer of a forward the same padding mask and the decoder's layers each a new view
    of its one buffered future mask, so a mask is known by the tensor it views and where (each
    derivation is a few kernel launches: the cost of a host-bound step). The zoo's encoder and
    decoder open one around their layers; in plain PyTorch, open one around a model's layer
    loop (without one every call derives its own). A scope inside a scope is the outer one."""
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set([])
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _place(m: Tensor):
    """A mask as the tensor it views and where: (base, version, offset, shape, strides, dtype)."""
    base = m if m._base is None else m._base
    return base, base._version, m.storage_offset(), m.shape, m.stride(), m.dtype


def _derived(masks, key, make):
    """``make()`` once per :func:`mask_scope` for these masks (by place) and ``key``."""
    scope = _SCOPE.get()
    if scope is None:
        return make()
    places = tuple(_place(m) for m in masks if m is not None)
    for got, k, value in scope:
        if k == key and len(got) == len(places) and all(
                g[0] is p[0] and g[1:] == p[1:] for g, p in zip(got, places)):
            return value
    value = make()
    scope.append((places, key, value))
    return value


class AttnContext:
    """Per-call view of masks, cache and positions handed to :meth:`ZooAttention.compute`.

    Shapes are batch-first: queries ``[B, Tq, C]``; everything cached is ``[B, T, ...]``.
    """

    def __init__(self, module: "ZooAttention", incremental_state: IncrementalState,
                 key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                 batch_size: int, q_len: int, static_kv: bool):
        self.module = module
        self.incremental_state = incremental_state
        self.attn_mask = attn_mask
        self.batch_size = batch_size
        self.q_len = q_len
        self.static_kv = static_kv
        self._new_padding = key_padding_mask
        buf = module._get_buffer(incremental_state) if incremental_state is not None else None
        self._buffer: Dict[str, Optional[Tensor]] = buf if buf is not None else {}
        #: number of positions decoded before this call (0 outside incremental decoding)
        self.offset = 0
        if not static_kv and "_padding" in self._buffer:
            self.offset = self._buffer["_padding"].size(1)
        self.key_padding_mask: Optional[Tensor] = key_padding_mask

    @property
    def incremental(self) -> bool:
        return self.incremental_state is not None

    # ---- caching -----------------------------------------------------------------------------
    def cache(self, **tensors: Tensor) -> Dict[str, Tensor]:
        """Append per-token tensors ``[B, T_new, ...]`` to the decoding cache and return the full
        tensors ``[B, offset + T_new, ...]``. Also extends the key padding mask. No-op outside
        incremental decoding."""
        if not self.incremental:
            return tensors
        out = {}
        for name, t in tensors.items():
            prev = self._buffer.get(name)
            out[name] = t if prev is None else torch.cat([prev, t], dim=1)
            self._buffer[name] = out[name]
        new_pad = self._new_padding
        if new_pad is None:
            new_pad = torch.zeros(self.batch_size, self.q_len, dtype=torch.bool,
                                  device=next(iter(tensors.values())).device)
        prev_pad = self._buffer.get("_padding")
        full_pad = new_pad.bool() if prev_pad is None else torch.cat([prev_pad, new_pad.bool()], 1)
        self._buffer["_padding"] = full_pad
        self.key_padding_mask = full_pad if bool(full_pad.any()) else None
        self.module._set_buffer(self.incremental_state, self._buffer)
        return out

    def cache_static(self, name: str, fn) -> Tensor:
        """For encoder-decoder attention: compute ``fn()`` once per sentence and reuse it at every
        decoding step (keys/values of the encoder output)."""
        if self.incremental and name in self._buffer:
            return self._buffer[name]
        value = fn()
        if self.incremental:
            self._buffer[name] = value
            self.module._set_buffer(self.incremental_state, self._buffer)
        return value

    # ---- masking -----------------------------------------------------------------------------
    def blocked(self, k_len: int, device) -> Optional[Tensor]:
        """Boolean mask ``[B or 1, 1, Tq, Tk]``, True where attention is not allowed (padding or
        future). None when nothing is masked."""
        return _derived((self.attn_mask, self.key_padding_mask),
                               ("blocked", self.q_len, k_len, str(device)),
                               lambda: self._blocked(k_len, device))

    def _blocked(self, k_len: int, device) -> Optional[Tensor]:
        mask = None
        if self.attn_mask is not None:
            am = self.attn_mask
            if tuple(am.shape) != (self.q_len, k_len):  # as nn.MultiheadAttention: never sliced
                raise ValueError(
                    f"attn_mask has shape {list(am.shape)} but should be [T_q, T_k] = "
                    f"[{self.q_len}, {k_len}] for these inputs (time-first [T, B, C]): pass "
                    "query/key as [T, B, C] and a mask of exactly that size")
            # fairseq passes -inf (decoder), -1e8 or -1e4 (encoder layer, fp16) for blocked entries
            # (its values not checked: fairseq hands a float one to every pass, and a host read
            # of it would be a GPU synchronisation per pass)
            am = bool_mask(am, "attn_mask", check=False)
            mask = am[-self.q_len:, -k_len:].to(device).view(1, 1, self.q_len, k_len)
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask.to(device=device, dtype=torch.bool)[:, -k_len:]
            pad = pad.view(pad.size(0), 1, 1, k_len)
            mask = pad if mask is None else (mask | pad)
        return mask

    def bias(self, k_len: int, dtype, device) -> Optional[Tensor]:
        """Additive float mask ``[B or 1, 1, Tq, Tk]`` (0 or a large finite negative)."""
        def make():
            blocked = self.blocked(k_len, device)
            if blocked is None:
                return None
            return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(
                blocked, mask_value(dtype))

        return _derived((self.attn_mask, self.key_padding_mask),
                               ("bias", self.q_len, k_len, dtype, str(device)), make)

    def masked(self, logits: Tensor, dtype=None) -> Tensor:
        """``logits [.., Tq, Tk]`` with the blocked entries set to the finite mask value of
        ``dtype`` (default: the logits'; set, not added: an fp16 logit + mask would overflow to
        -inf; one pass, where an out-of-place masked_fill is a clone, then a fill)."""
        blocked = self.blocked(logits.size(-1), logits.device)
        if blocked is None:
            return logits
        return torch.where(blocked, mask_value(dtype or logits.dtype), logits)

    # ---- positions ---------------------------------------------------------------------------
    def key_positions(self, k_len: int, device) -> Tensor:
        """Pad-aware absolute key positions, ``[B or 1, Tk]``."""
        pad = self.key_padding_mask
        return _derived(
            (pad,), ("positions", k_len, str(device)),
            lambda: positions_from_padding(None if pad is None else pad[:, -k_len:], k_len,
                                           device))

    def from_masks(self, key, make):
        """``make()``, computed once for this call's masks (the same tensors in every layer of a
        forward) and ``key`` (a hashable naming what is made and of which sizes)."""
        return _derived((self.attn_mask, self.key_padding_mask), key, make)

    def query_positions(self, device) -> Tensor:
        """Absolute positions of the current queries (self-attention), ``[B or 1, Tq]``."""
        return self.key_positions(self.offset + self.q_len, device)[:, -self.q_len:]

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
               extra_logits: Optional[Tensor] = None) -> Tensor:
        """softmax(q kᵀ·scale + extra + mask) v with dropout, via the fused SDPA kernel.

        q ``[B, H, Tq, dk]``, k ``[B, H, Tk, dk]``, v ``[B, H, Tk, dv]`` -> ``[B, H, Tq, dv]``."""
        # the mask in the dtype the kernel computes in (under autocast, not float32's)
        dtype = compute_dtype(q)
        if extra_logits is None:
            bias = self.bias(k.size(-2), dtype, q.device)
        else:
            bias = self.masked(extra_logits, dtype)
        p = self.module.dropout if self.module.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scale)



class ZooAttention(FairseqIncrementalState, nn.Module):
    """Base class of attention replacements, with fairseq ``MultiheadAttention``'s interface.

    Subclasses set ``embed_dim``, ``num_heads``, ``head_dim`` and ``dropout`` and implement
    ``compute(x_q, x_kv, ctx)``:  ``x_q [B, Tq, C]``, ``x_kv [B, Tk, C]`` (contiguous; the same
    tensor for self-attention, the encoder output for cross-attention) and an
    :class:`AttnContext`, returning ``[B, Tq, C]``.
    """

    #: the weights come from the query alone (Synthesizer): ``key`` and ``value`` must be None
    #: or equal ``query`` (compared by value where they are other tensors, as a user calling
    #: ``attn(norm(x), norm(x), norm(x))`` expects), and nothing is cached as encoder keys
    self_attention_only = False

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}: choose "
                "num_heads dividing embed_dim")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout

    # fairseq's MultiheadAttention signature (query/key/value are time-first [T, B, C])
    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None,
                incremental_state: IncrementalState = None, need_weights: bool = False,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False):
        if before_softmax:
            raise NotImplementedError(f"{type(self).__name__} does not support before_softmax")
        tq, bsz, _ = query.shape
        if key_padding_mask is not None:  # as nn.MultiheadAttention: [B, T_k], never [T_k, B]
            src = (query if key is None else key).size(0)
            if tuple(key_padding_mask.shape) != (bsz, src):
                raise ValueError(
                    f"key_padding_mask has shape {list(key_padding_mask.shape)} but should be "
                    f"[B, T_k] = [{bsz}, {src}] for time-first inputs [T, B, C]: pass query/key "
                    "as [T, B, C] and the padding mask as [B, T]")
            if key_padding_mask.dtype != torch.bool:  # once for the layers of a mask_scope
                mask = key_padding_mask
                key_padding_mask = _derived((mask,), "bool padding", lambda: bool_mask(mask))
        if self.self_attention_only:
            self._check_self_attention(query, key, value, static_kv)
            key = None
        # one batch-first copy of each input, read by all of a module's projections (an nn.Linear
        # on the transposed view would copy it again to flatten, once per projection)
        x_q = query.transpose(0, 1).contiguous()
        if key is None or key is query:
            x_kv = x_q
        elif static_kv and incremental_state is not None and self._get_buffer(incremental_state):
            x_kv = None  # encoder keys/values are already cached
        else:
            x_kv = key.transpose(0, 1).contiguous()
        ctx = AttnContext(self, incremental_state, key_padding_mask, attn_mask, bsz, tq, static_kv)
        out = self.compute(x_q, x_kv, ctx)
        return out.transpose(0, 1), None

    def compute(self, x_q: Tensor, x_kv: Optional[Tensor], ctx: AttnContext) -> Tensor:
        raise NotImplementedError

    def _check_self_attention(self, query: Tensor, key: Optional[Tensor],
                              value: Optional[Tensor], static_kv: bool):
        """For :attr:`self_attention_only`: key and value None, ``query`` itself (fairseq's
        call), or tensors equal to it (one comparison each, only then)."""
        def same(t: Optional[Tensor]) -> bool:
            return t is None or t is query or (t.shape == query.shape and torch.equal(t, query))

        if static_kv or not (same(key) and same(value)):
            raise ValueError(
                f"{type(self).__name__} is self-attention only (its weights come from the query "
                "alone): pass key and value equal to query, or None (with static_kv=False); for "
                "attention over another sequence use ZooMultiheadAttention")

    # helpers -----------------------------------------------------------------------------------
    def split_heads(self, x: Tensor, head_dim: Optional[int] = None) -> Tensor:
        """[B, T, H*d] -> [B, H, T, d]"""
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, head_dim or self.head_dim).transpose(1, 2)

    @staticmethod
    def merge_heads(x: Tensor) -> Tensor:
        """[B, H, T, d] -> [B, T, H*d]"""
        b, h, t, d = x.shape
        return x.transpose(1, 2).reshape(b, t, h * d)

    def _get_buffer(self, incremental_state: IncrementalState) -> Optional[Dict[str, Optional[Tensor]]]:
        return self.get_incremental_state(incremental_state, "zoo_attn_state")

    def _set_buffer(self, incremental_state: IncrementalState, buffer):
        return self.set_incremental_state(incremental_state, "zoo_attn_state", buffer)

    # fairseq's decoder layer peeks at this (cross_self_attention); keep the MHA name working
    def _get_input_buffer(self, incremental_state: IncrementalState):
        return self._get_buffer(incremental_state) or {}

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search reorders hypotheses: every cached tensor is batch-first."""
        buf = self._get_buffer(incremental_state)
        if buf is not None:
            for k, v in buf.items():
                buf[k] = None if v is None else v.index_select(0, new_order)
            self._set_buffer(incremental_state, buf)
        return incremental_state

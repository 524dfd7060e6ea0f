"""The layer stack of an adaptive-span / All-Attention model (Transformer-XL style).

One module owns what the layers of such a model share and what is carried from call to call:

* ``key_pe [1, d_h, S]``: the relative position embeddings, one table for every layer (column
  S-1-x is distance x);
* the **window plan**: the largest span z of every layer, read from the device in one copy per
  forward pass (on a GPU every read is a synchronisation), which sizes each layer's trimmed window
  and cache (:meth:`AdaptiveSpanLayer.cache_size`);
* the **stream cache** (:meth:`forward` with ``stream_pos``): for every layer, the hidden states
  of its input over the last window + ``cache_buffer`` positions (detached), prepended to the next
  block of the same streams. Train and eval, and each group of streams (``stream_id`` of the first
  row), keep separate caches; a cache is used only when the block index continues it (``stream_pos
  == previous + 1``), so a new epoch, a validation restart or resumed training starts empty;
* the **decoding cache** (:meth:`step`): per layer the keys/values of the last window - 1
  positions, in a dict the caller keeps (fairseq's ``incremental_state``) and may reorder.

A forward pass without ``stream_pos`` sees the given positions only and keeps no state.

torch only.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .adaptive_span import AdaptiveSpanLayer, host_span_maxima


@dataclass
class StreamState:
    """What the stream cache keeps for one (train/eval, stream group) between two blocks."""

    next: List[int]  # the block index (stream_pos) per row that continues this cache
    device: torch.device
    mems: List[Tuple[Tensor, Tensor]]  # per layer: hidden states [B, T, C], padding [B, T]
    padded: bool  # whether the cache may hold padding (False: no padding mask is needed)


class AdaptiveSpanStack(nn.Module):
    """``num_layers`` :class:`AdaptiveSpanLayer` s (batch-first ``[B, M, C]``) sharing one relative
    position table, with the stream and decoding caches (see the module docstring).

    Args:
        num_layers, embed_dim, num_heads, ffn_dim, max_span: L, d, H, FFN size (0: none), S
        cache_buffer: stream cache positions kept beyond the current window, since spans may grow
            (reference: 64)
        **layer_options: the other options of :class:`AdaptiveSpanLayer` (ramp, span_init, ...)
    """

    def __init__(self, num_layers: int, embed_dim: int, num_heads: int, ffn_dim: int,
                 max_span: int, cache_buffer: int = 64, **layer_options):
        super().__init__()
        self.cache_buffer = cache_buffer
        self.key_pe = nn.Parameter(torch.randn(1, embed_dim // num_heads, max_span))
        self.layers = nn.ModuleList([
            AdaptiveSpanLayer(embed_dim, num_heads, ffn_dim, max_span, **layer_options)
            for _ in range(num_layers)])
        # not parameters, not saved: (train/eval, first stream id) -> StreamState
        self.streams: Dict[Tuple[str, int], StreamState] = {}

    def window_plan(self, extra: Sequence[Tensor] = ()
                    ) -> Tuple[List[Optional[float]], List[float]]:
        """Per layer, max z as a Python float (None for dynamic spans), and the values of the
        ``extra`` tensors, in one host read (:func:`host_span_maxima`)."""
        return host_span_maxima([layer.span_mask() for layer in self.layers], extra)

    # -- training, validation, plain forward -----------------------------------------------------
    def forward(self, x: Tensor, pad: Tensor, stream_pos: Optional[Tensor] = None,
                stream_id: Optional[Tensor] = None) -> Tuple[Tensor, List[Tensor]]:
        """``x [B, M, C]`` (embedded block), ``pad [B, M]`` (True = padding); with ``stream_pos
        [B]`` (block index) and ``stream_id [B]`` the block continues the stream cache. Returns
        the last layer's output and the inner states (the input, then every layer's output)."""
        # what the forward needs on the host is read in one device -> host copy, not per layer:
        # whether anything is padding, the stream group and positions, and the window plan
        flags = [pad.any()]
        if stream_pos is not None:
            flags += [stream_pos.new_zeros(1) if stream_id is None else stream_id.view(-1)[:1],
                      stream_pos]
        z_max, host = self.window_plan(flags)
        host = [int(v) for v in host]
        key = mems = None
        if stream_pos is not None:  # one cache per (train/eval, group of streams)
            key = ("train" if self.training else "eval", host[1])
            mems = self._stream_memory(key, host[2:], x.device)
        padded = bool(host[0]) or (mems is not None and self.streams[key].padded)
        inner_states = [x]
        new_mems = []
        for i, layer in enumerate(self.layers):
            kpm = pad
            memory = None
            if mems is not None:
                memory, mem_pad = mems[i]
                kpm = torch.cat([mem_pad, pad], dim=1)
            if stream_pos is not None:  # keep the window (+ buffer) of this layer's inputs
                keep = layer.cache_size(self.cache_buffer, z_max[i])
                h = x.detach() if memory is None else torch.cat([memory, x.detach()], dim=1)
                new_mems.append((h[:, h.size(1) - min(keep, h.size(1)):],
                                 kpm[:, kpm.size(1) - min(keep, kpm.size(1)):]))
            x, _ = layer(x, self.key_pe, memory=memory, key_padding_mask=kpm if padded else None,
                         z_max=z_max[i])
            inner_states.append(x)
        if key is not None:  # (padded: a superset flag for the kept cache, only a fast path)
            self.streams[key] = StreamState([p + 1 for p in host[2:]], x.device, new_mems, padded)
        return x, inner_states

    def _stream_memory(self, key, stream_pos: List[int], device: torch.device):
        """The cache left by the previous block of the same streams, or None (new stream)."""
        entry = self.streams.get(key)
        if entry is None or entry.device != device or entry.next != stream_pos:
            return None
        return entry.mems

    def reset_streams(self):
        """Forget the stream caches (they are rebuilt from the next block on)."""
        self.streams.clear()

    # -- incremental decoding --------------------------------------------------------------------
    def step(self, x: Tensor, pad: Tensor,
             state: Dict[str, Tensor]) -> Tuple[Tensor, List[Tensor]]:
        """The next positions ``x [B, M, C]`` (``pad [B, M]``) after those cached in ``state``
        (per layer i: keys ``k{i}``, values ``v{i}`` ``[B, H, T, d_h]``, padding ``pad{i}``;
        empty on the first call), which is updated in place to the new window."""
        z_max, _ = self.window_plan()
        inner_states = [x]
        for i, layer in enumerate(self.layers):
            if f"k{i}" in state:
                past = (state[f"k{i}"], state[f"v{i}"])
                kpm = torch.cat([state[f"pad{i}"], pad], dim=1)
            else:  # first call: no previous positions
                past, kpm = layer.empty_kv(x), pad
            x, (k, v) = layer(x, self.key_pe, past_kv=past,
                              key_padding_mask=kpm if bool(kpm.any()) else None, z_max=z_max[i])
            keep = min(layer.cache_size(z_max=z_max[i]), k.size(2))
            state[f"k{i}"] = k[:, :, k.size(2) - keep:]
            state[f"v{i}"] = v[:, :, v.size(2) - keep:]
            state[f"pad{i}"] = kpm[:, kpm.size(1) - keep:]
            inner_states.append(x)
        return x, inner_states

    def extra_repr(self) -> str:
        return f"S={self.key_pe.size(-1)}, cache_buffer={self.cache_buffer}"

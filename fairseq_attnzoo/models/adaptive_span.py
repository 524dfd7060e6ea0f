"""Adaptive-span and All-Attention language models (decoder-only, Transformer-XL style).

Model ``attnzoo_adaptive_span_lm``; archs ``adaptive_span_lm`` (paper's 12-layer enwik8 model),
``adaptive_span_lm_small`` (reference ``enwik8_small.sh``), ``adaptive_span_lm_large`` (24 layers),
``all_attention_lm`` (18 layers, N=1024 persistent vectors, no FFN) and ``all_attention_lm_large``
(36 layers, N=2048).

This is a dedicated decoder rather than a sublayer of the zoo transformer: the method needs a cache
of previous segments carried across batches, relative positions over that cache with one table
shared by the layers, no absolute positions, and the reference's post-norm layer without residual
dropout. The math lives in :mod:`fairseq_attnzoo.modules.adaptive_span` (plain PyTorch); this file
wires embeddings, the layer stack and three ways of feeding context:

* **stream mode** (training/validation with ``--task attnzoo_stream_lm``): the task adds
  ``stream_pos`` (block index) and ``stream_id`` to ``net_input``; the decoder keeps the hidden
  states of the last positions of every layer (detached) and prepends them to the next block of
  the same streams. Train and eval, and each group of streams (``--update-freq``), keep separate
  caches; a cache is dropped when the block index does not continue it (new epoch, validation
  restart, resumed training).
* **incremental decoding** (``SequenceGenerator``): keys/values of the window are cached in
  ``incremental_state`` and reordered for beam search.
* **plain forward** (any other caller): the given tokens only, no state.
"""

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import (
    MODEL_REGISTRY,
    FairseqIncrementalDecoder,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
)

from ..modules.adaptive_span import (
    AdaptiveMask,
    AdaptiveSpanLayer,
    clamp_spans,
    host_span_maxima,
    layer_spans,
    span_penalty,
)

MAX_POSITIONS = 10**6  # relative positions over a stream: no absolute limit
WEIGHT_INITS = ("fairseq_example", "torch_default")


@dataclass
class AdaptiveSpanLMConfig(FairseqDataclass):
    """Defaults: the paper's 12-layer enwik8 model (arch ``adaptive_span_lm``)."""

    decoder_embed_dim: int = field(default=512, metadata={"help": "model size d (default 512)"})
    decoder_ffn_embed_dim: int = field(
        default=2048, metadata={"help": "FFN inner size (default 2048); 0 removes the FFN "
                                "(All-Attention, with --persistent-memory-size)"})
    decoder_layers: int = field(default=12, metadata={"help": "number of layers (default 12)"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "heads H (default 8)"})
    dropout: float = field(
        default=0.3, metadata={"help": "the paper's dropout: on attention weights and on the FFN "
                               "hidden layer (no residual dropout, as the reference; default 0.3)"})
    emb_dropout: float = field(
        default=0.0, metadata={"help": "dropout on input embeddings and final hidden states "
                               "(reference --emb-dropout, default 0)"})
    attn_span: int = field(
        default=8192, metadata={"help": "maximum span S: size of the relative position table and "
                                "of the window (default 8192)"})
    adaptive_span_ramp: int = field(
        default=32, metadata={"help": "ramp R of the soft mask m_z(x) = clamp((R+z-x)/R, 0, 1) "
                              "(default 32)"})
    adaptive_span_init: float = field(
        default=0.0, metadata={"help": "initial span as a fraction z/S (default 0)"})
    adaptive_span_loss: float = field(
        default=5e-7, metadata={"help": "lambda of the L1 span penalty lambda * sum_layers "
                                "mean_heads z (default 5e-7; enwik8 small config 2e-6)"})
    adaptive_span_trim_chunk: int = field(
        default=64, metadata={"help": "trim keys/values/cache to the largest span + R in steps of "
                              "this many positions; 0 = never trim (default 64)"})
    adaptive_span_cache_buffer: int = field(
        default=64, metadata={"help": "extra cached positions beyond the current window, since "
                              "spans may grow (reference: 64)"})
    adaptive_span_dynamic: bool = field(
        default=False, metadata={"help": "input-dependent span z_t = S*sigmoid(v.x_t + b) per head "
                                 "(the paper's dynamic attention span; default off)"})
    adaptive_span_no_renorm: bool = field(
        default=False, metadata={"help": "do not renormalise the masked attention weights (as "
                                 "fairseq's examples/adaptive_span port; default: renormalise, "
                                 "paper eq. 3)"})
    adaptive_span_exclude_self: bool = field(
        default=False, metadata={"help": "attend to the S previous tokens only, not to the current "
                                 "one (window distances 1..S, as both reference codes; default: "
                                 "distances 0..S-1, a token always sees itself)"})
    adaptive_span_weight_init: ChoiceEnum(list(WEIGHT_INITS)) = field(
        default="fairseq_example", metadata={
            "help": "initialisation: fairseq_example = fairseq's examples/adaptive_span port "
                    "(embeddings N(0, d^-1/2), xavier-normal attention projections, xavier-uniform "
                    "FFN weights); torch_default = PyTorch's default inits, as the authors' "
                    "facebookresearch/adaptive-span code (default fairseq_example)"})
    persistent_memory_size: int = field(
        default=0, metadata={"help": "N persistent key/value vectors per head (All-Attention); "
                             "0 = none (default 0)"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "tie input and output embeddings (reference: untied)"})


def _defaults() -> Dict[str, object]:
    return {f.name: f.default for f in fields(AdaptiveSpanLMConfig)}


def _check(args):
    """One-line errors naming the flag to fix."""
    d, h = args.decoder_embed_dim, args.decoder_attention_heads
    if d % h:
        raise ValueError(f"--decoder-embed-dim {d} is not divisible by "
                         f"--decoder-attention-heads {h}")
    if args.attn_span < 1:
        raise ValueError(f"--attn-span must be >= 1, got {args.attn_span}")
    if args.adaptive_span_ramp < 1:
        raise ValueError(f"--adaptive-span-ramp must be >= 1, got {args.adaptive_span_ramp}")
    if not 0.0 <= args.adaptive_span_init <= 1.0:
        raise ValueError(f"--adaptive-span-init is a fraction of --attn-span, in [0, 1]; got "
                         f"{args.adaptive_span_init}")
    if args.adaptive_span_trim_chunk < 0 or args.adaptive_span_cache_buffer < 0:
        raise ValueError("--adaptive-span-trim-chunk and --adaptive-span-cache-buffer must be >= 0")
    if args.persistent_memory_size < 0 or args.decoder_ffn_embed_dim < 0:
        raise ValueError("--persistent-memory-size and --decoder-ffn-embed-dim must be >= 0")


class AdaptiveSpanDecoder(FairseqIncrementalDecoder):
    """Embeddings -> adaptive-span layers (shared relative position table) -> output projection."""

    def __init__(self, args, dictionary):
        super().__init__(dictionary)
        d, heads = args.decoder_embed_dim, args.decoder_attention_heads
        self.padding_idx = dictionary.pad()
        self.cache_buffer = args.adaptive_span_cache_buffer
        self.embed_tokens = nn.Embedding(len(dictionary), d, padding_idx=self.padding_idx)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=d ** -0.5)  # fairseq example's
        nn.init.zeros_(self.embed_tokens.weight[self.padding_idx])
        self.emb_dropout = args.emb_dropout
        # relative position embeddings shared by every layer; column S-1-x is distance x
        self.key_pe = nn.Parameter(torch.randn(1, d // heads, args.attn_span))
        self.layers = nn.ModuleList([
            AdaptiveSpanLayer(d, heads, args.decoder_ffn_embed_dim, args.attn_span,
                              ramp=args.adaptive_span_ramp, span_init=args.adaptive_span_init,
                              span_loss=args.adaptive_span_loss, dropout=args.dropout,
                              trim_chunk=args.adaptive_span_trim_chunk,
                              dynamic=args.adaptive_span_dynamic,
                              persistent_slots=args.persistent_memory_size,
                              renorm=not args.adaptive_span_no_renorm,
                              exclude_self=bool(getattr(args, "adaptive_span_exclude_self", False)))
            for _ in range(args.decoder_layers)])
        self.share_embed = args.share_decoder_input_output_embed
        if self.share_embed:
            self.output_projection = None
        else:
            self.output_projection = nn.Linear(d, len(dictionary))
        if (getattr(args, "adaptive_span_weight_init", None) or "fairseq_example") == "torch_default":
            self._torch_default_init()
        # stream caches (not parameters, not saved): (train/eval, first stream id) -> next block
        # index and the cached hidden states of every layer
        self._streams: Dict[tuple, dict] = {}

    @torch.no_grad()
    def _torch_default_init(self):
        """PyTorch's default inits, as facebookresearch/adaptive-span (which sets none itself):
        nn.Embedding N(0, 1), nn.Linear kaiming-uniform weights and U(±1/sqrt(fan_in)) biases.
        key_pe stays N(0, 1), persistent memory keeps its reference init and the dynamic-span
        predictor (our extension) its own."""
        nn.init.normal_(self.embed_tokens.weight)
        self.embed_tokens.weight[self.padding_idx].zero_()
        own = {id(m.span_proj) for m in self.modules() if isinstance(m, AdaptiveMask) and m.dynamic}
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and id(mod) not in own:
                mod.reset_parameters()

    # -- fairseq decoder API -------------------------------------------------------------------
    def forward(self, prev_output_tokens: Tensor, encoder_out=None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                features_only: bool = False, src_lengths=None, stream_pos: Optional[Tensor] = None,
                stream_id: Optional[Tensor] = None, **unused):
        x, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state,
                                         stream_pos=stream_pos, stream_id=stream_id)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def output_layer(self, features: Tensor) -> Tensor:
        if self.output_projection is None:
            return F.linear(features, self.embed_tokens.weight)
        return self.output_projection(features)

    def max_positions(self) -> int:
        return MAX_POSITIONS

    def extract_features(self, tokens: Tensor, incremental_state=None,
                         stream_pos: Optional[Tensor] = None, stream_id: Optional[Tensor] = None,
                         **unused):
        if incremental_state is not None:
            return self._forward_incremental(tokens, incremental_state)
        pad = tokens.eq(self.padding_idx)
        # what the forward needs on the host is read in two device -> host copies, not per layer
        # (on a GPU every read is a synchronisation): whether anything is padding, the stream
        # group and positions, and the spans' maxima (window sizes)
        flags = [pad.any().view(1).long()]
        if stream_pos is not None:
            flags += [stream_pos.new_zeros(1) if stream_id is None else stream_id.view(-1)[:1],
                      stream_pos.view(-1)]
        host = torch.cat(flags).tolist()
        key = mems = None
        if stream_pos is not None:  # one cache per (train/eval, group of streams)
            key = ("train" if self.training else "eval", host[1])
            mems = self._stream_memory(key, host[2:], tokens.device)
        padded = bool(host[0]) or (mems is not None and self._streams[key]["padded"])
        z_max = host_span_maxima([layer.attn.mask for layer in self.layers])
        x = F.dropout(self.embed_tokens(tokens), self.emb_dropout, self.training)
        inner_states = [x]
        new_mems = []
        for i, layer in enumerate(self.layers):
            kpm = pad
            memory = None
            if mems is not None:
                memory, mem_pad = mems[i]
                kpm = torch.cat([mem_pad, pad], dim=1)
            if stream_pos is not None:  # keep the window (+ buffer) of this layer's inputs
                keep = layer.attn.cache_size(self.cache_buffer, z_max[i])
                h = x.detach() if memory is None else torch.cat([memory, x.detach()], dim=1)
                new_mems.append((h[:, h.size(1) - min(keep, h.size(1)):],
                                 kpm[:, kpm.size(1) - min(keep, kpm.size(1)):]))
            x, _ = layer(x, self.key_pe, memory=memory, key_padding_mask=kpm if padded else None,
                         z_max=z_max[i])
            inner_states.append(x)
        if key is not None:  # (padded: a superset flag for the kept cache, only a fast path)
            self._streams[key] = {"next": [p + 1 for p in host[2:]], "device": tokens.device,
                                  "mems": new_mems, "padded": padded}
        x = F.dropout(x, self.emb_dropout, self.training)
        return x, {"attn": [None], "inner_states": inner_states}

    def _stream_memory(self, key, stream_pos: List[int], device: torch.device):
        """The cache left by the previous block of the same streams, or None (new stream)."""
        entry = self._streams.get(key)
        if entry is None or entry["device"] != device or entry["next"] != stream_pos:
            return None
        return entry["mems"]

    def reset_streams(self):
        """Forget the stream caches (they are rebuilt from the next block on)."""
        self._streams.clear()

    def _forward_incremental(self, tokens: Tensor, incremental_state):
        state = self.get_incremental_state(incremental_state, "span_state") or {}
        done = int(state["steps"][0]) if "steps" in state else 0
        tokens = tokens[:, done:]  # the generator passes the whole prefix; cached ones are skipped
        pad = tokens.eq(self.padding_idx)
        x = self.embed_tokens(tokens)
        inner_states = [x]
        z_max = host_span_maxima([layer.attn.mask for layer in self.layers])
        for i, layer in enumerate(self.layers):
            if f"k{i}" in state:
                past = (state[f"k{i}"], state[f"v{i}"])
                kpm = torch.cat([state[f"pad{i}"], pad], dim=1)
            else:  # first call: no previous positions
                empty = x.new_zeros(x.size(0), layer.attn.num_heads, 0, layer.attn.head_dim)
                past, kpm = (empty, empty), pad
            x, (k, v) = layer(x, self.key_pe, past_kv=past,
                              key_padding_mask=kpm if bool(kpm.any()) else None, z_max=z_max[i])
            keep = min(layer.attn.cache_size(z_max=z_max[i]), k.size(2))
            state[f"k{i}"] = k[:, :, k.size(2) - keep:]
            state[f"v{i}"] = v[:, :, v.size(2) - keep:]
            state[f"pad{i}"] = kpm[:, kpm.size(1) - keep:]
            inner_states.append(x)
        state["steps"] = torch.full((tokens.size(0),), done + tokens.size(1), dtype=torch.long,
                                    device=tokens.device)
        self.set_incremental_state(incremental_state, "span_state", state)
        return x, {"attn": [None], "inner_states": inner_states}

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        state = self.get_incremental_state(incremental_state, "span_state")
        if state is None:
            return
        for key, value in state.items():
            state[key] = value.index_select(0, new_order)
        self.set_incremental_state(incremental_state, "span_state", state)


@register_model("attnzoo_adaptive_span_lm")
class AdaptiveSpanLanguageModel(FairseqLanguageModel):
    """Adaptive-span character LM (see module docstring)."""

    #: the task the generic tests and recipes train it with (streams with a cache)
    zoo_task = "attnzoo_stream_lm"
    #: generic-test hooks: criterion, tiny sizes (S=16 < 24 tokens and R=4 so that the sliding
    #: window and trimming are exercised), eval-lm streams
    zoo_test_flags = ["--criterion", "attnzoo_span_loss"]
    zoo_tiny = {"attn_span": 16, "adaptive_span_ramp": 4, "adaptive_span_trim_chunk": 4}
    zoo_cli_eval_flags = ["--tokens-per-sample", "24", "--batch-size", "4"]
    #: options this model sets before the dataclass defaults
    preset: Dict[str, object] = {}

    @staticmethod
    def add_args(parser):
        gen_parser_from_dataclass(parser, AdaptiveSpanLMConfig(), delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        _fill(args, cls.preset)
        _check(args)
        return cls(AdaptiveSpanDecoder(args, task.target_dictionary))

    # span bookkeeping used by the criterion, the task and scripts/plot_spans.py
    def span_penalty(self) -> Optional[Tensor]:
        return span_penalty(self)

    def clamp_spans(self) -> int:
        return clamp_spans(self)

    def layer_spans(self) -> List[Tensor]:
        return layer_spans(self)


ALL_ATTENTION = dict(decoder_ffn_embed_dim=0, decoder_layers=18, persistent_memory_size=1024,
                     adaptive_span_loss=1e-7)


@register_model("attnzoo_all_attention_lm")
class AllAttentionLanguageModel(AdaptiveSpanLanguageModel):
    """All-Attention LM: adaptive-span attention layers with N persistent key/value vectors per
    head and no FFN (Sukhbaatar et al. 2019, "Augmenting Self-attention with Persistent Memory")."""

    zoo_tiny = dict(AdaptiveSpanLanguageModel.zoo_tiny, persistent_memory_size=8)
    preset = ALL_ATTENTION


def _fill(args, preset: Dict[str, object]):
    """Options the user left unset: from ``preset``, then from the dataclass defaults."""
    for name, value in list(preset.items()) + list(_defaults().items()):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _arch(model: str, name: str, **preset):
    def arch(args):
        _fill(args, dict(MODEL_REGISTRY[model].preset, **preset))

    arch.__name__ = name
    arch.__doc__ = f"{name}: {preset or 'the model defaults'}"
    register_model_architecture(model, name)(arch)
    return arch


_arch("attnzoo_adaptive_span_lm", "attnzoo_adaptive_span_lm")
_arch("attnzoo_all_attention_lm", "attnzoo_all_attention_lm")
# paper, enwik8 12 layers / 38M (reference experiments/enwik8.sh): the dataclass defaults
_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm")
# reference experiments/enwik8_small.sh: 8 layers, d 256, S 1024, no dropout, lambda 2e-6
_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm_small", decoder_embed_dim=256,
      decoder_ffn_embed_dim=1024, decoder_layers=8, decoder_attention_heads=4, attn_span=1024,
      dropout=0.0, adaptive_span_loss=2e-6)
# paper, enwik8 24 layers / 209M (reference experiments/enwik8_large.sh)
_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm_large", decoder_embed_dim=768,
      decoder_ffn_embed_dim=4096, decoder_layers=24, decoder_attention_heads=8, dropout=0.4)
# All-Attention small, 18 layers / 39M (reference experiments/enwik8_pers_small.sh)
_arch("attnzoo_all_attention_lm", "all_attention_lm")
# All-Attention large, 36 layers / 114M (reference experiments/enwik8_pers.sh)
_arch("attnzoo_all_attention_lm", "all_attention_lm_large", decoder_layers=36,
      persistent_memory_size=2048, dropout=0.4)

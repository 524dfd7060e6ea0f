"""Adaptive-span and All-Attention language models (decoder-only, Transformer-XL style).

Model ``attnzoo_adaptive_span_lm``; archs ``adaptive_span_lm`` (paper's 12-layer enwik8 model),
``adaptive_span_lm_small`` (reference ``enwik8_small.sh``), ``adaptive_span_lm_large`` (24 layers);
model ``attnzoo_all_attention_lm``; archs ``all_attention_lm`` (18 layers, N=1024 persistent
vectors, no FFN) and ``all_attention_lm_large`` (36 layers, N=2048).

Not the zoo transformer with a swapped sublayer: the method needs a cache of previous segments
carried across batches, relative positions over that cache with one table shared by the layers, no
absolute positions, and the reference's post-norm layer without residual dropout. All of that is
one plain PyTorch module, :class:`~fairseq_attnzoo.modules.span_stack.AdaptiveSpanStack` (the
attention math: :mod:`fairseq_attnzoo.modules.adaptive_span`). This file is the fairseq wiring:
embeddings -> the stack -> output projection, and three ways of feeding context:

* **stream mode** (training/validation with ``--task attnzoo_stream_lm``): the task adds
  ``stream_pos`` (block index) and ``stream_id`` to ``net_input``, and the stack continues its
  stream cache (hidden states of the previous block of the same streams, per train/eval and
  stream group; dropped when the block index does not continue it);
* **incremental decoding** (``SequenceGenerator``): the stack's keys/values of the window are kept
  in fairseq's ``incremental_state`` and reordered for beam search;
* **plain forward** (any other caller): the given tokens only, no state.

The archs register through :func:`~fairseq_attnzoo.models.registry.register_arch` like every other
zoo arch: presets over the model's base arch, which fills :class:`AdaptiveSpanLMConfig`'s defaults.
"""

import logging
import shlex
import sys
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import FairseqIncrementalDecoder, FairseqLanguageModel, register_model
from fairseq.tasks import TASK_REGISTRY, FairseqTask
from fairseq.tasks.language_modeling import LanguageModelingTask

from .. import compat
from ..messages.command import program
from ..messages.errors import ZooConfigError
from ..modules.adaptive_span import (KERNELS as SPAN_KERNELS, AdaptiveMask, clamp_spans,
                                     layer_spans, span_penalty)
from ..modules.constrained import project_bounded_
from ..modules.span_stack import AdaptiveSpanStack
from ..tasks.stream_lm import StreamLanguageModelingTask
from .registry import apply_base_arch, fill_unset, register_arch, register_base_arch

logger = logging.getLogger(__name__)

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
    adaptive_span_kernel: ChoiceEnum(list(SPAN_KERNELS)) = field(  # type: ignore
        default="auto", metadata={
            "help": "how the band attention runs: sdpa = torch's fused "
                    "scaled_dot_product_attention (on CUDA a fused kernel of torch's choice) with the "
                    "position logits and span mask "
                    "as a bias; explicit = op by op (the reference path); auto = sdpa on CUDA "
                    "unless --adaptive-span-no-renorm or --persistent-memory-size need explicit "
                    "(default auto)"})
    persistent_memory_size: int = field(
        default=0, metadata={"help": "N persistent key/value vectors per head (All-Attention); "
                             "0 = none (default 0)"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "tie input and output embeddings (reference: untied)"})


def _common_flag(args, name: str) -> bool:
    """A precision flag of the run: on the argparse Namespace fairseq-train builds models from, or
    (fairseq-hydra-train hands over the ``model`` node of its config) in the config's ``common``."""
    if not OmegaConf.is_config(args):
        return bool(getattr(args, name, False))
    common = args._get_root().get("common", None)
    return bool(args.get(name, None) or (common is not None and common.get(name, False)))


def uses_fp16_optimizer(args) -> bool:
    """Whether fairseq's trainer steps fp32 master copies (``FP16Optimizer``) for these flags."""
    flag = lambda name: _common_flag(args, name)  # noqa: E731
    return ((flag("fp16") or flag("bf16")) and not flag("amp")
            and not (flag("memory_efficient_fp16") or flag("memory_efficient_bf16")))


def _check_projection(args):
    """The spans are projected onto [0, 1] after every update by the model itself; refuse the
    setups where that projection would silently not happen."""
    if getattr(args, "ddp_backend", None) == "slowmo":
        raise ValueError("--ddp-backend slowmo replaces the post-update call that projects the "
                         "adaptive spans onto [0, 1]: use --ddp-backend legacy_ddp or c10d")
    if uses_fp16_optimizer(args):
        compat.require("fairseq_fp16_master_projection",
                       "adaptive spans under --fp16/--bf16 (fp32 master copies kept in [0, 1])",
                       "or train with --amp or --memory-efficient-fp16")


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
    if str(getattr(args, "adaptive_span_kernel", None)) == "sdpa" and (
            args.persistent_memory_size > 0 or args.adaptive_span_no_renorm):
        raise ValueError("--adaptive-span-kernel sdpa needs the renormalised span mask and no "
                         "persistent memory: drop --adaptive-span-no-renorm / "
                         "--persistent-memory-size, or use --adaptive-span-kernel auto")


#: commands that decode with incremental state (the window is cached there): no hint
GENERATORS = ("fairseq-interactive", "fairseq-generate", "attnzoo-sample")
#: flags of fairseq's language_modeling task that the stream task refuses or ignores
NOT_STREAM_FLAGS = ("--context-window", "--sample-break-mode", "--task")


def stream_command(argv, program: str) -> str:
    """``program argv`` with ``--task attnzoo_stream_lm`` instead of its task and without the
    block options that do not apply to streams."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in NOT_STREAM_FLAGS:
            skip = "=" not in a
            continue
        out.append(a)
    return shlex.join([program] + out + ["--task", "attnzoo_stream_lm"])


def _check_task(task):
    """This model carries its cache of previous segments only under its stream task: under
    fairseq's language_modeling task every block is scored without that context (enwik8: 2.687
    instead of 2.636 bpc) -- say so, with the command that evaluates it as trained. Under a
    translation task it cannot train at all."""
    if isinstance(task, StreamLanguageModelingTask) or not isinstance(task, FairseqTask):
        return  # (a script may build the model with any object that has a target_dictionary)

    name = next((f"--task {n}" for n, cls in TASK_REGISTRY.items() if cls is type(task)),
                type(task).__name__)
    if not isinstance(task, LanguageModelingTask):
        raise ZooConfigError(f"adaptive-span and All-Attention models are language models, not "
                             f"for {name}: pass --task attnzoo_stream_lm instead")
    prog = program()
    if prog in GENERATORS:
        return
    if not prog.startswith(("fairseq-", "attnzoo-")):  # fairseq_cli.<name> run in-process
        prog = "fairseq-" + prog.replace("_", "-")
    logger.warning(
        f"the adaptive-span cache is off under {name} (each block is scored without the previous "
        f"segments the model was trained with); as trained: {stream_command(sys.argv[1:], prog)}")


class AdaptiveSpanDecoder(FairseqIncrementalDecoder):
    """Embeddings -> :class:`AdaptiveSpanStack` -> output projection."""

    def __init__(self, args, dictionary):
        super().__init__(dictionary)
        d = args.decoder_embed_dim
        self.padding_idx = dictionary.pad()
        self.embed_tokens = nn.Embedding(len(dictionary), d, padding_idx=self.padding_idx)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=d ** -0.5)  # fairseq example's
        nn.init.zeros_(self.embed_tokens.weight[self.padding_idx])
        self.emb_dropout = args.emb_dropout
        self.stack = AdaptiveSpanStack(
            args.decoder_layers, d, args.decoder_attention_heads, args.decoder_ffn_embed_dim,
            args.attn_span, cache_buffer=args.adaptive_span_cache_buffer,
            ramp=args.adaptive_span_ramp, span_init=args.adaptive_span_init,
            span_loss=args.adaptive_span_loss, dropout=args.dropout,
            trim_chunk=args.adaptive_span_trim_chunk, dynamic=args.adaptive_span_dynamic,
            persistent_slots=args.persistent_memory_size,
            renorm=not args.adaptive_span_no_renorm,
            exclude_self=bool(getattr(args, "adaptive_span_exclude_self", False)),
            kernel=str(getattr(args, "adaptive_span_kernel", None) or "auto"))
        self.share_embed = args.share_decoder_input_output_embed
        if self.share_embed:
            self.output_projection = None
        else:
            self.output_projection = nn.Linear(d, len(dictionary))
        if (getattr(args, "adaptive_span_weight_init", None) or "fairseq_example") == "torch_default":
            self._torch_default_init()

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

    def upgrade_state_dict_named(self, state_dict, name):
        """Checkpoints written before the stack was a module kept ``key_pe`` and ``layers.*`` on
        the decoder: they now live under ``stack.``. (The parameter order changed with them, so
        such a checkpoint's optimizer state does not fit: resume with ``--reset-optimizer``.)"""
        prefix = f"{name}." if name else ""
        old = [key for key in state_dict if key.startswith(prefix) and (
            key[len(prefix):] == "key_pe" or key[len(prefix):].startswith("layers."))]
        for key in old:
            state_dict[f"{prefix}stack.{key[len(prefix):]}"] = state_dict.pop(key)
        if old:
            logger.warning("adaptive-span checkpoint from before the layer stack module: "
                           "parameters renamed to %sstack.*; to resume training from it, pass "
                           "--reset-optimizer (its optimizer state follows the old parameter "
                           "order)", prefix)
        return state_dict

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
        x = F.dropout(self.embed_tokens(tokens), self.emb_dropout, self.training)
        x, inner_states = self.stack(x, tokens.eq(self.padding_idx), stream_pos, stream_id)
        x = F.dropout(x, self.emb_dropout, self.training)
        return x, {"attn": [None], "inner_states": inner_states}

    def reset_streams(self):
        """Forget the stream caches (they are rebuilt from the next block on)."""
        self.stack.reset_streams()

    def _forward_incremental(self, tokens: Tensor, incremental_state):
        state = self.get_incremental_state(incremental_state, "span_state") or {}
        done = int(state["steps"][0]) if "steps" in state else 0
        tokens = tokens[:, done:]  # the generator passes the whole prefix; cached ones are skipped
        x, inner_states = self.stack.step(self.embed_tokens(tokens), tokens.eq(self.padding_idx),
                                          state)
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

    @staticmethod
    def add_args(parser):
        gen_parser_from_dataclass(parser, AdaptiveSpanLMConfig(), delete_default=True)

    @classmethod
    @compat.built_by_fairseq
    def build_model(cls, args, task):
        apply_base_arch(cls, args)  # (fairseq may build from options no arch function filled)
        _check(args)
        _check_projection(args)
        _check_task(task)
        return cls(AdaptiveSpanDecoder(args, task.target_dictionary))

    def perform_slowmo(self, optimizer, fp32_params=None):
        """Called by fairseq's trainer after every update (``Trainer.train_step``: "some
        distributed wrappers need access to the optimizer after the step"): project the spans,
        the model's bounded parameters, into [0, 1] -- projected gradient descent on exactly the
        model the trainer steps, with no hook on any other optimizer. Under ``FP16Optimizer`` the
        fp32 masters were projected before fairseq copied them into the model (compat entry
        ``fairseq_fp16_master_projection``), so this finds them in range."""
        project_bounded_(self)

    # span bookkeeping used by the criterion, the task and attnzoo-plot spans
    def span_penalty(self) -> Optional[Tensor]:
        return span_penalty(self)

    def clamp_spans(self) -> int:
        return clamp_spans(self)

    def layer_spans(self) -> List[Tensor]:
        return layer_spans(self)


@register_model("attnzoo_all_attention_lm")
class AllAttentionLanguageModel(AdaptiveSpanLanguageModel):
    """All-Attention LM: adaptive-span attention layers with N persistent key/value vectors per
    head and no FFN (Sukhbaatar et al. 2019, "Augmenting Self-attention with Persistent Memory")."""


def adaptive_span_base(args):
    """Base arch of ``attnzoo_adaptive_span_lm``: :class:`AdaptiveSpanLMConfig`'s defaults for
    every option still unset (the paper's 12-layer enwik8 model)."""
    fill_unset(args, {f.name: f.default for f in fields(AdaptiveSpanLMConfig)})


#: what All-Attention changes in the adaptive-span model: no FFN, N persistent vectors per head
ALL_ATTENTION = dict(decoder_ffn_embed_dim=0, decoder_layers=18, persistent_memory_size=1024,
                     adaptive_span_loss=1e-7)


def all_attention_base(args):
    """Base arch of ``attnzoo_all_attention_lm``: :data:`ALL_ATTENTION`, then the adaptive-span
    defaults (reference experiments/enwik8_pers_small.sh, 18 layers / 39M)."""
    fill_unset(args, ALL_ATTENTION)
    adaptive_span_base(args)


#: generic-test hooks: the span criterion; S=16 < 24 tokens and R=4 so that the sliding window
#: and trimming are exercised; eval-lm over 4 streams
SPAN_TESTS = {"flags": ["--criterion", "attnzoo_span_loss"],
              "eval_flags": ["--tokens-per-sample", "24", "--batch-size", "4"]}
SPAN_TINY = {"attn_span": 16, "adaptive_span_ramp": 4, "adaptive_span_trim_chunk": 4}

register_base_arch("attnzoo_adaptive_span_lm", adaptive_span_base, tiny=SPAN_TINY,
                   test=SPAN_TESTS)
register_base_arch("attnzoo_all_attention_lm", all_attention_base,
                   tiny=dict(SPAN_TINY, persistent_memory_size=8), test=SPAN_TESTS)
# paper, enwik8 12 layers / 38M (reference experiments/enwik8.sh): the dataclass defaults
register_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm")
# reference experiments/enwik8_small.sh: 8 layers, d 256, S 1024, no dropout, lambda 2e-6
register_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm_small", decoder_embed_dim=256,
              decoder_ffn_embed_dim=1024, decoder_layers=8, decoder_attention_heads=4,
              attn_span=1024, dropout=0.0, adaptive_span_loss=2e-6)
# paper, enwik8 24 layers / 209M (reference experiments/enwik8_large.sh)
register_arch("attnzoo_adaptive_span_lm", "adaptive_span_lm_large", decoder_embed_dim=768,
              decoder_ffn_embed_dim=4096, decoder_layers=24, decoder_attention_heads=8,
              dropout=0.4)
# All-Attention small, 18 layers / 39M (reference experiments/enwik8_pers_small.sh)
register_arch("attnzoo_all_attention_lm", "all_attention_lm")
# All-Attention large, 36 layers / 114M (reference experiments/enwik8_pers.sh)
register_arch("attnzoo_all_attention_lm", "all_attention_lm_large", decoder_layers=36,
              persistent_memory_size=2048, dropout=0.4)

"""``aop``: attention over parameters in the FFN slot (Vaswani et al.'s tensor2tensor
``parameter_attention``; see :mod:`fairseq_attnzoo.modules.aop`).

Archs: ``transformer_aop`` (AOP₁, tensor2tensor ``transformer_parameter_attention_a``: h_p = the
model's heads, h_p·d_pk = h_p·d_pv = d, n_p = d_ff − d = 1536 at base size),
``transformer_aop_h16`` (AOP₂, ``transformer_parameter_attention_b``: 16 heads in the whole model,
h_p = 16, h_p·d_pk = 2·d, n_p = 512 at base size) and the decoder-only ``transformer_lm_aop``.
Unless set explicitly, the memory follows the model's size so that its weights equal the FFN's
exactly (the count is logged). Every encoder and decoder layer's FFN is replaced.
"""

import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.aop import (KERNELS, SCALE_AT, AttentionOverParameters, aop_num_params,
                           ffn_matching_slots)
from ..modules.pkm_triton import KernelUnavailable
from .registry import register_arch
from .sublayers import FlagErrors, register_sublayer, require

logger = logging.getLogger(__name__)


@dataclass
class AOPConfig(FairseqDataclass):
    aop_heads: Optional[int] = field(default=None, metadata={
        "help": "AOP memory heads (h_p; default: the layer's attention heads, as tensor2tensor's "
                "hparams.num_heads)"})
    aop_width_factor: int = field(default=1, metadata={
        "help": "default memory width h_p·d_pk = h_p·d_pv as a multiple of d_model (tensor2tensor "
                "parameter_attention_key/value_channels / hidden_size: 1 for AOP₁, 2 for AOP₂; "
                "default 1)"})
    aop_key_dim: Optional[int] = field(default=None, metadata={
        "help": "AOP key dim per head (d_pk; default --aop-width-factor·d_model / h_p)"})
    aop_value_dim: Optional[int] = field(default=None, metadata={
        "help": "AOP value dim per head (d_pv; default --aop-width-factor·d_model / h_p)"})
    aop_slots: Optional[int] = field(default=None, metadata={
        "help": "AOP persistent key/value slots per head (n_p; default: the largest n_p whose "
                "weights do not exceed the FFN's, d·(2·d_ff − h_p·(d_pk+d_pv)) / (h_p·(d_pk+d_pv)): "
                "d_ff − d for AOP₁ (1536 at base size), 512 for AOP₂ at base size)"})
    aop_dropout: Optional[float] = field(default=None, metadata={
        "help": "AOP dropout: probability of dropping a whole memory row (a value slot of one "
                "head) per batch (default: --attention-dropout, as tensor2tensor passes "
                "hparams.attention_dropout)"})
    aop_scale_at: ChoiceEnum(list(SCALE_AT)) = field(default="use", metadata={
        "help": "where the paper's √h_p (keys) and √d_model (values) constants go: 'use' "
                "multiplies N(0, d^-1/2) parameters in the forward pass (tensor2tensor of the "
                "paper's time), 'init' folds them into the initialiser's std (tensor2tensor since "
                "2018-06-11); same function at init, different Adam steps (default use)"})

    aop_token_bucket: int = field(default=0, metadata={
        "help": "in training, pad the tokens the memory attention runs over (all of a batch's, "
                "as one sequence) with zero queries to a multiple of this, dropping them after: "
                "the same function and gradients, fewer distinct shapes for the attention kernel "
                "(on CUDA cuDNN's builds an execution graph for each new shape, and a translation "
                "batch's token count changes nearly every update; docs/aop.md, 'On the GPU'); "
                "costs up to N-1 extra rows (default 0: no padding)"})
    aop_kernel: ChoiceEnum(list(KERNELS)) = field(default="sdpa", metadata={
        "help": "how the attention over the memory runs: 'sdpa' = torch's "
                "scaled_dot_product_attention (the reference), 'triton' = the Triton kernel of "
                "modules/aop_triton.py (CUDA only; its backward sums the shared keys' and values' "
                "gradients over token chunks in fp32, no atomics); slower than sdpa on an H200 "
                "(benchmark case aop/sublayer-vs-ffn), so the default stays sdpa (default sdpa)"})

    def validate(self):
        for name in ("aop_heads", "aop_key_dim", "aop_value_dim", "aop_slots"):
            value = getattr(self, name)
            require(self, name, value is None or value > 0, "a positive integer")
        require(self, "aop_width_factor", self.aop_width_factor > 0, "a positive integer")
        require(self, "aop_token_bucket", self.aop_token_bucket >= 0,
                "0 (no padding) or a positive integer")
        require(self, "aop_dropout", self.aop_dropout is None or 0.0 <= self.aop_dropout < 1.0,
                "in [0, 1)")


def resolve_sizes(options: AOPConfig, embed_dim: int, ffn_dim: int, num_heads: int):
    """(h_p, d_pk, d_pv, n_p): the explicit flags, else sizes that follow the model and match the
    FFN's weights (see the flag help). One-line ValueError naming the flag to set."""
    heads = options.aop_heads or num_heads
    width = options.aop_width_factor * embed_dim
    dims = []
    for flag, value in (("--aop-key-dim", options.aop_key_dim),
                        ("--aop-value-dim", options.aop_value_dim)):
        if value is None:
            if width % heads:
                raise ValueError(f"--aop-width-factor·d_model = {width} is not divisible by "
                                 f"h_p = {heads}: set {flag} (or --aop-heads)")
            value = width // heads
        dims.append(value)
    key_dim, value_dim = dims
    slots = options.aop_slots
    if slots is None:
        slots = ffn_matching_slots(embed_dim, ffn_dim, heads, key_dim, value_dim)
        if slots <= 0:
            raise ValueError(f"AOP memory width h_p·(d_pk+d_pv) = {heads * (key_dim + value_dim)} "
                             f"leaves no slots within the FFN's {2 * embed_dim * ffn_dim} weights: "
                             "set --aop-slots (or smaller --aop-key-dim/--aop-value-dim)")
    return heads, key_dim, value_dim, slots


def _log_budget(spec, sizes):
    """Once per encoder/decoder (at its first layer): the AOP weights against the FFN's."""
    if spec.layer_idx != 0:
        return
    heads, key_dim, value_dim, slots = sizes
    d, d_ff = spec.embed_dim, spec.ffn_dim
    n_aop = aop_num_params(d, heads, key_dim, value_dim, slots)
    logger.info(f"{spec.side} AOP h_p={heads} d_pk={key_dim} d_pv={value_dim} n_p={slots}: "
                f"{n_aop:,} weights per sublayer vs the FFN's {2 * d * d_ff:,} weights + "
                f"{d + d_ff:,} biases (d={d}, d_ff={d_ff})")


class FairseqAttentionOverParameters(FlagErrors, AttentionOverParameters):
    """The sublayer: :class:`AttentionOverParameters` whose errors name the flags that set its
    arguments (``--aop-kernel`` where the module says ``kernel``)."""

    flag_errors = {KernelUnavailable: lambda e: (
        f"--aop-kernel triton cannot run: {e.why}; use --aop-kernel sdpa (a checkpoint: "
        "--model-overrides \"{'aop_kernel': 'sdpa'}\")")}


@register_sublayer("aop", slots=("ffn",), options=AOPConfig,
                   tiny={"aop_heads": 2, "aop_key_dim": 8, "aop_value_dim": 8, "aop_slots": 16})
def build_aop(spec):
    """attention over parameters: softmax(q Kᵀ) V with trainable K, V (replaces the FFN)"""
    o = spec.options
    sizes = resolve_sizes(o, spec.embed_dim, spec.ffn_dim, spec.num_heads)
    p = spec.attention_dropout if o.aop_dropout is None else o.aop_dropout
    _log_budget(spec, sizes)
    heads, key_dim, value_dim, slots = sizes
    return FairseqAttentionOverParameters(spec.embed_dim, heads=heads, key_dim=key_dim,
                                          value_dim=value_dim, slots=slots, dropout=p,
                                          scale_at=o.aop_scale_at,
                                          token_bucket=o.aop_token_bucket, kernel=o.aop_kernel)


# AOP₁ = the AOPConfig defaults; AOP₂ (tensor2tensor transformer_parameter_attention_b) sets
# num_heads = 16 for the whole model (self- and cross-attention too) and key/value channels 2·d
register_arch("attnzoo_transformer", "transformer_aop", encoder_ffn="aop", decoder_ffn="aop")
register_arch("attnzoo_transformer", "transformer_aop_h16", encoder_ffn="aop", decoder_ffn="aop",
              encoder_attention_heads=16, decoder_attention_heads=16, aop_width_factor=2)
register_arch("attnzoo_lm", "transformer_lm_aop", decoder_ffn="aop")

"""``collab``: collaborative multi-head attention (Cordonnier et al. 2020) in any attention slot.

Arch ``transformer_collab`` = ``attnzoo_transformer`` with collaborative encoder self-attention,
decoder self-attention and cross-attention; switch one back with e.g. ``--cross-attn mha``.
Arch ``transformer_collab_fork`` is the configuration of the authors' fairseq fork
(jbcdnr/fairseq-collaborative-heads, behind the paper's WMT'14 table): q/k biases, scaling
1/sqrt(d/H), xavier mixing, the fork's projection init.
A trained ``transformer``/``attnzoo_transformer`` checkpoint converts into this arch with
``attnzoo-collab-reparametrize``.
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.collab import MIXING_INITS, PROJ_INITS, SCALINGS, CollaborativeAttention
from .registry import register_arch
from .sublayers import register_sublayer, require
from .transformer import host_rope_theta


@dataclass
class CollabConfig(FairseqDataclass):
    collab_key_dim: int = field(default=0, metadata={
        "help": "shared key/query dimension D̃k of collaborative heads (W̃Q, W̃K: d -> D̃k, mixing "
                "M: H x D̃k); 0 = d_model/4, the paper's 4x reduction with no BLEU loss (default 0)"})
    collab_mixing_init: ChoiceEnum(list(MIXING_INITS)) = field(default="random", metadata={
        "help": "initialisation of the mixing matrix M: random N(0, 0.2^2), concatenate (block "
                "one-hot = concatenated heads of size D̃k/H), xavier, ones (default random; the "
                "authors' fairseq fork: xavier)"})
    collab_qk_bias: bool = field(default=False, metadata={
        "help": "keep biases b̃Q, b̃K on the shared W̃Q, W̃K (the authors' fairseq fork; their "
                "key-only term b̃Q diag(m_i) W̃Kᵀ y replaces the content bias w_i) instead of a free "
                "content bias w_i per head (EPFL package; default off; --no-collab-qk-bias turns "
                "off the fork preset's)"})
    collab_scaling: ChoiceEnum(list(SCALINGS)) = field(default="key_dim", metadata={
        "help": "logit scale: key_dim 1/sqrt(D̃k/H) (EPFL package) or head_dim 1/sqrt(d/H) "
                "(the authors' fairseq fork); equal at D̃k = d (default key_dim)"})
    collab_proj_init: ChoiceEnum(list(PROJ_INITS)) = field(default="mha", metadata={
        "help": "init of W̃Q, W̃K, W_V: mha = fairseq MHA's xavier gain 1/sqrt(2); fork = the "
                "fork's fairseq rule, gain 1/sqrt(2) only when D̃k = d, plain xavier otherwise "
                "(default mha)"})

    def validate(self):
        require(self, "collab_key_dim", self.collab_key_dim >= 0,
                "a non-negative integer (0 = d_model/4)")


def resolve_key_dim(key_dim: int, embed_dim: int) -> int:
    """D̃k from --collab-key-dim: 0 = d/4 (the paper's 4x reduction)."""
    return key_dim or max(1, embed_dim // 4)


@register_sublayer("collab", slots=("self_attn", "cross_attn"), options=CollabConfig,
                   tiny={"collab_key_dim": 16}, rope=True)
def build_collab(spec):
    """collaborative multi-head attention: shared W̃Q, W̃K (D̃k) with per-head mixing"""
    o = spec.options
    key_dim = resolve_key_dim(o.collab_key_dim, spec.embed_dim)
    return CollaborativeAttention(
        spec.embed_dim, spec.num_heads, key_dim,
        dropout=spec.attention_dropout, kdim=spec.kdim, vdim=spec.kdim,
        mixing_init=o.collab_mixing_init, qk_bias=o.collab_qk_bias, scaling=o.collab_scaling,
        proj_init=o.collab_proj_init,
        rope_theta=host_rope_theta(spec, key_dim, "choose an even --collab-key-dim"))


COLLAB_SLOTS = dict(encoder_self_attn="collab", decoder_self_attn="collab", cross_attn="collab")
register_arch("attnzoo_transformer", "transformer_collab", **COLLAB_SLOTS)
# the authors' fairseq fork (jbcdnr/fairseq-collaborative-heads): the setup of the paper's table
register_arch("attnzoo_transformer", "transformer_collab_fork", **COLLAB_SLOTS,
              collab_qk_bias=True, collab_scaling="head_dim", collab_mixing_init="xavier",
              collab_proj_init="fork")

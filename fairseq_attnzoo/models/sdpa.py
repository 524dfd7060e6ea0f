"""``sdpa``: plain multi-head attention on the shared base (fused scaled_dot_product_attention).

Same parameter names as fairseq's MultiheadAttention, so a stock checkpoint's weights load into it;
useful as the fast vanilla path and as the reference the generic tests check the base against."""

from ..modules.sdpa import ZooMultiheadAttention
from .registry import register_arch
from .sublayers import register_sublayer
from .transformer import host_proj_bias, host_rope_theta


@register_sublayer("sdpa", slots=("self_attn", "cross_attn"), rope=True)
def build_sdpa(spec):
    """multi-head dot-product attention through F.scaled_dot_product_attention"""
    return ZooMultiheadAttention(spec.embed_dim, spec.num_heads, spec.attention_dropout,
                                 kdim=spec.kdim, vdim=spec.kdim, bias=host_proj_bias(spec),
                                 rope_theta=host_rope_theta(spec))


# vanilla attention everywhere through the shared base: checks the base's masks and caches in the
# generic sweep and gives a fused-kernel baseline that loads stock checkpoints unchanged
register_arch("attnzoo_transformer", "attnzoo_transformer_sdpa", encoder_self_attn="sdpa",
              decoder_self_attn="sdpa", cross_attn="sdpa")
register_arch("attnzoo_lm", "attnzoo_lm_sdpa", decoder_self_attn="sdpa")

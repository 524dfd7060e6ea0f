"""``attnzoo_lm_llama``: the zoo LM in the Llama host (pre-norm RMSNorm, SwiGLU, rotary positions,
no biases, no dropout), the host facebookresearch/memory puts its memory layers in
(``lingua/transformer.py``; sizes of ``apps/main/configs/dense_373m.yaml``, the dense baseline of
``pkplus_373m_1024k.yaml``: dim 1024, 24 layers, 16 heads, rope_theta 500000, FFN 4·dim before
SwiGLU's 2/3 rounding). Every method that takes the host options can be put in it by its flags;
``transformer_lm_memplus_llama`` (:mod:`.pkm`) is Memory+ there."""

from .registry import Derived, register_arch

#: the Llama host over attnzoo_lm's defaults (every other option: the user's, else fairseq's)
LLAMA = dict(norm="rmsnorm", rope=True, proj_bias=False,
             # 500000 with its RoPE (--no-rope: the flag's default, so nothing is refused)
             rope_theta=Derived(lambda args: 500000.0 if args.rope else 10000.0,
                                "500000 with --rope"),
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
             decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_layers=24,
             decoder_attention_heads=16)


def llama_post(args):
    """Pre-norm and rotary positions only: fairseq's store_true flags cannot be preset (False is
    the parser's default), so the arch sets them."""
    args.decoder_normalize_before = True
    args.no_token_positional_embeddings = True


register_arch("attnzoo_lm", "attnzoo_lm_llama", post=llama_post, decoder_ffn="swiglu", **LLAMA)
# a small preset (tests, CPU smoke runs): 6 layers of 256, 4 heads
register_arch("attnzoo_lm", "attnzoo_lm_llama_small", post=llama_post, decoder_ffn="swiglu",
              **{**LLAMA, "decoder_embed_dim": 256, "decoder_ffn_embed_dim": 1024,
                 "decoder_layers": 6, "decoder_attention_heads": 4})

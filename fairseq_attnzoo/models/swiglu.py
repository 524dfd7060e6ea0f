"""``swiglu``: the SiLU-gated feed-forward of the Llama host (:mod:`..modules.swiglu`), selectable
in any FFN slot (``--decoder-ffn swiglu``, ``--encoder-ffn swiglu``)."""

from dataclasses import dataclass, field

from fairseq.dataclass import FairseqDataclass

from ..modules.swiglu import SwiGLU
from .sublayers import register_sublayer, require
from .transformer import host_proj_bias


@dataclass
class SwiGLUConfig(FairseqDataclass):
    swiglu_multiple_of: int = field(
        default=256,
        metadata={"help": "SwiGLU hidden size = int(2/3 * --*-ffn-embed-dim) rounded up to a "
                  "multiple of this (multiple_of, default 256 as the memory code's lingua "
                  "BaseTransformerArgs)"})

    def validate(self):
        require(self, "swiglu_multiple_of", self.swiglu_multiple_of > 0, "a positive integer")


@register_sublayer("swiglu", slots=("ffn",), options=SwiGLUConfig, tiny={"swiglu_multiple_of": 8})
def build_swiglu(spec):
    """SwiGLU FFN: w2(SiLU(w1 x) * w3 x), hidden 2/3 of the FFN size (biases per --proj-bias)"""
    return SwiGLU(spec.embed_dim, spec.ffn_dim, spec.options.swiglu_multiple_of,
                  bias=host_proj_bias(spec), dropout=spec.activation_dropout)

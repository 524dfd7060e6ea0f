"""fairseq's transformer (encoder-decoder and decoder-only LM) with replaceable sublayers.

Embeddings, positions, LayerDrop, output projection, incremental decoding plumbing, checkpoint
upgrades: all stay fairseq's. We subclass only the layer builders, and the two layer classes, whose
forward pass calls the slot modules chosen in :mod:`fairseq_attnzoo.models.sublayers`. Parameter
names equal the stock transformer's (``self_attn``, ``fc1``, ``fc2``, ``encoder_attn``...), so a
stock ``transformer`` checkpoint loads into ``attnzoo_transformer`` unchanged; a replaced FFN lives
under ``ffn``.

Host options (:data:`HOST_FLAGS`, each off by default, so every existing arch and checkpoint is
unchanged): ``--norm rmsnorm``, ``--rope`` / ``--rope-theta``, ``--no-proj-bias``; with a SwiGLU
FFN they make the Llama host (``attnzoo_lm_llama``). What a method supports of them (rotary
positions), and of the layers' other needs (incremental decoding), it declares at its registration
(:class:`~.sublayers.SublayerEntry`): no method is named here.
"""

import argparse
import contextlib
import logging
import os
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from omegaconf import OmegaConf
from torch import Tensor

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
)
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.modules import MultiheadAttention
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.quant_noise import quant_noise
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from .. import compat
from ..checkpoints import cfg_get, load_stored, model_flag_differences, stored_section
from ..messages.errors import ZooConfigError
from ..modules.attention import mask_scope
from ..modules.rmsnorm import RMSNORM_EPS, RMSNorm
from ..modules.sdpa import ZooMultiheadAttention
from .registry import register_base_arch
from .sublayers import (
    SLOT_FLAGS,
    STOCK,
    SUBLAYER_REGISTRY,
    SublayerSpec,
    add_sublayer_args,
    and_list,
    build_sublayer,
    fill_sublayer_defaults,
    is_stock,
    layer_names,
    options_for,
    sharing_scope,
    validate_sublayer_args,
)

logger = logging.getLogger(__name__)

# stock-transformer options whose code paths our layer forward does not implement
# (the LM's --scale-* flags come from transformer_lm's config)
_UNSUPPORTED = {
    "cross_self_attention": "--cross-self-attention",
    "scale_attn": "--scale-attn",
    "scale_fc": "--scale-fc",
    "scale_heads": "--scale-heads",
    "scale_resids": "--scale-resids",
}


def _check_supported(cfg):
    for attr, flag in _UNSUPPORTED.items():
        if getattr(cfg, attr, False):
            raise ValueError(f"{flag} is not supported by attnzoo models; drop the flag "
                             "(or use fairseq's stock transformer)")
    qn = getattr(cfg, "quant_noise", None)
    if qn is not None and getattr(qn, "pq", 0) > 0 and _any_replaced(cfg):
        raise ValueError("--quant-noise-pq applies to stock sublayers only; set it to 0 when a "
                         "sublayer is replaced")


# ---- host options: the norm, rotary positions, bias-free projections ---------------------------

#: flag attribute -> (default, help, or a function making it from the registry); defaults are
#: filled by the base arch functions, so a checkpoint written before these flags existed builds
#: the model it was trained as
HOST_FLAGS = {
    "norm": ("layernorm", "the layers' norm: layernorm (fairseq's LayerNorm, default) or rmsnorm "
             f"(torch nn.RMSNorm, g * x / sqrt(mean(x^2) + eps), eps {RMSNORM_EPS:g} as the "
             "memory code's lingua/transformer.py, statistics in float32)"),
    "rope": (False, lambda: "rotary position embeddings (RoPE, Su et al. 2021) on the queries "
             "and keys of every self-attention that forms q.k scores (the methods that declare "
             f"it: {', '.join(rotating())}); encoder-decoder attention is not rotated; another "
             "self-attention refuses it; FFN slots are unaffected (default off; attnzoo_lm_llama: "
             "on). Learned/sinusoidal positions stay unless --no-token-positional-embeddings"),
    "rope_theta": (10000.0, "RoPE base theta: pair i turns by m * theta^(-2i/d_head) (default "
                   "10000 as lingua's BaseTransformerArgs; attnzoo_lm_llama: 500000 as the "
                   "memory code's dense_373m.yaml / pkplus_373m_1024k.yaml)"),
    "proj_bias": (True, "biases in the host's projections: attention q/k/v/out and the FFN "
                  "(fc1/fc2, or a replaced FFN's projections where its builder reads "
                  "host_proj_bias, as SwiGLU's w1/w2/w3); --no-proj-bias drops them (default on; "
                  "attnzoo_lm_llama: off). A method's own layers keep theirs"),
}

def rotating(slot: str = "self_attn") -> List[str]:
    """The sublayers of ``slot`` that declare they rotate queries and keys under --rope (some
    only with some of their options), in registration order: --rope's help and refusals."""
    return [n for n, e in SUBLAYER_REGISTRY.items() if slot in e.slots and e.rope is not False]


def add_host_args(parser):
    """The host flags (no argparse defaults: presets and the base arch fill them)."""
    for attr, (default, help) in HOST_FLAGS.items():
        help = help() if callable(help) else help
        flag = "--" + attr.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        elif attr == "norm":
            parser.add_argument(flag, choices=["layernorm", "rmsnorm"], help=help)
        else:
            parser.add_argument(flag, type=type(default), help=help)


def fill_host_defaults(args):
    for attr, (default, _) in HOST_FLAGS.items():
        if getattr(args, attr, None) is None:
            setattr(args, attr, default)


def _host(cfg, attr):
    """Host option ``attr`` of ``cfg`` (a Namespace, a DictConfig or a checkpoint's dict), its
    default where ``cfg`` predates it."""
    value = cfg_get(cfg, attr)
    return HOST_FLAGS[attr][0] if value is None else value


def stock_host(cfg) -> bool:
    """No host option changes fairseq's own modules (the stock MHA can be built)."""
    return not _host(cfg, "rope") and _host(cfg, "proj_bias")


def _check_host(args, names: Dict[str, List[str]]):
    """One line for a host option a chosen sublayer cannot honour (never ignored silently)."""
    if str(_host(args, "norm")) not in ("layernorm", "rmsnorm"):
        raise ZooConfigError(f"--norm must be layernorm or rmsnorm, got {args.norm!r}")
    if not _host(args, "rope"):
        if float(_host(args, "rope_theta")) != HOST_FLAGS["rope_theta"][0]:
            raise ZooConfigError(f"--rope-theta {args.rope_theta} has no effect without --rope: "
                                 "add --rope or drop --rope-theta")
        return
    if float(_host(args, "rope_theta")) <= 0:
        raise ZooConfigError(f"--rope-theta must be positive, got {args.rope_theta!r}")
    for attr in ("encoder_self_attn", "decoder_self_attn"):
        for name in dict.fromkeys(names.get(attr, [])):
            fix = SUBLAYER_REGISTRY[name].rope_fix(options_for(name, args))
            if fix is None:
                continue
            others = [n for n in rotating() if n != name]  # (the stock attention at least)
            choices = and_list(others, "or")
            raise ZooConfigError(
                f"--rope is not implemented for the {name} self-attention"
                f"{' with these options' if fix else ''} (no q.k product to rotate): "
                f"{fix + ', ' if fix else ''}drop --rope or use --{attr.replace('_', '-')} "
                f"{choices}")


def host_rope_theta(spec, rotated: Optional[int] = None, fix: str = "") -> Optional[float]:
    """For an attention builder: the RoPE base when --rope is on and ``spec`` is a
    self-attention (encoder-decoder attention is never rotated), else None. ``rotated``: the
    width RoPE turns in pairs (default: the head size); odd, one line naming ``fix`` (default:
    the side's head and width flags)."""
    if spec.slot != "self_attn" or not _host(spec.args, "rope"):
        return None
    width = rotated or spec.embed_dim // spec.num_heads
    if width % 2:
        side = spec.side
        raise ZooConfigError(
            f"--rope turns feature pairs, but the {side} self-attention's rotated width is "
            f"{width} (odd): " + (fix or f"choose --{side}-embed-dim / --{side}-attention-heads "
                                  f"= {spec.embed_dim} / {spec.num_heads} with an even quotient"))
    return float(_host(spec.args, "rope_theta"))


def host_proj_bias(spec) -> bool:
    """For a builder: whether its projections have biases (--proj-bias, fairseq's: yes)."""
    return bool(_host(spec.args, "proj_bias"))


def host_attention(spec):
    """The stock slot's attention when a host option changes it: the shared-base multi-head
    attention (same parameter names as fairseq's MultiheadAttention, which has no rotary hook)."""
    return ZooMultiheadAttention(spec.embed_dim, spec.num_heads, spec.attention_dropout,
                                 kdim=spec.kdim, vdim=spec.kdim, bias=host_proj_bias(spec),
                                 rope_theta=host_rope_theta(spec))


def _host_norms(module, cfg, names):
    """Replace the LayerNorms ``names`` of ``module`` by RMSNorm under ``--norm rmsnorm``."""
    if _host(cfg, "norm") != "rmsnorm":
        return
    for name in names:
        old = getattr(module, name, None)
        if old is not None:
            setattr(module, name, RMSNorm(old.normalized_shape[0]))


def _as_namespace(args):
    """fairseq-hydra-train hands ``build_model`` the model config as an omegaconf DictConfig.
    fairseq's ``TransformerConfig.from_namespace`` copies the keys it does not know through
    ``vars(args)``, which sees none of a DictConfig's keys: every sublayer flag and method option
    would be dropped silently (a stock transformer). A plain Namespace keeps them."""
    if OmegaConf.is_config(args):
        return argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
    return args


def _any_replaced(cfg) -> bool:
    return any(set(str(getattr(cfg, a, None) or STOCK[s]).split(",")) - {STOCK[s]}
               for a, (s, _, _) in SLOT_FLAGS.items())


def _spec(cfg, slot: str, side: str, idx: int, causal: bool) -> SublayerSpec:
    part = cfg.encoder if side == "encoder" else cfg.decoder
    return SublayerSpec(
        slot=slot, side=side, layer_idx=idx, num_layers=part.layers, embed_dim=part.embed_dim,
        num_heads=part.attention_heads, ffn_dim=part.ffn_embed_dim,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=float(cfg.activation_dropout or getattr(cfg, "relu_dropout", 0) or 0),
        causal=causal,
        kdim=cfg.encoder.embed_dim if slot == "cross_attn" else part.embed_dim, args=cfg)


def _linear_no_bias(input_dim, output_dim, q_noise, qn_block_size):
    """fairseq's fc1/fc2 (``build_fc1``) without the bias (--no-proj-bias)."""
    return quant_noise(nn.Linear(input_dim, output_dim, bias=False), p=q_noise,
                       block_size=qn_block_size)


class _ZooLayerMixin:
    """FFN slot shared by encoder and decoder layers."""

    zoo_side = "encoder"

    def _fc(self, stock, *dims):
        """fc1 / fc2 (``stock``: fairseq's builder of it): None when the FFN slot is replaced
        (built as self.ffn below), bias-free under --no-proj-bias."""
        if not is_stock(self.zoo_names[f"{self.zoo_side}_ffn"]):
            return None
        return stock(*dims) if _host(self.zoo_cfg, "proj_bias") else _linear_no_bias(*dims)

    def build_fc1(self, input_dim, output_dim, q_noise, qn_block_size):
        return self._fc(super().build_fc1, input_dim, output_dim, q_noise, qn_block_size)

    def build_fc2(self, input_dim, output_dim, q_noise, qn_block_size):
        return self._fc(super().build_fc2, input_dim, output_dim, q_noise, qn_block_size)

    def _attention(self, attr: str, spec, stock):
        """The attention of slot ``attr``: its sublayer, or for the stock one fairseq's own
        (``stock()``) unless a host option changes it (then the shared-base one,
        :func:`host_attention`)."""
        name = self.zoo_names[attr]
        if not is_stock(name):
            return build_sublayer(name, spec)
        return stock() if stock_host(spec.args) else host_attention(spec)

    def _build_ffn(self, cfg):
        name = self.zoo_names[f"{self.zoo_side}_ffn"]
        self.ffn = None if is_stock(name) else build_sublayer(
            name, _spec(cfg, "ffn", self.zoo_side, self.zoo_layer_idx, False))

    def feed_forward(self, x: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
        if self.ffn is not None:
            return self.ffn(x, padding_mask)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        return self.fc2(x)

    def _ffn_block(self, x: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.feed_forward(x, padding_mask)
        # fairseq's residual dropout (--dropout), unless a replacement's ``residual_dropout`` is
        # False (product-key memory by default: XLM and the memory code add it undropped)
        if self.ffn is None or getattr(self.ffn, "residual_dropout", True):
            x = self.dropout_module(x)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class ZooEncoderLayer(_ZooLayerMixin, TransformerEncoderLayerBase):
    zoo_side = "encoder"

    def __init__(self, cfg, layer_idx: int):
        # plain attributes may be set before nn.Module.__init__ (fairseq does the same with cfg)
        self.zoo_layer_idx = layer_idx
        self.zoo_cfg = cfg
        self.zoo_names = {a: layer_names(cfg, a)[layer_idx] for a in ("encoder_self_attn", "encoder_ffn")}
        super().__init__(cfg)
        self._build_ffn(cfg)
        _host_norms(self, cfg, ("self_attn_layer_norm", "final_layer_norm"))

    def build_self_attention(self, embed_dim, cfg):
        return self._attention("encoder_self_attn",
                               _spec(cfg, "self_attn", "encoder", self.zoo_layer_idx, False),
                               lambda: super(ZooEncoderLayer, self).build_self_attention(
                                   embed_dim, cfg))

    def forward(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        if attn_mask is not None:  # as stock: 1 = blocked -> large negative (finite)
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool),
                                              -1e8 if x.dtype == torch.float32 else -1e4)
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
                              need_weights=False, attn_mask=attn_mask)
        x = residual + self.dropout_module(x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = self._ffn_block(x, encoder_padding_mask)
        if self.return_fc:
            return x, None
        return x


def _future_mask_like(attn_mask: Optional[Tensor], padding_mask: Optional[Tensor], attention,
                      query: Tensor, incremental_state) -> Optional[Tensor]:
    """fairseq's future mask (0 / -inf) as a boolean mask (True = blocked) where fairseq's own
    MultiheadAttention hands it to torch's ``F.multi_head_attention_forward`` beside its boolean
    padding mask: masks of two types are deprecated there (a warning in every training run).
    torch makes the same -inf entries from either; on fairseq's other path (incremental
    decoding, ONNX, TPU, pruned heads), which adds the mask to the scores, it stays as it is."""
    if (attn_mask is None or padding_mask is None or not attn_mask.is_floating_point()
            or not isinstance(attention, MultiheadAttention) or incremental_state is not None
            or attention.onnx_trace or attention.skip_embed_dim_check
            or query.device.type == "xla" or torch.jit.is_scripting()):
        return attn_mask
    return torch.isneginf(attn_mask)


class ZooDecoderLayer(_ZooLayerMixin, TransformerDecoderLayerBase):
    zoo_side = "decoder"

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False, decoder_only=False):
        self.zoo_layer_idx = layer_idx
        self.zoo_cfg = cfg
        attrs = ["decoder_self_attn", "decoder_ffn"] + ([] if decoder_only else ["cross_attn"])
        self.zoo_names = {a: layer_names(cfg, a)[layer_idx] for a in attrs}
        self.zoo_names.setdefault("cross_attn", STOCK["cross_attn"])
        #: why a decoding step is refused: an attention that declares no incremental state
        self.zoo_no_steps = next(
            (f"--{a.replace('_', '-')} {n} cannot decode token by token (its registration "
             "declares incremental=False), as fairseq-generate and attnzoo-sample do: score full "
             "passes (fairseq-eval-lm, fairseq-validate) or choose another "
             f"--{a.replace('_', '-')}" for a, n in self.zoo_names.items()
             if a != "decoder_ffn" and not SUBLAYER_REGISTRY[n].incremental), None)
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self._build_ffn(cfg)
        _host_norms(self, cfg, ("self_attn_layer_norm", "encoder_attn_layer_norm",
                                "final_layer_norm"))

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        # (fairseq's add_bias_kv / add_zero_attn: this layer is built without them)
        return self._attention("decoder_self_attn",
                               _spec(cfg, "self_attn", "decoder", self.zoo_layer_idx, True),
                               lambda: super(ZooDecoderLayer, self).build_self_attention(
                                   embed_dim, cfg, add_bias_kv, add_zero_attn))

    def build_encoder_attention(self, embed_dim, cfg):
        return self._attention("cross_attn",
                               _spec(cfg, "cross_attn", "decoder", self.zoo_layer_idx, False),
                               lambda: super(ZooDecoderLayer, self).build_encoder_attention(
                                   embed_dim, cfg))

    def forward(self, x, encoder_out: Optional[Tensor] = None,
                encoder_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                prev_self_attn_state: Optional[List[Tensor]] = None,
                prev_attn_state: Optional[List[Tensor]] = None,
                self_attn_mask: Optional[Tensor] = None,
                self_attn_padding_mask: Optional[Tensor] = None,
                need_attn: bool = False, need_head_weights: bool = False):
        if prev_self_attn_state is not None or prev_attn_state is not None:
            raise NotImplementedError("prev_*_attn_state (ONNX export path) is not supported")
        if incremental_state is not None and self.zoo_no_steps:
            raise ZooConfigError(self.zoo_no_steps)
        if need_head_weights:
            need_attn = True
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask,
                              incremental_state=incremental_state, need_weights=False,
                              attn_mask=_future_mask_like(self_attn_mask, self_attn_padding_mask,
                                                          self.self_attn, x, incremental_state))
        x = residual + self.dropout_module(x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        attn = None
        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            if self.normalize_before:
                x = self.encoder_attn_layer_norm(x)
            x, attn = self.encoder_attn(
                query=x, key=encoder_out, value=encoder_out, key_padding_mask=encoder_padding_mask,
                incremental_state=incremental_state, static_kv=True,
                need_weights=need_attn or (not self.training and self.need_attn),
                need_head_weights=need_head_weights)
            x = residual + self.dropout_module(x)
            if not self.normalize_before:
                x = self.encoder_attn_layer_norm(x)

        x = self._ffn_block(x, self_attn_padding_mask)
        return x, attn, None


def _wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping, exactly as fairseq's layer builders do."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


@contextlib.contextmanager
def _building(args, decoder_only: bool = False):
    """What building any zoo model does around fairseq's build (the table applied first: its
    ``build_model`` is :func:`~fairseq_attnzoo.compat.built_by_fairseq`): the flags checked, one
    sharing scope for the model (shared state, and each method's options built once); yields the
    args as a Namespace."""
    args = _as_namespace(args)
    _check_supported(args)
    with sharing_scope():
        _check_host(args, validate_sublayer_args(args, decoder_only=decoder_only))
        yield args


class ZooTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        _host_norms(self, cfg, ("layernorm_embedding", "layer_norm"))

    def forward(self, *args, **kwargs):
        with mask_scope():  # what comes from the masks: derived once for all layers of the pass
            return super().forward(*args, **kwargs)

    def build_encoder_layer(self, cfg):
        idx = getattr(self, "_zoo_next_layer", 0)
        self._zoo_next_layer = idx + 1
        return _wrap_layer(ZooEncoderLayer(cfg, idx), cfg)


class ZooTransformerDecoder(TransformerDecoderBase):
    decoder_only = False

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        _host_norms(self, cfg, ("layernorm_embedding", "layer_norm"))

    def forward(self, *args, **kwargs):
        with mask_scope():  # (each decoding step a pass of its own)
            return super().forward(*args, **kwargs)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        idx = getattr(self, "_zoo_next_layer", 0)
        self._zoo_next_layer = idx + 1
        return _wrap_layer(ZooDecoderLayer(cfg, idx, no_encoder_attn, self.decoder_only), cfg)


class ZooLMDecoder(ZooTransformerDecoder):
    decoder_only = True


class _UnsyncedParamsMixin:
    """Parameters tagged ``expert`` (fairseq's tag for "not all-reduced by the DDP wrapper"; PKM's
    sparse value tables, whose rows ``pkm_adam`` exchanges itself) are skipped by fairseq's legacy
    DDP; PyTorch DDP reads the names to skip from this attribute when it wraps the model."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> List[str]:
        extra = list(self.__dict__.get("_zoo_ddp_ignore_extra", []))
        return extra + [n for n, p in self.named_parameters() if hasattr(p, "expert")]

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names):  # DDP's own setter helper
        self.__dict__["_zoo_ddp_ignore_extra"] = list(names)


@register_model("attnzoo_transformer")
class ZooTransformerModel(_UnsyncedParamsMixin, TransformerModel):
    """fairseq's encoder-decoder transformer with per-layer replaceable sublayers.

    Arch ``attnzoo_transformer`` with no sublayer flags is the stock ``transformer`` (same
    parameters, same outputs for the same weights)."""

    zoo_task = "translation"

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_sublayer_args(parser)
        add_host_args(parser)

    @classmethod
    @compat.built_by_fairseq
    def build_model(cls, args, task):
        with _building(args) as args:
            return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return ZooTransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return ZooTransformerDecoder(
            cfg, tgt_dict, embed_tokens, no_encoder_attn=getattr(cfg, "no_cross_attention", False))


@register_model("attnzoo_lm")
class ZooLanguageModel(_UnsyncedParamsMixin, TransformerLanguageModel):
    """fairseq's decoder-only transformer LM with replaceable self-attention and FFN."""

    zoo_task = "language_modeling"

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_sublayer_args(parser, decoder_only=True)
        add_host_args(parser)

    @classmethod
    @compat.built_by_fairseq
    def build_model(cls, args, task):
        with _building(args, decoder_only=True) as args:
            model = super().build_model(args, task)  # fairseq's embeddings (adaptive input etc.)
            model.decoder = ZooLMDecoder(TransformerConfig.from_namespace(args),
                                         task.target_dictionary, model.decoder.embed_tokens,
                                         no_encoder_attn=True)
        return model


def zoo_mt_base(args):
    base_architecture(args)
    fill_sublayer_defaults(args)
    fill_host_defaults(args)


def zoo_lm_base(args):
    base_lm_architecture(args)
    fill_sublayer_defaults(args, decoder_only=True)
    fill_host_defaults(args)


# the base arch functions of the two models (every other arch: register_arch, a preset over these)
register_base_arch("attnzoo_transformer", zoo_mt_base)
register_base_arch("attnzoo_lm", zoo_lm_base)


# ---- resuming with other host options (compat entry fairseq_resume_host_flags) -----------------

def resume_mismatch(path: str, current) -> Optional[str]:
    """The one line refusing to resume the checkpoint ``path`` with host options (--norm, --rope,
    --rope-theta, --proj-bias: :data:`HOST_FLAGS`) other than it was trained with, naming every
    model flag that differs; None when they agree, or for another arch (its own line) or a model
    without host options. --rope and --rope-theta change no parameter shape, so fairseq loads such
    a checkpoint without a word."""
    if cfg_get(current, "rope") is None:  # a model without the host options
        return None
    stored = stored_section(load_stored(path), "model")
    if stored is None or cfg_get(stored, "arch") != cfg_get(current, "arch"):
        return None
    if all(_host(stored, attr) == _host(current, attr) for attr in HOST_FLAGS):
        return None
    differ = model_flag_differences(stored, current, defaults=HOST_FLAGS)
    return (f"{path} was trained with other model flags than this run's: {', '.join(differ)}: "
            "resume with the checkpoint's values, or start a new run in another --save-dir "
            "(--finetune-from-model starts one from its weights)")


def checking_resume(load_checkpoint):
    """``Trainer.load_checkpoint`` that refuses a checkpoint trained with other host options
    (:func:`resume_mismatch`); a --finetune-from-model start is not a resume."""

    def load_checkpoint_checking_flags(self, filename, *args, **kwargs):
        finetune = getattr(self.cfg.checkpoint, "finetune_from_model", None)
        if os.path.isfile(filename) and filename != finetune:
            line = resume_mismatch(filename, self.cfg.model)
            if line:
                raise ZooConfigError(line)
        return load_checkpoint(self, filename, *args, **kwargs)

    return load_checkpoint_checking_flags


compat.fix("fairseq_resume_host_flags", "fairseq.trainer:Trainer.load_checkpoint",
           "a --rope checkpoint resumed without --rope (or another --rope-theta) loads without a "
           "word: the parameter shapes are the same, the model is not. Refuse, in one line naming "
           "every model flag that differs, a resume whose host options differ from the "
           "checkpoint's", checking_resume, "128800d64185aede", version="fairseq 0.12.3")

"""Synthesizer (Tay et al. 2020) self-attention sublayers and architectures.

Sublayers (self-attention slot only; cross-attention stays ``mha``), usable per layer with
``--encoder-self-attn`` / ``--decoder-self-attn``:

=============================  =============================  ==================================
sublayer                       logits                         archs (MT / LM)
=============================  =============================  ==================================
``synth_dense``                Dense                          transformer(_lm)_synth_dense
``synth_random``               Random (trainable R)           transformer(_lm)_synth_random
``synth_fixed_random``         Random, frozen                 transformer(_lm)_synth_fixed_random
``synth_factorized_dense``     Factorized Dense               ..._synth_factorized_dense
``synth_factorized_random``    Factorized Random R1 R2^T      ..._synth_factorized_random
``synth_random_dense``         alpha R + alpha' D             ..._synth_random_dense
``synth_dense_vanilla``        alpha D + alpha' QK^T          ..._synth_dense_vanilla
``synth_random_vanilla``       alpha R + alpha' QK^T          ..._synth_random_vanilla
``synth``                      components of ``--synth-mix``  (none; any mixture by flag)
=============================  =============================  ==================================

Every synthesizer table has N = ``--synth-max-len`` rows/columns, so the archs cap the model's
max positions at N (fairseq's size filters then skip longer examples instead of crashing).
"""

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from fairseq.tasks import TASK_DATACLASS_REGISTRY

from ..modules.synthesizer import (
    COMPONENTS,
    TABLE_KERNELS,
    SequenceTooLong,
    SynthesizerAttention,
    factorized_dense_sizes,
)
from .registry import register_arch
from .sublayers import (FlagErrors, SublayerSpec, build_options, note_length_limit,
                        register_sublayer, require)
from .transformer import host_rope_theta

logger = logging.getLogger(__name__)

# fairseq's defaults when --max-source/target-positions and --tokens-per-sample are not given
FAIRSEQ_DEFAULT_POSITIONS = 1024


@dataclass
class SynthesizerConfig(FairseqDataclass):
    synth_max_len: int = field(default=256, metadata={
        "help": "Synthesizer max sequence length N: rows/columns of the synthesized tables (Random "
        "R [h,N,N], Dense W2 d->N); caps --max-source/target-positions (paper: N; default 256)"})
    synth_mix: str = field(default="random", metadata={
        "help": "components of the generic 'synth' sublayer, comma-separated from "
        "dense,random,factorized_dense,factorized_random,vanilla; several are mixed as "
        "Softmax(sum_i alpha_i S_i(X)), alpha learned and summing to 1 (paper: mixture of "
        "synthesizers; default random). The synth_* sublayers and archs fix their own components"})
    synth_factor_a: Optional[int] = field(default=None, metadata={
        "help": "Factorized Dense: size a of F_A(X) (n x a), tiled b times; a*b >= N (paper: a; "
        "default: balanced a*b = N, 16 for N=256)"})
    synth_factor_b: Optional[int] = field(default=None, metadata={
        "help": "Factorized Dense: size b of F_B(X) (n x b), each entry repeated a times "
        "(paper: b; default: balanced a*b = N, 16 for N=256)"})
    synth_rank: int = field(default=32, metadata={
        "help": "Factorized Random: rank k of R = R1 R2^T, R1,R2 [N,k] (paper: k; default 32 as "
        "in the LRA reference code)"})
    synth_share_heads: bool = field(default=False, metadata={
        "help": "Random / Factorized Random: one table R for all heads instead of one per head "
        "(paper: R per head; default False)"})
    synth_table_kernel: ChoiceEnum(list(TABLE_KERNELS)) = field(  # type: ignore
        default="auto", metadata={
            "help": "Random / Factorized Random logits: sdpa = as dot products through the fused "
            "attention kernel (Random while the keys are at most 128 long), table = "
            "materialized with an fp32 softmax (one for the batch without padding); auto = sdpa "
            "on CUDA, table elsewhere (same function; default auto)"})
    synth_freeze_random: bool = field(default=False, metadata={
        "help": "Fixed Random: keep R (and R1, R2) at their random init, never trained (stored "
        "as buffers; implied by synth_fixed_random; default False)"})

    def validate(self):
        require(self, "synth_max_len", self.synth_max_len >= 1, "a positive integer")
        require(self, "synth_rank", self.synth_rank >= 1, "a positive integer")
        for name in ("synth_factor_a", "synth_factor_b"):
            value = getattr(self, name)
            require(self, name, value is None or value >= 1, "a positive integer")
        a, b = factorized_dense_sizes(self.synth_max_len, self.synth_factor_a, self.synth_factor_b)
        if a * b < self.synth_max_len:
            raise ValueError(f"--synth-factor-a {a} x --synth-factor-b {b} = {a * b} is less than "
                             f"--synth-max-len {self.synth_max_len}: choose a*b >= N (e.g. a*b = N)")
        parse_mix(self.synth_mix)


TINY = {"synth_max_len": 128, "synth_rank": 8}

# sublayer name -> (components, frozen R)
VARIANTS: Dict[str, Tuple[Tuple[str, ...], bool]] = {
    "dense": (("dense",), False),
    "random": (("random",), False),
    "fixed_random": (("random",), True),
    "factorized_dense": (("factorized_dense",), False),
    "factorized_random": (("factorized_random",), False),
    "random_dense": (("random", "dense"), False),
    "dense_vanilla": (("dense", "vanilla"), False),
    "random_vanilla": (("random", "vanilla"), False),
}


def parse_mix(text: str) -> Tuple[str, ...]:
    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    bad = [n for n in names if n not in COMPONENTS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--synth-mix {text!r}: give distinct names from {','.join(COMPONENTS)}")
    return names


def _check_positions(spec: SublayerSpec, max_len: int):
    """The model must not accept examples longer than the synthesizer tables (fairseq then
    filters them out instead of the forward pass failing mid-training)."""
    attr = "max_source_positions" if spec.side == "encoder" else "max_target_positions"
    value = getattr(spec.args, attr, None)
    if value is not None and int(value) > max_len:
        flag = "--" + attr.replace("_", "-")
        raise ValueError(f"{flag} {value} exceeds --synth-max-len {max_len}: pass {flag} "
                         f"{max_len} (or less), or raise --synth-max-len")


def _log_mixture(module: SynthesizerAttention, name: str):
    """Training-time forward hook: log alpha of the first component (fairseq metrics)."""
    def hook(mod, inputs, output):
        if mod.training:
            metrics.log_scalar(name, mod.mixture_weights()[mod.components[0]], weight=1, round=3)

    module.register_forward_hook(hook)


class FairseqSynthesizerAttention(FlagErrors, SynthesizerAttention):
    """The sublayer: :class:`SynthesizerAttention` whose errors name the flags that set its
    arguments (``--synth-max-len`` where the module says ``max_len``)."""

    flag_errors = {SequenceTooLong: lambda e: (
        f"sequence length {e.length} (the first dimension of time-first [T, B, C] inputs) "
        f"exceeds the synthesizer max length {e.max_len}: raise --synth-max-len (or keep "
        "--max-source-positions/--max-target-positions/--tokens-per-sample within it so longer "
        "examples are skipped)")}


def build_synthesizer(spec: SublayerSpec, components, freeze: bool) -> SynthesizerAttention:
    o: SynthesizerConfig = spec.options
    _check_positions(spec, o.synth_max_len)
    note_length_limit("--synth-max-len", o.synth_max_len)  # named when fairseq skips examples
    module = FairseqSynthesizerAttention(
        spec.embed_dim, spec.num_heads, components=components, max_len=o.synth_max_len,
        dropout=spec.attention_dropout, freeze_random=freeze or o.synth_freeze_random,
        factor_a=o.synth_factor_a, factor_b=o.synth_factor_b, rank=o.synth_rank,
        share_heads=o.synth_share_heads, table_kernel=str(o.synth_table_kernel),
        rope_theta=host_rope_theta(spec))
    if len(components) > 1:
        _log_mixture(module, f"mix_{spec.side[:3]}{spec.layer_idx}_{components[0]}")
    return module


def _make_builder(variant: str):
    components, freeze = VARIANTS[variant]

    def build(spec: SublayerSpec):
        return build_synthesizer(spec, components, freeze)

    build.__name__ = f"build_synth_{variant}"
    build.__doc__ = (f"Synthesizer {variant.replace('_', ' ')} self-attention "
                     f"({' + '.join(components)})")
    return build


def mix_rope(options: SynthesizerConfig) -> Optional[str]:
    """The generic sublayer's --rope declaration: its vanilla component is rotated (the
    synthesized tables are their own positions), so a --synth-mix without one cannot be."""
    if "vanilla" in parse_mix(options.synth_mix):
        return None
    return f"add vanilla to --synth-mix {options.synth_mix}"


for _variant in VARIANTS:
    register_sublayer(f"synth_{_variant}", slots=("self_attn",), options=SynthesizerConfig,
                      tiny=TINY, rope="vanilla" in VARIANTS[_variant][0])(_make_builder(_variant))


@register_sublayer("synth", slots=("self_attn",), options=SynthesizerConfig, tiny=TINY,
                   rope=mix_rope)
def build_synth(spec: SublayerSpec):
    """Synthesizer self-attention with the components of --synth-mix (one, or a mixture)"""
    return build_synthesizer(spec, parse_mix(spec.options.synth_mix), False)


# ---- architectures ------------------------------------------------------------------------------
def _uses_synth(args, attr: str) -> bool:
    names = str(getattr(args, attr, None) or "").split(",")
    return any(n.strip().startswith("synth") for n in names)


def _left_at_task_default(args, name: str) -> bool:
    """Whether ``args.<name>`` is the task's own default, i.e. the flag was not given. fairseq's
    parser puts the task dataclass's default object itself into ``args``; a value given on the
    command line is a new object parsed from its string (so an explicit ``--tokens-per-sample 1024``
    is not the default 1024). Anything else (e.g. a config file) counts as explicit."""
    dc = TASK_DATACLASS_REGISTRY.get(getattr(args, "task", None))
    f = getattr(dc, "__dataclass_fields__", {}).get(name)
    return f is not None and getattr(args, name, None) is f.default


def cap_positions(args, decoder_only: bool = False):
    """max_source/target_positions := min(fairseq default, N) where a side uses a synthesizer and
    the user gave none; an explicit larger value is caught by the builder's check. For the LM the
    block size --tokens-per-sample is capped the same way when it was not given (the task's default
    1024); an explicit value larger than N is a one-line error."""
    max_len = build_options(SynthesizerConfig, args).synth_max_len
    sides = [("max_target_positions", "decoder_self_attn")]
    if not decoder_only:
        sides.append(("max_source_positions", "encoder_self_attn"))
    for attr, slot in sides:
        if _uses_synth(args, slot) and getattr(args, attr, None) is None:
            setattr(args, attr, min(FAIRSEQ_DEFAULT_POSITIONS, max_len))
    tps = getattr(args, "tokens_per_sample", None)
    if decoder_only and tps is not None and int(tps) > max_len:
        if not _left_at_task_default(args, "tokens_per_sample"):
            raise ValueError(f"--tokens-per-sample {tps} exceeds --synth-max-len {max_len}: pass "
                             f"--tokens-per-sample {max_len} (or less), or raise --synth-max-len")
        logger.info(f"Synthesizer LM: --tokens-per-sample not given: block size = --synth-max-len "
                    f"{max_len} (not the task's default {tps})")
        args.tokens_per_sample = max_len


ARCHS: List[str] = []


def register_synth_arch(model: str, name: str, **preset):
    """``register_arch`` whose arch then caps positions at --synth-max-len (:func:`cap_positions`)."""
    decoder_only = model == "attnzoo_lm"
    ARCHS.append(name)
    return register_arch(model, name, post=lambda args: cap_positions(args, decoder_only), **preset)


for _variant in VARIANTS:
    _sub = f"synth_{_variant}"
    register_synth_arch("attnzoo_transformer", f"transformer_{_sub}",
                        encoder_self_attn=_sub, decoder_self_attn=_sub)
    register_synth_arch("attnzoo_lm", f"transformer_lm_{_sub}", decoder_self_attn=_sub)


# ---- analysis -----------------------------------------------------------------------------------
def mixture_weights(model) -> List[Tuple[str, Dict[str, float]]]:
    """[(module name, {component: alpha})] for every synthesizer layer of a model, in order."""
    return [(name, m.mixture_weights()) for name, m in model.named_modules()
            if isinstance(m, SynthesizerAttention)]


def format_mixture_weights(model) -> str:
    rows = [f"{name}: " + ", ".join(f"{c}={a:.3f}" for c, a in w.items())
            for name, w in mixture_weights(model)]
    return "\n".join(rows) if rows else "(no synthesizer layers)"



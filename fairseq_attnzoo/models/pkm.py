"""``pkm``: product-key memory in the FFN slot of chosen layers (Lample et al., 2019; see
:mod:`fairseq_attnzoo.modules.pkm`).

Archs: ``transformer_pkm`` (encoder-decoder) and ``transformer_lm_pkm`` (decoder-only LM).
``--pkm-encoder-layers`` / ``--pkm-decoder-layers`` pick the layers whose FFN becomes a memory
(default: the middle layer, index L//2); the arch turns them into the per-layer
``--encoder-ffn`` / ``--decoder-ffn`` lists of the generic machinery, so ``--decoder-ffn
ffn,ffn,pkm,...`` works too (and so does ``--decoder-ffn pkm`` on any zoo arch).

Memory+ (Berges et al., 2024): ``--pkm-shared-values`` (one value pool read by every memory layer
of the model), ``--pkm-swilu-output`` (W₂(m(x) ⊙ SiLU(W₁x)) with the reference's biases, init and
dropout order), ``--pkm-init memplus`` and (ours, off in the preset) ``--pkm-qk-norm``. The preset
``transformer_lm_memplus`` is the Memory+ layer as facebookresearch/memory configures it
(``apps/main/configs/pkplus_373m_1024k.yaml``: ``mem_share_values``, ``swilu_projection``,
``mem_n_keys: 1024``, ``mem_k_dim: 512`` at ``dim: 1024``, ``layers: "4,12,20"`` of 24; no query
batch norm, the ``HashingMemory`` default): shared pool, swilu output, 1024 half-keys,
k_dim = d/2, value dim = d, three memory layers spread through the stack
(``--pkm-decoder-layers spread``: 4, 12, 20 of 24). Its host is fairseq's transformer, not the
memory code's Llama.

Sparse value updates: ``--pkm-sparse auto`` (default) makes the value gradients sparse exactly when
they can be consumed -- ``--optimizer pkm_adam`` without --fp16/--bf16/--amp, on one process or
under ``--ddp-backend legacy_ddp``/``no_c10d``/``pytorch_ddp``/``c10d`` (``pkm_adam`` exchanges
the rows read across processes, see :mod:`fairseq_attnzoo.optim.pkm_optimizer`) -- and dense
otherwise, so every fairseq optimizer works with the defaults. ``--pkm-sparse true`` forces sparse
and refuses, at build time and in one line, the combinations that cannot work.

Validation diagnostics (XLM's ``mem_used`` and ``mem_kl_w``, ``xlm/evaluation/evaluator.py``):
``pkm_<side><layer>_usage`` (fraction of the |K| slots that received any weight over the whole
validation set) and ``pkm_<side><layer>_kl`` (KL divergence of the slot-weight distribution from
uniform) appear in fairseq-train's valid log line.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import meters, metrics
from fairseq.logging.meters import Meter

from .. import compat
from ..modules.pkm import SEARCH_DTYPES, ProductKeyMemory, slot_counts, usage_stats
from ..modules.pkm_search_triton import SEARCH_KERNELS, SearchUnavailable
from ..modules.pkm_triton import KERNELS, KernelUnavailable
from ..optim.pkm_optimizer import values_lr
from .llama import LLAMA, llama_post
from .pkm_shard import shard_values
from .registry import Derived, register_arch
from .sublayers import FlagErrors, register_sublayer, require, to_bool

logger = logging.getLogger(__name__)

_FP_FLAGS = ("fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16")


@dataclass
class PKMConfig(FairseqDataclass):
    pkm_n_keys: int = field(
        default=512, metadata={"help": "PKM sub-keys per half (n_keys = √|K|; |K| = n_keys² "
                               "memory slots; default 512 -> 262,144 slots)"})
    pkm_heads: int = field(default=4, metadata={"help": "PKM memory heads (H, default 4)"})
    pkm_knn: int = field(
        default=32, metadata={"help": "PKM slots read per head (k, top-k; default 32)"})
    pkm_k_dim: int = field(
        default=256, metadata={"help": "PKM query/key dim (d_q, split in two halves; default 256)"})
    pkm_value_dim: int = field(
        default=0, metadata={"help": "PKM value dim (default 0 = d_model; otherwise a linear map "
                             "brings it back to d_model)"})
    pkm_query_batchnorm: bool = field(
        default=True, metadata={"help": "batch norm on the PKM query (statistics over non-pad "
                                "tokens only; default on)"})
    pkm_input_dropout: float = field(default=0.0, metadata={"help": "PKM input dropout (default 0)"})
    pkm_query_dropout: float = field(default=0.0, metadata={"help": "PKM query dropout (default 0)"})
    pkm_value_dropout: float = field(
        default=0.0, metadata={"help": "PKM dropout on the read values (default 0)"})
    pkm_sparse: ChoiceEnum(["auto", "true", "false"]) = field(  # type: ignore
        default="auto",
        metadata={"help": "sparse gradients for the PKM value table (nn.EmbeddingBag sparse=True): "
                  "auto = sparse with --optimizer pkm_adam without --fp16/--bf16/--amp, on one "
                  "process or several (legacy_ddp/no_c10d/pytorch_ddp/c10d: pkm_adam exchanges "
                  "the rows read), dense otherwise (default auto)"})
    pkm_shared_values: bool = field(
        default=False,
        metadata={"help": "Memory+ shared memory pool: every memory layer of the model reads ONE "
                  "value table V (own query network and sub-keys per layer); default off"})
    pkm_swilu_output: bool = field(
        default=False,
        metadata={"help": "Memory+ 'swilu' output (Memory Layers at Scale; facebookresearch/"
                  "memory swilu_projection): out = W2(m(x) * SiLU(W1 x)), W1: d -> v_dim, W2: "
                  "v_dim -> d, both with biases and N(0, d^-1/2) weights, x after "
                  "--pkm-input-dropout, --pkm-value-dropout on the output; default off "
                  "(out = m(x)); transformer_lm_memplus: on"})
    pkm_gated_output: Optional[bool] = field(
        default=None,
        metadata={"help": "DEPRECATED, use --pkm-swilu-output (kept because checkpoints written "
                  "before 0.2 store it): on = this project's old gated output, W2(m(x) * "
                  "SiLU(W1 x)) without biases, gate on the undropped input, value dropout "
                  "before W2; default unset"})
    pkm_init: ChoiceEnum(["xlm", "memplus"]) = field(  # type: ignore
        default="xlm",
        metadata={"help": "PKM initialisation: xlm = XLM's (sub-keys uniform(+-1/sqrt(d_q/2)), "
                  "nn.Linear query net), memplus = facebookresearch/memory's (sub-keys "
                  "uniform(+-1/sqrt(d_q)), Xavier-uniform query weight); values N(0, v_dim^-1/2) "
                  "in both; default xlm, transformer_lm_memplus: memplus"})
    pkm_qk_norm: bool = field(
        default=False,
        metadata={"help": "qk-norm of the key search, OUR form (facebookresearch/memory has "
                  "none; the Memory Layers paper's wording on it was not verified): half-queries "
                  "RMS-normalised with a learned gain g, sub-keys c/||c||; default off"})
    pkm_residual_dropout: bool = field(
        default=False,
        metadata={"help": "apply fairseq's --dropout to the memory layer's output before the "
                  "residual sum, as fairseq does to an FFN's output; default off, as in XLM "
                  "(xlm/model/transformer.py adds the memory's output undropped) and the memory "
                  "code (its Llama block has no dropout). Checkpoints written before this flag "
                  "existed store no value for it and keep it on"})
    pkm_kernel: ChoiceEnum(list(KERNELS)) = field(  # type: ignore
        default="auto",
        metadata={"help": "PKM value read and its gradients: auto = fused Triton kernels on CUDA "
                  "when Triton is importable, the PyTorch reference otherwise; triton / torch "
                  "force one (same function; the kernels accumulate in float32); default auto"})
    pkm_search_kernel: ChoiceEnum(list(SEARCH_KERNELS)) = field(  # type: ignore
        default="auto",
        metadata={"help": "PKM product-key search (top-k of both halves, the candidate pairs, "
                  "the softmax) and its backward: auto = the fused Triton kernels on CUDA for "
                  "bf16/fp16 search inputs (--pkm-search-dtype model in a bf16/fp16 model; "
                  "float32 ones where the kernel's float32 specialisation ships), the PyTorch "
                  "reference otherwise (on the CPU always; said once in the "
                  "log); triton / torch force one (same slots; ties go to the lower index); "
                  "default auto"})
    pkm_search_dtype: ChoiceEnum(list(SEARCH_DTYPES)) = field(  # type: ignore
        default="model",
        metadata={"help": "dtype of the queries and sub-keys the PKM search scores (after the "
                  "float32 batch norm / qk-norm; scores, top-k and softmax are float32 either "
                  "way): model = the model's (bf16/fp16 under --bf16/--fp16/--amp, as the "
                  "references search); float32 = float32 inputs, the search of earlier versions, "
                  "for a run that must repeat it (docs/precision.md); default model"})
    pkm_shard_values: bool = field(
        default=False,
        metadata={"help": "split every PKM value table (a shared pool included) by columns over "
                  "the processes of distributed training (memory parallelism): each rank keeps "
                  "d/G columns, their gradient and optimizer state; indices, weights and "
                  "activations cross the network instead of the table's gradient; checkpoints "
                  "hold whole tables. One process: the tables stay whole; default off"})
    pkm_shard_group_size: int = field(
        default=0,
        metadata={"help": "--pkm-shard-values: ranks G that split one table (a divisor of the "
                  "number of processes, dividing the value dim; groups of consecutive ranks, "
                  "each holding a copy of the table); 0 = all processes (default 0)"})
    pkm_encoder_layers: Optional[str] = field(
        default=None,
        metadata={"help": "transformer_pkm: encoder layers (0-based, comma-separated) whose FFN "
                  "is a memory; 'middle' = layer L//2, 'spread[:N]' = N (default 3) evenly "
                  "spaced layers, 'none' (default: middle)"})
    pkm_decoder_layers: Optional[str] = field(
        default=None,
        metadata={"help": "transformer_pkm / transformer_lm_pkm: decoder layers (0-based, "
                  "comma-separated) whose FFN is a memory; 'middle' = layer L//2, 'spread[:N]' "
                  "= N (default 3) evenly spaced layers, 'none' (default: middle; "
                  "transformer_lm_memplus: spread)"})

    def validate(self):
        for name in ("pkm_n_keys", "pkm_heads", "pkm_knn", "pkm_k_dim"):
            require(self, name, getattr(self, name) > 0, "a positive integer")
        require(self, "pkm_k_dim", self.pkm_k_dim % 2 == 0,
                "even (the query is split in two halves)")
        if self.pkm_knn > self.pkm_n_keys:
            raise ValueError(f"--pkm-knn ({self.pkm_knn}) cannot exceed --pkm-n-keys "
                             f"({self.pkm_n_keys}): each half-query picks its top-k among n_keys "
                             "sub-keys")
        require(self, "pkm_value_dim", self.pkm_value_dim >= 0, ">= 0 (0 = d_model)")
        for name in ("pkm_input_dropout", "pkm_query_dropout", "pkm_value_dropout"):
            require(self, name, 0.0 <= getattr(self, name) < 1.0, "in [0, 1)")
        if self.pkm_gated_output and self.pkm_swilu_output:
            raise ValueError("--pkm-gated-output (the old gated form, no biases) and "
                             "--pkm-swilu-output contradict: give only --pkm-swilu-output")

    @staticmethod
    def upgrade_stored(args):
        """Before the defaults are filled (:func:`fill_sublayer_defaults`): a checkpoint's stored
        config written before --pkm-residual-dropout existed has a value for every original PKM
        flag and no key for this one; its model was trained with fairseq's --dropout on the
        memory output, so the flag is set on. A new config (command line: the key is there,
        unset; a hydra config: these flags are not all given) is left to the default."""
        if _has_key(args, "pkm_residual_dropout") or not all(
                getattr(args, k, None) is not None for k in _ORIGINAL_FLAGS):
            return
        setattr(args, "pkm_residual_dropout", True)
        if any("pkm" in str(getattr(args, a, None) or "") for a in ("encoder_ffn", "decoder_ffn")):
            logger.info("PKM: a config stored before --pkm-residual-dropout existed: fairseq's "
                        "--dropout stays on the memory output, as the model was trained")


#: the PKM flags every checkpoint has stored since the method was added (tests/fixtures/compat):
#: a stored config holds them all, a new one does not
_ORIGINAL_FLAGS = ("pkm_n_keys", "pkm_heads", "pkm_knn", "pkm_k_dim", "pkm_value_dim",
                   "pkm_query_batchnorm", "pkm_input_dropout", "pkm_query_dropout",
                   "pkm_value_dropout", "pkm_sparse")


def _has_key(args, key: str) -> bool:
    """Whether ``args`` (a Namespace, an omegaconf DictConfig, a dataclass) has ``key`` at all,
    set or not."""
    try:
        return key in args
    except TypeError:
        return hasattr(args, key)


def _optimizer_name(args) -> Optional[str]:
    opt = getattr(args, "optimizer", None)
    if opt is None or isinstance(opt, str):
        return opt
    return getattr(opt, "_name", None)


#: DDP wrappers that can leave the value tables to pkm_adam's sparse exchange: fairseq's legacy
#: DDP skips parameters tagged ``expert``, PyTorch DDP the model's
#: ``_ddp_params_and_buffers_to_ignore`` (see models/transformer.py)
SPARSE_DDP_BACKENDS = ("legacy_ddp", "no_c10d", "pytorch_ddp", "c10d")


def _multi_process_blocker(args) -> Optional[str]:
    """Why sparse values cannot train under this multi-process setup (None: they can)."""
    world = int(getattr(args, "distributed_world_size", 1) or 1)
    if world <= 1:
        return None
    if getattr(args, "use_bmuf", False):
        return "--use-bmuf (it replaces the gradient all-reduce that pkm_adam extends)"
    backend = str(getattr(args, "ddp_backend", "pytorch_ddp"))
    if backend not in SPARSE_DDP_BACKENDS:
        return (f"--ddp-backend {backend} (it shards or averages parameters itself; sparse "
                f"values work with {', '.join(SPARSE_DDP_BACKENDS)})")
    return None


def sparse_values(args, mode: Optional[str] = None) -> bool:
    """Resolve --pkm-sparse ``mode`` (default: ``args.pkm_sparse``) against the training setup
    in ``args`` (optimizer, precision, DDP); refuse combinations that cannot train, in one
    line."""
    mode = str(mode or getattr(args, "pkm_sparse", None) or "auto")
    optimizer = _optimizer_name(args)
    low_precision = [f"--{f.replace('_', '-')}" for f in _FP_FLAGS if getattr(args, f, False)]
    # --memory-efficient-* step the half parameters themselves (fairseq also sets --fp16/--bf16
    # for them); --fp16/--bf16 copy gradients into dense fp32 masters, --amp scales them with
    # fairseq's dense rule
    in_place = [f for f in low_precision if f.startswith("--memory-efficient")]
    blocking = [f for f in low_precision if f == "--amp"] if in_place else low_precision
    blocker = _multi_process_blocker(args)
    if mode == "false":
        return False
    if mode == "auto":
        return optimizer == "pkm_adam" and blocker is None and not low_precision
    if mode != "true":
        raise ValueError(f"--pkm-sparse must be auto, true or false, got {mode!r}")
    if optimizer is not None and optimizer != "pkm_adam":
        raise ValueError(
            f"--pkm-sparse true gives sparse gradients that --optimizer {optimizer} (and fairseq's "
            "gradient clipping) cannot take: use --optimizer pkm_adam, or --pkm-sparse false")
    if blocker is not None:
        raise ValueError(f"--pkm-sparse true does not work with {blocker}: use --pkm-sparse false")
    if blocking:
        raise ValueError(
            f"--pkm-sparse true does not work with {' '.join(blocking)} (fairseq's wrapper copies "
            "or scales the gradients as dense ones): use --pkm-sparse false, or "
            "--memory-efficient-bf16 / --memory-efficient-fp16")
    return True


# ---- validation diagnostics ---------------------------------------------------------------------

class SlotUsageMeter(Meter):
    """Accumulates per-slot weights Z over a whole validation pass; reports usage or KL.

    The counts are not checkpointed (``state_dict`` keeps only the statistic's name): fairseq
    prints validation stats from a fresh aggregator each time, so nothing is lost."""

    def __init__(self, stat: str = "usage"):
        self.stat = stat
        self.reset()

    def reset(self):
        self.counts: Optional[torch.Tensor] = None

    def update(self, counts: torch.Tensor):
        self.counts = counts if self.counts is None else self.counts + counts

    def state_dict(self):
        return {"stat": self.stat}

    def load_state_dict(self, state_dict):
        self.stat = state_dict.get("stat", "usage")
        self.reset()

    @property
    def smoothed_value(self) -> float:
        if self.counts is None:
            return 0.0
        usage, kl = usage_stats(self.counts.cpu())
        return round(usage if self.stat == "usage" else kl, 4)


def _register_meter():
    setattr(meters, SlotUsageMeter.__name__, SlotUsageMeter)
    return lambda: delattr(meters, SlotUsageMeter.__name__)


# fairseq checkpoints the "valid" aggregator and rebuilds its meters by class name from the
# globals of fairseq.logging.meters: the compat entry registers this class there.
compat.register(compat.Patch(
    "fairseq_meters_slot_usage", "fairseq.logging.meters (module globals)",
    "fairseq rebuilds checkpointed meters by class name from fairseq.logging.meters' globals; "
    "PKM's SlotUsageMeter must be resolvable there for --restore-file", compat.always,
    _register_meter, "fairseq 0.12.3"), after="fairseq_bf16_without_tpu")


class UsageLogger:
    """``usage_callback`` of a memory: logs the slot weights into fairseq's metrics.

    Active only when the global "default" aggregator is not: fairseq-train validates inside
    ``metrics.aggregate(new_root=True)``, whose smoothed values are the valid log line. Reads in
    other eval-mode contexts (generate, eval-lm, tests) log nothing. With a shared value pool,
    ``pool`` names the pool's own meters too: every layer's reads also count there, so
    ``<pool>_usage``/``<pool>_kl`` describe the table as a whole."""

    def __init__(self, name: str, size: int, pool: Optional[str] = None):
        self.name, self.size, self.pool = name, size, pool

    def __call__(self, indices: torch.Tensor, weights: torch.Tensor):
        default = metrics.get_meters("default")
        active = metrics.get_active_aggregators()
        if not active or any(agg is default for agg in active):
            return
        counts = slot_counts(indices, weights, self.size)
        for name in (self.name, self.pool):
            if name is not None:
                metrics.log_custom(lambda: SlotUsageMeter("usage"), f"{name}_usage", counts)
                metrics.log_custom(lambda: SlotUsageMeter("kl"), f"{name}_kl", counts)


def output_form(options: PKMConfig) -> str:
    """--pkm-swilu-output / the deprecated --pkm-gated-output -> the module's ``swilu`` form."""
    if options.pkm_gated_output:
        return "legacy"
    return "reference" if options.pkm_swilu_output else "off"


#: name of the shared value pool in the diagnostics and in ``SublayerSpec.shared``
POOL = "pkm_pool"


class FairseqProductKeyMemory(FlagErrors, ProductKeyMemory):
    """The sublayer: :class:`ProductKeyMemory` whose errors name the flags that set its
    arguments (``--pkm-kernel`` where the module says ``kernel``)."""

    flag_errors = {KernelUnavailable: lambda e: (
        f"--pkm-kernel triton cannot run: {e.why}; use --pkm-kernel auto (a checkpoint: "
        "--model-overrides \"{'pkm_kernel': 'auto'}\")"),
        SearchUnavailable: lambda e: (
        f"--pkm-search-kernel triton cannot run: {e.why}; use --pkm-search-kernel auto or torch "
        "(a checkpoint: --model-overrides \"{'pkm_search_kernel': 'auto'}\")")}


@register_sublayer("pkm", slots=("ffn",), options=PKMConfig,
                   tiny={"pkm_n_keys": 8, "pkm_knn": 4, "pkm_k_dim": 16, "pkm_heads": 2},
                   # a token decoded alone and in a batch differs by the rounding of its inputs,
                   # which can swap two near-equal keys in the top-k: one of k reads changes,
                   # so the step's outputs differ by more than rounding (docs/precision.md)
                   tolerances={"reduced_precision_step": 0.5})
def build_pkm(spec):
    """product-key memory: exact top-k over n_keys² product keys, sparse value reads"""
    o = spec.options
    owner = spec.shared.get(POOL) if o.pkm_shared_values else None  # the first memory
    pool = owner.values if owner is not None else None  # its table (split, when splitting)
    v_dim = o.pkm_value_dim or spec.embed_dim
    if pool is not None and pool.embedding_dim != v_dim:
        raise ValueError(f"--pkm-shared-values needs one value dim for every memory, got "
                         f"{pool.embedding_dim} and {v_dim}: set --pkm-value-dim")
    if o.pkm_shared_values and str(getattr(spec.args, "ddp_backend", "")) == "fully_sharded":
        raise ValueError("--pkm-shared-values cannot be used with --ddp-backend fully_sharded "
                         "(FSDP wraps layers separately): use another --ddp-backend")
    memory = FairseqProductKeyMemory(
        spec.embed_dim, spec.embed_dim, n_keys=o.pkm_n_keys, heads=o.pkm_heads, knn=o.pkm_knn,
        k_dim=o.pkm_k_dim, v_dim=v_dim, query_batchnorm=o.pkm_query_batchnorm,
        input_dropout=o.pkm_input_dropout, query_dropout=o.pkm_query_dropout,
        value_dropout=o.pkm_value_dropout, sparse=sparse_values(spec.args, o.pkm_sparse),
        values=pool, swilu=output_form(o), init=o.pkm_init, qk_norm=o.pkm_qk_norm,
        kernel=str(o.pkm_kernel), residual_dropout=o.pkm_residual_dropout,
        search_kernel=str(o.pkm_search_kernel), search_dtype=str(o.pkm_search_dtype))
    if o.pkm_shared_values and pool is None:
        spec.shared[POOL] = memory  # (the others read its table, once split)
    memory.usage_callback = UsageLogger(f"pkm_{spec.side[:3]}{spec.layer_idx}", memory.size,
                                        POOL if o.pkm_shared_values else None)
    # one line each per model, at its first training step (not when a checkpoint is loaded to
    # evaluate: that model never trains)
    memory.register_forward_pre_hook(spec.shared.setdefault(
        "pkm_training_notices", TrainingNotice(spec.args)))
    shard_values(spec, o, memory)  # --pkm-shard-values: the table (a pool: its owner's) split
    return memory


#: optimizers that give the memory values a rate of their own: pkm_adam (--pkm-values-lr), and
#: fairseq's composite, whose groups are the parameters' ``param_group`` tags ("pkm_values")
OWN_VALUE_RATE = ("pkm_adam", "composite")
#: a preset's reference ratio of the values' peak lr to the model's: pkplus_373m_1024k.yaml
#: gives the values value_fixed_lr 0.001 against optim.lr 1e-4, and one LambdaLR scales both
REFERENCE_VALUES_LR_RATIO = {"transformer_lm_memplus_llama": 10.0}


def optimizer_notices(args) -> List[str]:
    """The lines of what the optimizer's flags leave different from the references: an
    optimizer without a value rate of its own; under a preset with a reference value-lr ratio
    (:data:`REFERENCE_VALUES_LR_RATIO`), pkm_adam at another ratio."""
    optimizer = _optimizer_name(args)
    if optimizer is None:
        return []
    if optimizer not in OWN_VALUE_RATE:
        return [(
            f"PKM: --optimizer {optimizer} trains the memory values at the model's --lr; XLM "
            "and the memory code give them their own rate (1e-3): use --optimizer pkm_adam with "
            "--pkm-values-lr (and --pkm-values-lr-schedule, --pkm-values-betas, "
            "--pkm-values-weight-decay, --pkm-values-clip-norm)")]
    want = REFERENCE_VALUES_LR_RATIO.get(getattr(args, "arch", None))
    lr = getattr(args, "lr", None)
    lr = lr[0] if hasattr(lr, "__getitem__") else lr  # (fairseq's --lr is a list)
    if optimizer != "pkm_adam" or want is None or not lr:
        return []
    ratio = values_lr(args, lr) / lr
    if math.isclose(ratio, want, rel_tol=1e-6):
        return []
    return [(
        f"PKM: {args.arch}: the values' lr is {ratio:g}x --lr; the reference's is {want:g}x "
        f"(pkplus_373m_1024k.yaml: 1e-3 against 1e-4): --pkm-values-lr-ratio {want:g}")]


class TrainingNotice:
    """Forward pre-hook of a model's memories: at the first forward in training mode, one
    warning line for each of :func:`optimizer_notices` (the flags ``args`` leave different from
    the references)."""

    def __init__(self, args):
        self.args, self.done = args, False

    def __call__(self, module, inputs):
        if self.done or not module.training:
            return
        self.done = True
        for text in optimizer_notices(self.args):
            logger.warning(text)


# ---- archs: memory in the selected layers -------------------------------------------------------

def memory_layers(value: Optional[str], n_layers: int, flag: str) -> List[int]:
    value = "middle" if value is None else str(value).strip().lower()
    if value == "middle":
        return [n_layers // 2] if n_layers > 0 else []
    if value in ("none", ""):
        return []
    if value == "spread" or value.startswith("spread:"):
        # N evenly spaced layers, the i-th at ⌊(2i+1)·L / 2N⌋: 4, 12, 20 of 24, the layers of
        # facebookresearch/memory's configs (pkplus_373m_1024k.yaml)
        try:
            n = int(value.split(":", 1)[1]) if ":" in value else 3
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{flag} {value}: 'spread:N' needs a positive integer N")
        n = min(n, n_layers)
        return [(2 * i + 1) * n_layers // (2 * n) for i in range(n)]
    try:
        layers = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise ValueError(f"{flag} must be 'middle', 'none' or comma-separated layer indices, "
                         f"got {value!r}") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"{flag} {value}: layer indices are 0-based and must be < {n_layers} "
                         f"(the number of layers); got {bad}")
    return layers


def memory_slots(args, side: str, dense: str = "ffn") -> str:
    """--pkm-{side}-layers -> the per-layer --{side}-ffn list ("ffn,pkm,ffn,..."; ``dense``: the
    FFN of the other layers)."""
    n_layers = int(getattr(args, f"{side}_layers"))
    layers = memory_layers(getattr(args, f"pkm_{side}_layers", None), n_layers,
                           f"--pkm-{side}-layers")
    return ",".join("pkm" if i in layers else dense for i in range(n_layers)) or dense


def _memory_slots(side: str, dense: str = "ffn") -> Derived:
    """The preset value of --{side}-ffn: :func:`memory_slots` when --{side}-ffn is not given."""
    return Derived(lambda args: memory_slots(args, side, dense),
                   f"pkm where --pkm-{side}-layers says, else {dense}")


def _check_selection(*sides: str, dense: str = "ffn"):
    """``post``: --pkm-{side}-layers and an explicit --{side}-ffn must agree (checkpoints store
    both, so a loaded model passes)."""

    def check(args):
        for side in sides:
            if getattr(args, f"pkm_{side}_layers", None) is None:
                continue
            given = getattr(args, f"{side}_ffn")
            if given != memory_slots(args, side, dense):
                raise ValueError(f"--pkm-{side}-layers and --{side}-ffn disagree ({given}): give "
                                 "only one of them")

    return check


# transformer_pkm: encoder-decoder, a memory in the middle encoder and decoder layer;
# transformer_lm_pkm: decoder-only LM, a memory in the middle layer
register_arch("attnzoo_transformer", "transformer_pkm",
              post=_check_selection("encoder", "decoder"), encoder_ffn=_memory_slots("encoder"),
              decoder_ffn=_memory_slots("decoder"))
register_arch("attnzoo_lm", "transformer_lm_pkm", post=_check_selection("decoder"),
              decoder_ffn=_memory_slots("decoder"))


def _gated(args) -> bool:
    """Whether the deprecated --pkm-gated-output is on (a bool, or a checkpoint's string)."""
    value = getattr(args, "pkm_gated_output", None)
    return value is not None and to_bool(value, "--pkm-gated-output")


#: transformer_lm_memplus, the Memory+ layer of Berges et al. (2024) as facebookresearch/memory
#: configures it, relative to transformer_lm_pkm: one value pool shared by three memory layers
#: spread through the stack, swilu output, the reference's inits, no query batch norm, 1024²
#: slots, values d and k_dim = d/2 (``mem_k_dim: 512`` at ``dim: 1024`` in
#: pkplus_373m_1024k.yaml; pk_7b.yaml keeps 512 at dim 4096, d/8). A checkpoint of the old
#: preset stores --pkm-gated-output: its output form wins.
MEMPLUS = {"pkm_shared_values": True, "pkm_init": "memplus", "pkm_qk_norm": False,
           "pkm_query_batchnorm": False, "pkm_n_keys": 1024, "pkm_decoder_layers": "spread",
           "pkm_swilu_output": Derived(lambda args: not _gated(args),
                                       "on unless --pkm-gated-output is on"),
           "pkm_k_dim": Derived(lambda args: max(2, int(args.decoder_embed_dim) // 4 * 2),
                                "d_model / 2")}
register_arch("attnzoo_lm", "transformer_lm_memplus", post=_check_selection("decoder"),
              decoder_ffn=_memory_slots("decoder"), **MEMPLUS)


def _memplus_llama_post(args):
    llama_post(args)
    _check_selection("decoder", dense="swiglu")(args)


#: transformer_lm_memplus_llama: Memory+ (MEMPLUS) in the host the memory code puts it in
#: (attnzoo_lm_llama: RMSNorm pre-norm, SwiGLU, RoPE, no biases, no dropout), at
#: pkplus_373m_1024k.yaml's sizes: dim 1024, 24 layers, 16 heads, rope_theta 500000, memories in
#: layers 4, 12, 20 ("spread" of 24), 1024 half-keys, k_dim 512, shared values, swilu output
#: (whose two Linears keep their biases, as in the memory code). The values' own rate
#: (value_fixed_lr 0.001) is an optimizer's: --optimizer pkm_adam (--pkm-values-lr 1e-3 default).
register_arch("attnzoo_lm", "transformer_lm_memplus_llama", post=_memplus_llama_post,
              decoder_ffn=_memory_slots("decoder", "swiglu"), **{**LLAMA, **MEMPLUS})

"""Every change this plugin makes to another library (fairseq, torch, numpy), in one table.

Each entry is a named :class:`Patch`: what it changes, why, and a check that the target is the
version it was written for. :func:`apply_all` applies each entry whose check passes and logs one
line per entry: ``applied``, ``skipped`` (the target is not the version we know, so we leave it
alone and say so) or ``disabled``.

Nothing is applied when the package or its plain PyTorch modules are imported. The table is
applied where fairseq uses the plugin: when fairseq imports it as a user dir (``--user-dir``,
hydra's ``common.user_dir``), when one of its models, tasks, criterions or optimizers is built,
when one of its console commands runs, and when a program calls :func:`fairseq_attnzoo.enable`
(needed before loading a checkpoint in a script: fairseq's ``torch.load`` needs the weights-only
allow-list before any model is built).

Opt out with the environment variable ``ATTNZOO_COMPAT_DISABLE``: a comma-separated list of entry
names, or ``all``. A model that cannot be right without an entry (adaptive spans under
``--fp16``/``--bf16`` need ``fairseq_fp16_master_projection``) refuses to build, in one line naming
the entry, when that entry was skipped or disabled (:func:`require`). :func:`status` says what
happened to each entry; :func:`describe` prints the table (``attnzoo-archs --compat``).

For fairseq functions, "the version we know" is the SHA-256 of the function's source (first 16 hex
digits) as shipped by ``fairseq-fixed==0.12.3.1``: a fairseq that changed the function gets no
patch and a warning, rather than a fix written for other code.
"""

import argparse
import hashlib
import inspect
import logging
import os
import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

logger = logging.getLogger(__name__)

ENV_DISABLE = "ATTNZOO_COMPAT_DISABLE"

APPLIED, SKIPPED, DISABLED = "applied", "skipped", "disabled"


@dataclass
class Patch:
    name: str
    target: str  # what is changed, "module:attribute"
    why: str  # one line
    #: None when the target is the version this patch knows; otherwise why it is not applied
    check: Callable[[], Optional[str]]
    apply: Callable[[], None]


PATCHES: List[Patch] = []
_STATUS: Dict[str, str] = {}
_REASONS: Dict[str, str] = {}  # why an entry was skipped


def patch(name: str, target: str, why: str, check: Callable[[], Optional[str]]):
    """Decorator: register ``fn`` as the ``apply`` of a table entry."""

    def deco(fn):
        if any(p.name == name for p in PATCHES):
            raise ValueError(f"compat patch {name!r} is defined twice")
        PATCHES.append(Patch(name, target, why, check, fn))
        return fn

    return deco


def source_digest(fn) -> Optional[str]:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def known_source(get: Callable[[], object], *digests: str) -> Callable[[], Optional[str]]:
    """A check that passes when the function returned by ``get()`` has one of these digests."""

    def check():
        try:
            fn = get()
        except (ImportError, AttributeError) as e:
            return f"target not found ({e})"
        digest = source_digest(fn)
        if digest in digests:
            return None
        return (f"{getattr(fn, '__qualname__', fn)} is not the version this patch was written for "
                f"(source digest {digest}, known {', '.join(digests)})")

    return check


def disabled_names() -> set:
    raw = os.environ.get(ENV_DISABLE, "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def apply_all() -> Dict[str, str]:
    """Apply every entry not yet handled in this process; returns :func:`status`. Cheap after
    the first call (each entry is handled once per process)."""
    if len(_STATUS) == len(PATCHES):
        return status()
    off = disabled_names()
    unknown = sorted(off - {p.name for p in PATCHES} - {"all"})
    if unknown and not _STATUS:
        logger.warning(f"{ENV_DISABLE}: no compat patch named {', '.join(unknown)}; the names are "
                       f"{', '.join(p.name for p in PATCHES)} (or all)")
    new = []
    for p in PATCHES:
        if p.name in _STATUS:
            continue
        if "all" in off or p.name in off:
            _STATUS[p.name] = DISABLED
            new.append(f"{p.name} (disabled)")
            continue
        reason = p.check()
        if reason is not None:
            _STATUS[p.name] = SKIPPED
            _REASONS[p.name] = reason
            logger.warning(f"compat: {p.name} not applied: {reason}; {p.target} left unchanged "
                           f"({p.why})")
            continue
        p.apply()
        _STATUS[p.name] = APPLIED
        new.append(p.name)
    if new:  # one line per process
        logger.info(f"compat patches: {', '.join(new)} (fairseq_attnzoo/compat.py; opt out with "
                    f"{ENV_DISABLE}=NAME,... or =all)")
    return status()


def status() -> Dict[str, str]:
    """``{entry: applied | skipped | disabled}`` of the entries handled so far in this process
    (empty until fairseq uses the plugin or a program calls :func:`fairseq_attnzoo.enable`)."""
    return dict(_STATUS)


def require(name: str, needed_by: str, alternative: str = "") -> None:
    """Refuse, in one line naming the entry, to go on without entry ``name`` (applies the table
    first). ``needed_by``: what needs it ("adaptive spans under --fp16"); ``alternative``: another
    way out, appended to the fix ("or train with --amp")."""
    from .errors import ZooConfigError

    if name not in {p.name for p in PATCHES}:  # pragma: no cover - a typo in our own code
        raise KeyError(name)
    state = apply_all().get(name)
    if state == APPLIED:
        return
    if state == DISABLED:
        raw = os.environ.get(ENV_DISABLE, "")
        why = f"disabled by {ENV_DISABLE}={raw}"
        fix = f"leave {name} out of {ENV_DISABLE}"
    else:
        why = f"not applied: {_REASONS.get(name, 'unknown reason')}"
        fix = "install fairseq-fixed==0.12.3.1"
    more = f" {alternative}" if alternative else ""
    raise ZooConfigError(f"{needed_by} needs the compat entry {name} ({why}): {fix}{more}")


def describe() -> str:
    """A table of the entries, their targets, reasons and what happened to each."""
    rows = [f"{p.name:34s} {_STATUS.get(p.name, 'not run'):9s} {p.target}\n{'':45s}{p.why}"
            for p in PATCHES]
    return "\n".join(rows)


def _always() -> Optional[str]:
    return None


# ---- torch ---------------------------------------------------------------------------------------

def _has_safe_globals() -> Optional[str]:
    import torch

    ok = hasattr(getattr(torch, "serialization", None), "add_safe_globals")
    return None if ok else "torch has no serialization.add_safe_globals (torch < 2.4: not needed)"


@patch("torch_safe_globals_namespace", "torch.serialization (weights-only allow-list)",
       "fairseq checkpoints pickle an argparse.Namespace; torch>=2.6 loads with weights_only=True. "
       "Allow-list just that class instead of disabling the safe loader globally",
       _has_safe_globals)
def _allow_namespace():
    import torch

    torch.serialization.add_safe_globals([argparse.Namespace])


# ---- numpy ---------------------------------------------------------------------------------------

def _numpy_lacks_compat_long() -> Optional[str]:
    import numpy as np

    if hasattr(getattr(np, "compat", None), "long"):
        return "numpy still has np.compat.long (NumPy < 2): nothing to restore"
    return None


@patch("numpy_compat_long", "numpy.compat.long",
       "fairseq's TokenBlockDataset and bucketed translation data use np.compat.long, removed in "
       "NumPy 2; restore just that alias (int64)", _numpy_lacks_compat_long)
def _numpy_compat_long():
    import numpy as np

    if not hasattr(np, "compat"):
        np.compat = types.SimpleNamespace(long=np.int64)
    else:  # pragma: no cover
        np.compat.long = np.int64


# ---- fairseq optimizers --------------------------------------------------------------------------

def _amp_optimizer():
    from fairseq.optim.amp_optimizer import AMPOptimizer

    return AMPOptimizer.step


@patch("fairseq_amp_single_unscale", "fairseq.optim.amp_optimizer:AMPOptimizer.step",
       "fairseq unscales --amp gradients twice (clip_grad_norm unscales the torch optimizer, step "
       "hands the scaler its wrapper): every update divided by the loss scale once more. This "
       "changes --amp training of every arch, stock ones included, while the plugin is loaded",
       known_source(_amp_optimizer, "2b8a6f80fa6ca14b"))
def _amp_single_unscale():
    from fairseq.optim.amp_optimizer import AMPOptimizer

    from .optim.mixed_precision import amp_step

    AMPOptimizer.step = amp_step


def _fp16_sync():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    return _FP16OptimizerMixin._sync_fp32_params_to_fp16


def _fp16_grad_sync():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    return _FP16OptimizerMixin._sync_fp16_grads_to_fp32


def _both_syncs_known() -> Optional[str]:
    import torch

    if not hasattr(torch, "_foreach_copy_"):
        return "torch has no _foreach_copy_ (torch < 2.1)"
    return (known_source(_fp16_grad_sync, "9a06568699ab4d06")()
            or known_source(_fp16_sync, "a53fdba609963e2d")())


# (before fairseq_fp16_master_projection, which wraps the copy installed here)
@patch("fairseq_fp16_flat_sync",
       "fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp16_grads_to_fp32 and "
       "_sync_fp32_params_to_fp16",
       "with flat fp32 masters fairseq copies every gradient into the buffer and every master "
       "back in Python loops (five ops per parameter and direction); one multi-tensor copy per "
       "device does the same copies",
       _both_syncs_known)
def _fp16_flat_sync():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin as mixin

    from .optim.mixed_precision import flat_grads_sync, flat_params_sync

    mixin._sync_fp16_grads_to_fp32 = flat_grads_sync(mixin._sync_fp16_grads_to_fp32)
    mixin._sync_fp32_params_to_fp16 = flat_params_sync(mixin._sync_fp32_params_to_fp16)


@patch("fairseq_fp16_master_projection",
       "fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
       "under --fp16/--bf16 the optimizer steps fp32 master copies: bounded parameters are "
       "projected on the masters before fairseq copies them into the half model",
       known_source(_fp16_sync, "a53fdba609963e2d",  # fairseq's, or fairseq_fp16_flat_sync's
                    "a319261284577fb6"))
def _fp16_master_projection():
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    from .optim.mixed_precision import projecting_sync

    _FP16OptimizerMixin._sync_fp32_params_to_fp16 = projecting_sync(
        _FP16OptimizerMixin._sync_fp32_params_to_fp16)


def _fp16_build_optimizer():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    return FP16Optimizer.build_optimizer


@patch("fairseq_bf16_flat_masters", "fairseq.optim.fp16_optimizer:FP16Optimizer.build_optimizer",
       "under --bf16 fairseq keeps one fp32 master per parameter (for TPUs), so every update loops "
       "over the parameters in Python; off TPUs flatten them as --fp16 does (unless "
       "--fp16-no-flatten-grads or the optimizer takes no flat parameters)",
       known_source(_fp16_build_optimizer, "c7ff6d890b7d4239"))
def _bf16_flat_masters():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from .optim.mixed_precision import build_bf16_flat

    original = FP16Optimizer.build_optimizer.__func__

    def build_optimizer(cls, cfg, params, **kwargs):
        params = list(params)
        built = build_bf16_flat(cls, cfg, params, **kwargs)
        return built if built is not None else original(cls, cfg, params, **kwargs)

    build_optimizer.__doc__ = original.__doc__
    FP16Optimizer.build_optimizer = classmethod(build_optimizer)


# ---- fairseq --bf16 on GPUs and CPUs -------------------------------------------------------------

def _call_main():
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.call_main


def tpu_requested(argv) -> bool:
    """Whether the command line asked for TPUs itself (fairseq's ``--tpu``)."""
    return any(a == "--tpu" for a in argv)


def xla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


def bf16_without_tpu(cfg, argv) -> bool:
    """Turn off the ``--tpu`` that fairseq 0.12's ``--bf16`` implied, when the user did not ask for
    TPUs and torch_xla is not installed; returns whether it did. fairseq's own bf16 path is then
    what trains: the model in bfloat16, fp32 master weights in ``FP16Optimizer`` (no loss scaling),
    on the GPU (or the CPU with ``--cpu``), exactly as ``fairseq-hydra-train common.bf16=true``."""
    common = cfg.common
    if not (common.bf16 and common.tpu) or tpu_requested(argv) or xla_available():
        return False
    for section in cfg.values():  # common, distributed_training, task, optimizer copy the flag
        if hasattr(section, "get") and section.get("tpu", False) is True:
            section.tpu = False
    logger.info("--bf16 without --tpu: training in bfloat16 with fp32 master weights on "
                f"{'the CPU' if common.cpu else 'CUDA'} (fairseq's bf16 path; compat entry "
                "fairseq_bf16_without_tpu)")
    return True


@patch("fairseq_bf16_without_tpu", "fairseq.distributed.utils:call_main",
       "fairseq 0.12's --bf16 implies --tpu, so fairseq-train --bf16 dies without torch_xla; "
       "unless --tpu is given or torch_xla is installed, train with fairseq's own bf16 path "
       "(bfloat16 model, fp32 masters) on the GPU/CPU, as the hydra path already does",
       known_source(_call_main, "c2a32fa44fa277a6"))
def _bf16_without_tpu():
    import sys

    from fairseq.distributed import utils as distributed_utils

    call_main = distributed_utils.call_main

    def patched_call_main(cfg, main, **kwargs):
        bf16_without_tpu(cfg, sys.argv[1:])
        return call_main(cfg, main, **kwargs)

    patched_call_main.__doc__ = call_main.__doc__
    distributed_utils.call_main = patched_call_main


# ---- fairseq logging -----------------------------------------------------------------------------

@patch("fairseq_meters_slot_usage", "fairseq.logging.meters (module globals)",
       "fairseq rebuilds checkpointed meters by class name from fairseq.logging.meters' globals; "
       "PKM's SlotUsageMeter must be resolvable there for --restore-file", _always)
def _register_meter():
    from fairseq.logging import meters

    from .models.pkm import SlotUsageMeter

    setattr(meters, SlotUsageMeter.__name__, SlotUsageMeter)


# ---- fairseq command-line tools ------------------------------------------------------------------

@patch("fairseq_cli_hints", "sys.excepthook (fairseq-* console scripts only)",
       "errors a user can cause end in one line naming the problem and the fix, without the "
       "traceback (ATTNZOO_TRACEBACK=1 shows it); fairseq-hydra-train gets HYDRA_FULL_ERROR=1 so "
       "that its job's errors reach the hook",
       _always)
def _cli_hints():
    from . import cli_hints

    cli_hints.install()


def _debug_root_logger() -> Optional[str]:
    """None when fairseq's wav2vec2_classification module sets the root logger to DEBUG at import
    (``logging.basicConfig(level=logging.DEBUG)``, fairseq-fixed 0.12.3)."""
    try:
        from fairseq.models.wav2vec import wav2vec2_classification as module
    except ImportError as e:
        return f"target not found ({e})"
    if "logging.basicConfig(level=logging.DEBUG)" in inspect.getsource(module):
        return None
    return "fairseq.models.wav2vec.wav2vec2_classification no longer sets the root logger to DEBUG"


@patch("fairseq_root_log_level", "the root logger's level (fairseq-* console scripts only)",
       "importing fairseq's models runs logging.basicConfig(level=DEBUG) (wav2vec2_classification), "
       "and fairseq-generate / fairseq-eval-lm configure logging only after that import, so hydra's "
       "DEBUG lines reach stderr: in a console script a root logger left at DEBUG goes back to "
       "$LOGLEVEL (INFO), the level the command asks for",
       _debug_root_logger)
def _root_log_level():
    from . import cli_hints

    root = logging.getLogger()
    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    if cli_hints.in_console_script() and root.level == logging.DEBUG and wanted != "DEBUG":
        root.setLevel(wanted)


# ---- fairseq data --------------------------------------------------------------------------------

def _batch_by_size():
    from fairseq.data import data_utils

    return data_utils.batch_by_size


def keep_tail(batch_by_size):
    """``batch_by_size`` that keeps its last batch. fairseq 0.12 drops it when its size is not a
    multiple of ``required_batch_size_multiple`` (upstream issue #5036): 20 test sentences gave 16
    scored, newstest2014's 3,003 at most 3,000. The batches are consecutive slices of ``indices``
    (the Cython helpers fill them in order), so what is missing is the tail: it becomes one more,
    smaller batch, within the same --max-tokens/--batch-size limits."""

    def batch_by_size_keeping_tail(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None,
                                   max_sentences=None, required_batch_size_multiple=1,
                                   fixed_shapes=None):
        import numpy as np

        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = batch_by_size(indices, num_tokens_fn, num_tokens_vec=num_tokens_vec,
                                max_tokens=max_tokens, max_sentences=max_sentences,
                                required_batch_size_multiple=required_batch_size_multiple,
                                fixed_shapes=fixed_shapes)
        kept = sum(len(b) for b in batches)
        if fixed_shapes is None and kept < len(indices):
            batches = list(batches) + [indices[kept:]]
            logger.info(f"compat fairseq_batch_keep_tail: the last {len(indices) - kept:,} of "
                        f"{len(indices):,} examples form one more batch (fairseq 0.12 drops a "
                        f"last batch that is not a multiple of --required-batch-size-multiple "
                        f"{required_batch_size_multiple})")
        return batches

    batch_by_size_keeping_tail.__doc__ = batch_by_size.__doc__
    return batch_by_size_keeping_tail


@patch("fairseq_batch_keep_tail", "fairseq.data.data_utils:batch_by_size",
       "fairseq 0.12 drops the last batch when its size is not a multiple of "
       "--required-batch-size-multiple (default 8): fairseq-generate and validation silently "
       "skipped up to 7 sentences, training the same examples every epoch. Keep it as a smaller "
       "batch (--skip-remainder-batch still drops a training epoch's last batch when asked)",
       known_source(_batch_by_size, "10c0b48b47357f22"))
def _batch_keep_tail():
    from fairseq.data import data_utils

    data_utils.batch_by_size = keep_tail(data_utils.batch_by_size)


def _trainer_train_step():
    from fairseq.trainer import Trainer

    return Trainer.train_step


def _is_padding_batch(sample) -> bool:
    """The test ``Trainer._prepare_sample`` applies: an empty slot from the sharded iterator, for
    which a rank runs its dummy batch with the loss multiplied by 0."""
    return sample is None or len(sample) == 0


def _zeroed(logging_output: dict) -> dict:
    """A logging output that adds nothing when fairseq sums it (numbers and tensors times 0)."""
    import torch

    return {k: v * 0 if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)
            else v for k, v in logging_output.items()}


def padding_batches_first(train_step):
    """``Trainer.train_step`` for an update whose micro-batches on this rank mix real batches and
    padding (dummy) ones. fairseq 0.12 zeroes the rank's whole ``sample_size`` and drops all its
    logging outputs when the *last* micro-batch is a dummy, but keeps the real batches' gradients:
    with --update-freq > 1 under DDP the last update of an epoch is normalised by the wrong token
    count and logs the wrong loss. Here each dummy micro-batch counts for nothing (sample size and
    logging outputs times 0, its loss already is) and runs first, so the real ones are counted."""

    def train_step_counting_real_batches(self, samples, raise_oom=False):
        padding = [s for s in samples if _is_padding_batch(s)]
        if not padding or len(padding) == len(samples):
            return train_step(self, samples, raise_oom)
        task = self.task
        inner = task.train_step

        def task_train_step(*args, **kwargs):
            loss, sample_size, logging_output = inner(*args, **kwargs)
            if kwargs.get("ignore_grad"):
                return loss, sample_size * 0, _zeroed(logging_output)
            return loss, sample_size, logging_output

        task.train_step = task_train_step
        logger.info(f"compat fairseq_ddp_partial_update: {len(padding)} padding micro-batch(es) of "
                    f"this update count for nothing; its {len(samples) - len(padding)} real ones "
                    "keep their sample size and logs")
        try:
            return train_step(self, padding + [s for s in samples if not _is_padding_batch(s)],
                              raise_oom)
        finally:
            del task.train_step

    train_step_counting_real_batches.__doc__ = train_step.__doc__
    return train_step_counting_real_batches


@patch("fairseq_ddp_partial_update", "fairseq.trainer:Trainer.train_step",
       "under DDP with --update-freq > 1, a rank whose last update of an epoch ends in a padding "
       "(dummy) batch dropped its real batches from the sample size and the logs but kept their "
       "gradients: that update was normalised by the wrong token count. Count the real batches",
       known_source(_trainer_train_step, "8cbf0406b1fe5093"))
def _ddp_partial_update():
    from fairseq.trainer import Trainer

    Trainer.train_step = padding_batches_first(Trainer.train_step)


def _lm_eval_dataloader():
    from fairseq.tasks.language_modeling import LanguageModelingTask

    return LanguageModelingTask.eval_lm_dataloader


def _position_limit(max_positions) -> Optional[float]:
    """The length above which fairseq's ``filter_indices_by_size`` skips a block of a monolingual
    dataset: an int or float (``inf``: unbounded) as is; a tuple or list skips a block longer
    than any of its entries (``_filter_by_size_dynamic``), so its smallest; None: no limit."""
    if isinstance(max_positions, (tuple, list)):
        bounds = [float(p) for p in max_positions if p is not None]
        return min(bounds) if bounds else None
    return None if max_positions is None else float(max_positions)


def _blocks(n: int) -> str:
    return f"{n:,} block{'' if n == 1 else 's'}"


def check_block_length(sizes, tokens_per_sample: int, max_positions, break_mode: str = "none",
                       context_window: int = 0) -> Optional[str]:
    """What fairseq-eval-lm will skip. fairseq drops, with a warning of sample ids, every block
    longer than the model's positions (``ignore_invalid_inputs=True``). When that is every block
    it reports "Evaluated 0 tokens ... Perplexity: 1.00" and exits 0 (e.g. a Synthesizer LM with
    --synth-max-len below eval-lm's default --tokens-per-sample 1024): refuse in one line. When
    some blocks fit, fairseq's behaviour stands and this returns one warning line with the counts
    and the flag that evaluates every token; also when ``--context-window`` makes blocks it
    evaluates longer than the positions (fairseq does not count the context when it filters; a
    model with learned or bounded positions then fails, sinusoidal ones read on). None when
    neither happens."""
    import numpy as np

    from .errors import ZooConfigError

    limit = _position_limit(max_positions)
    if limit is None or sizes is None or not np.isfinite(limit):
        return None
    sizes = np.asarray(sizes)
    cw = int(context_window or 0)
    long = sizes > limit
    over = ~long & (sizes + cw > limit)  # evaluated, but longer than the positions with context
    n_long, n_over = int(long.sum()), int(over.sum())
    if n_long == 0 and n_over == 0:
        return None
    fit = int(limit)
    given = f"--tokens-per-sample {tokens_per_sample}"
    if break_mode not in (None, "none"):
        given += f" --sample-break-mode {break_mode}"
    if cw:
        given += f" --context-window {cw}"
    fix = "" if break_mode in (None, "none") else "--sample-break-mode none "
    fix += (f"--tokens-per-sample {fit - cw} --context-window {cw}" if cw and fit > cw
            else f"--tokens-per-sample {fit}" + (" and a --context-window below it" if cw else ""))
    if n_long == len(sizes):
        raise ZooConfigError(
            f"fairseq-eval-lm would evaluate nothing: every block of {given} ({_blocks(n_long)}, "
            f"{int(sizes.sum()):,} tokens) is longer than the {fit} positions this model accepts: "
            f"pass {fix}")
    what = []
    if n_long:
        what.append(f"skips {n_long:,} of {_blocks(len(sizes))} ({int(sizes[long].sum()):,} of "
                    f"{int(sizes.sum()):,} tokens): with {given} they are longer than the {fit} "
                    "positions this model accepts")
    if n_over:
        what.append(f"{'' if n_long else f'with {given} '}gives the model {_blocks(n_over)} of "
                    f"up to {int(sizes[over].max()) + cw} tokens with their context, beyond the "
                    f"{fit} positions it accepts")
    return f"fairseq-eval-lm {', and '.join(what)}; pass {fix} to evaluate every token"


@patch("fairseq_eval_lm_block_length",
       "fairseq.tasks.language_modeling:LanguageModelingTask.eval_lm_dataloader",
       "fairseq-eval-lm skips every block longer than the model accepts: when that is every "
       "block it reports 0 tokens, perplexity 1.00, exit 0 (e.g. a Synthesizer LM without "
       "--tokens-per-sample): refuse that case in one line; when some blocks fit, evaluate them "
       "as fairseq does, plus one warning line with the counts and the flag that fixes it",
       known_source(_lm_eval_dataloader, "6ae1cc56dea42151"))
def _eval_lm_block_length():
    from fairseq.tasks.language_modeling import LanguageModelingTask

    original = LanguageModelingTask.eval_lm_dataloader

    def eval_lm_dataloader(self, dataset, max_tokens=36000, batch_size=None, max_positions=None,
                           num_shards=1, shard_id=0, num_workers=1, data_buffer_size=10,
                           context_window=0):
        warning = check_block_length(getattr(dataset, "sizes", None), self.args.tokens_per_sample,
                                     max_positions, self.args.sample_break_mode, context_window)
        if warning:
            logger.warning(f"{warning} (compat entry fairseq_eval_lm_block_length)")
        return original(self, dataset, max_tokens=max_tokens, batch_size=batch_size,
                        max_positions=max_positions, num_shards=num_shards, shard_id=shard_id,
                        num_workers=num_workers, data_buffer_size=data_buffer_size,
                        context_window=context_window)

    eval_lm_dataloader.__doc__ = original.__doc__
    LanguageModelingTask.eval_lm_dataloader = eval_lm_dataloader


def _add_model_args():
    from fairseq import options

    return options.add_model_args


@patch("fairseq_train_parser_one_line",
       "fairseq.options:add_model_args (the training parser's --arch type)",
       "a misspelled --arch printed argparse's ~200 choices (over 10 KB) and no suggestion: name "
       "the closest arch names instead (the one-line error itself: fairseq_parser_one_line)",
       known_source(_add_model_args, "1c18c8c34cb60493"))
def _train_parser_one_line():
    from fairseq import options

    from .cli_hints import arch_type

    add_model_args = options.add_model_args

    def add_model_args_checked(parser):
        group = add_model_args(parser)
        for action in group._group_actions:
            if "--arch" in action.option_strings:
                action.type = arch_type
        return group

    add_model_args_checked.__doc__ = add_model_args.__doc__
    options.add_model_args = add_model_args_checked


def _add_dataset_args():
    from fairseq import options

    return options.add_dataset_args


@patch("fairseq_parser_one_line", "fairseq.options:add_dataset_args (every command's parser)",
       "a bad flag value of fairseq-train, -generate, -interactive, -validate or -eval-lm printed "
       "the whole usage (thousands of flags in fairseq-train) before argparse's message: answer "
       "in one line (fairseq-* console scripts only; a parser built in a program keeps "
       "argparse's behaviour)",
       known_source(_add_dataset_args, "d28d7bdb8e29e2c3"))
def _parser_one_line():
    from fairseq import options

    from .cli_hints import one_line_parser_errors

    add_dataset_args = options.add_dataset_args

    def add_dataset_args_one_line(parser, *args, **kwargs):
        one_line_parser_errors(parser)
        return add_dataset_args(parser, *args, **kwargs)

    add_dataset_args_one_line.__doc__ = add_dataset_args.__doc__
    options.add_dataset_args = add_dataset_args_one_line


# ---- fairseq: models built from a checkpoint (newcomer entries, self-contained) ------------------

_FROM_CHECKPOINT: List[bool] = []


def building_from_checkpoint() -> bool:
    """Whether the model being built is a stored checkpoint's (``load_model_ensemble_and_task``,
    fairseq-generate, -eval-lm, our commands): its config is not the user's command line, so
    checks of the flags a user gave (:func:`fairseq_attnzoo.models.registry.check_flag_owners`)
    do not apply. False when the entry ``fairseq_model_from_checkpoint`` is not applied."""
    return bool(_FROM_CHECKPOINT and _FROM_CHECKPOINT[-1])


def _models_build_model():
    from fairseq import models

    return models.build_model


@patch("fairseq_model_from_checkpoint", "fairseq.models:build_model",
       "fairseq knows whether it builds a model from a checkpoint (from_checkpoint) but does not "
       "hand it to the arch function: note it, so that a stored config is never refused as if the "
       "user had typed it (e.g. flags of a sublayer the model does not use)",
       known_source(_models_build_model, "616b10d14de9810d"))
def _model_from_checkpoint():
    from fairseq import models

    build_model = models.build_model

    def build_model_noting_origin(cfg, task, from_checkpoint=False):
        _FROM_CHECKPOINT.append(bool(from_checkpoint))
        try:
            return build_model(cfg, task, from_checkpoint)
        finally:
            _FROM_CHECKPOINT.pop()

    build_model_noting_origin.__doc__ = build_model.__doc__
    models.build_model = build_model_noting_origin


# ---- hydra's deprecation warnings in fairseq's config loading -------------------------------------

#: what hydra 1.1-1.3 warns about fairseq 0.12's use of its API and config files (UserWarning)
HYDRA_DEPRECATIONS = (
    r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
    r"\s*The version_base parameter is not specified",
    r"In '[^']*': Usage of deprecated keyword in package header",
    r"\s*'[^']*' is validated against ConfigStore schema with the same name",
    r"\s*The strict flag in the compose API is deprecated",
)


def quiet_hydra_deprecations(fn, finds_caller: bool = False):
    """``fn`` (hydra's initialize or compose, as fairseq calls them) without hydra's deprecation
    warnings about fairseq's use of hydra: about 20 lines on stderr before every command's
    output, none of them actionable by a user. Only those messages, only while ``fn`` runs.
    ``finds_caller``: ``fn`` resolves a relative config path from its caller's file
    (``caller_stack_depth``): this wrapper's frame is skipped."""
    import functools
    import warnings

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        if finds_caller:
            kwargs["caller_stack_depth"] = kwargs.get("caller_stack_depth", 1) + 1
        with warnings.catch_warnings():
            for message in HYDRA_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            return fn(*args, **kwargs)

    return quiet


def _hydra_in_fairseq() -> Optional[str]:
    try:
        import hydra.experimental as experimental
        from fairseq.dataclass import utils
    except ImportError as e:
        return f"target not found ({e})"
    if utils.initialize is experimental.initialize and utils.compose is experimental.compose:
        return None
    return ("fairseq.dataclass.utils does not call hydra.experimental's initialize/compose (another "
            "fairseq version)")


@patch("hydra_deprecation_warnings", "fairseq.dataclass.utils:initialize, compose (hydra's)",
       "fairseq 0.12 loads every config through hydra.experimental's initialize/compose, and "
       "hydra 1.3 answers with about 20 lines of deprecation warnings on every command: silence "
       "exactly those messages, only inside these two calls (fairseq-hydra-train's own @hydra.main "
       "runs before the plugin is loaded and keeps its warnings)",
       _hydra_in_fairseq)
def _quiet_hydra_deprecations():
    from fairseq.dataclass import utils

    utils.initialize = quiet_hydra_deprecations(utils.initialize, finds_caller=True)
    utils.compose = quiet_hydra_deprecations(utils.compose)


# ---- fairseq: examples skipped for their length ----------------------------------------------------

#: the last split fairseq filtered by size: {"split", "total", "skipped", "max_positions"}
LAST_FILTER: Dict[str, object] = {}


def _split_name(task, dataset) -> str:
    datasets = getattr(task, "datasets", {}) or {}
    return next((name for name, d in datasets.items() if d is dataset), "")


def caller_max_tokens() -> Optional[int]:
    """``--max-tokens`` (``dataset.max_tokens``) when the size filter runs for fairseq's
    ``Trainer.get_train_iterator``, which folds it into the filter's bound
    (``resolve_max_positions``; validation and the commands do not), else None."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "get_train_iterator":
            dataset = getattr(getattr(frame.f_locals.get("self"), "cfg", None), "dataset", None)
            tokens = getattr(dataset, "max_tokens", None)
            return tokens if isinstance(tokens, int) else None
        frame = frame.f_back
    return None


def skipped_line(skipped: int, total: int, split: str, max_positions,
                 max_tokens: Optional[int] = None) -> str:
    """The one line for examples fairseq skipped: how many, and the flag that keeps them (the
    bound is ``--max-tokens`` when that is the smallest of the limits fairseq folded together)."""
    from .models.sublayers import length_flags, position_numbers

    where = f"'{split}' examples" if split else "examples"
    count = (f"all {total:,} {where} are skipped" if skipped == total else
             f"{skipped:,} of {total:,} {where} ({skipped / max(total, 1):.1%}) are skipped")
    if max_tokens is not None and min(position_numbers(max_positions), default=None) == max_tokens:
        return (f"{count}: longer than --max-tokens {max_tokens}, the most tokens a batch "
                f"holds; raise --max-tokens (or lower --tokens-per-sample for a language "
                f"model) to keep them")
    return (f"{count}: longer than the {max_positions} positions the model accepts; raise "
            f"{length_flags(max_positions)} to keep them")


def _filter_indices_by_size():
    from fairseq.tasks.fairseq_task import FairseqTask

    return FairseqTask.filter_indices_by_size


@patch("fairseq_skipped_examples", "fairseq.tasks.fairseq_task:FairseqTask.filter_indices_by_size",
       "fairseq skips examples longer than the model accepts (always in training, with "
       "--skip-invalid-size-inputs-valid-test in validation and generation) with a warning that "
       "names no flag; a length-bounded arch (--synth-max-len) can drop a third of the data. Say "
       "how many, of which split, and which flag keeps them, and remember it for the score line",
       known_source(_filter_indices_by_size, "064d9e381d9a3db6"))
def _skipped_examples():
    from fairseq.tasks.fairseq_task import FairseqTask

    original = FairseqTask.filter_indices_by_size

    def filter_indices_by_size(self, indices, dataset, max_positions=None,
                               ignore_invalid_inputs=False):
        total = len(indices)
        kept = original(self, indices, dataset, max_positions, ignore_invalid_inputs)
        skipped = total - len(kept)
        split = _split_name(self, dataset)
        LAST_FILTER.clear()
        LAST_FILTER.update(split=split, total=total, skipped=skipped, max_positions=max_positions)
        if skipped:
            line = skipped_line(skipped, total, split, max_positions, caller_max_tokens())
            if not len(kept):  # nothing left: fairseq would fail later (an IndexError)
                from .errors import ZooConfigError

                raise ZooConfigError(line)
            logger.warning(line)
        return kept

    filter_indices_by_size.__doc__ = original.__doc__
    FairseqTask.filter_indices_by_size = filter_indices_by_size


def subset_note() -> str:
    """`` (scored N of M sentences: ...)`` when the split generated last lost examples to the size
    filter, else ""."""
    from .models.sublayers import length_flags

    if not LAST_FILTER.get("skipped"):
        return ""
    total, skipped = int(LAST_FILTER["total"]), int(LAST_FILTER["skipped"])
    return (f" [a subset: scored {total - skipped:,} of {total:,} sentences, {skipped:,} longer "
            f"than the model accepts were skipped; raise "
            f"{length_flags(LAST_FILTER['max_positions'])}]")


def _build_scorer():
    from fairseq import scoring

    return scoring.build_scorer


@patch("fairseq_subset_score", "fairseq.scoring:build_scorer",
       "fairseq-generate prints BLEU over the sentences it kept, and says nothing when "
       "--skip-invalid-size-inputs-valid-test left some out: the score line says it is a subset",
       known_source(_build_scorer, "bfcb5472301b0cfd"))
def _subset_score():
    from fairseq import scoring

    build_scorer = scoring.build_scorer

    def build_scorer_noting_subset(choice, tgt_dict):
        scorer = build_scorer(choice, tgt_dict)
        result_string = scorer.result_string

        def result_string_noting_subset(*args, **kwargs):
            return result_string(*args, **kwargs) + subset_note()

        scorer.result_string = result_string_noting_subset
        return scorer

    build_scorer_noting_subset.__doc__ = build_scorer.__doc__
    scoring.build_scorer = build_scorer_noting_subset


# ---- fairseq-generate: --remove-bpe of another segmentation than the data's ----------------------

#: the --remove-bpe values whose marker can be told from a dictionary: (marker, segmentation)
REMOVE_BPE_MARKERS = {"sentencepiece": ("▁", "SentencePiece"), "@@ ": ("@@", "subword-nmt"),
                      "@@": ("@@", "subword-nmt"), "subword_nmt": ("@@", "subword-nmt")}


def segmentation_counts(dictionary) -> Dict[str, int]:
    """How many symbols of ``dictionary`` (past the special ones) are SentencePiece pieces (start
    with ``▁``) and how many subword-nmt pieces (end with ``@@``)."""
    symbols = dictionary.symbols[getattr(dictionary, "nspecial", 0):]
    return {"▁": sum(s.startswith("▁") for s in symbols),
            "@@": sum(s.endswith("@@") for s in symbols)}


def remove_bpe_mismatch(dictionary, remove_bpe) -> Optional[str]:
    """The one line refusing ``--remove-bpe remove_bpe`` for data whose target dictionary shows
    the other segmentation (its marker never occurs, the other one does), else None."""
    if remove_bpe not in REMOVE_BPE_MARKERS:
        return None
    marker, name = REMOVE_BPE_MARKERS[remove_bpe]
    counts = segmentation_counts(dictionary)
    other = "@@" if marker == "▁" else "▁"
    if counts[marker] or not counts[other]:
        return None
    value = "sentencepiece" if other == "▁" else "subword_nmt"
    plain = remove_bpe in ("@@ ", "subword_nmt")  # what --remove-bpe alone means
    flag = "--remove-bpe" if plain else f"--remove-bpe {remove_bpe}"
    return (f"{flag} removes {name}'s '{marker}' markers, but the target dictionary holds "
            f"{counts[other]:,} pieces marked '{other}' and none marked '{marker}': the score "
            f"would be over pieces, not words; pass --remove-bpe {value}")


def _post_process_prediction():
    from fairseq import utils

    return utils.post_process_prediction


@patch("fairseq_remove_bpe_check", "fairseq.utils:post_process_prediction",
       "fairseq-generate/-interactive apply --remove-bpe's rule whatever the data's segmentation: "
       "subword-nmt's '@@ ' rule on SentencePiece data leaves the pieces in and BLEU scores them, "
       "silently and higher. Refuse, in one line naming the right value, when the target "
       "dictionary shows the other segmentation (checked once per dictionary and value)",
       known_source(_post_process_prediction, "005b84430b598a22"))
def _remove_bpe_check():
    from fairseq import utils

    original = utils.post_process_prediction

    def post_process_prediction(hypo_tokens, src_str, alignment, align_dict, tgt_dict,
                                remove_bpe=None, extra_symbols_to_ignore=None):
        # (the values checked against a dictionary live on it: it is read once, not per sentence)
        checked = vars(tgt_dict).setdefault("_attnzoo_remove_bpe_checked", set())
        if remove_bpe not in checked:
            line = remove_bpe_mismatch(tgt_dict, remove_bpe)
            if line:
                from .errors import ZooConfigError

                raise ZooConfigError(line)
            checked.add(remove_bpe)
        return original(hypo_tokens, src_str, alignment, align_dict, tgt_dict, remove_bpe,
                        extra_symbols_to_ignore)

    post_process_prediction.__doc__ = original.__doc__
    utils.post_process_prediction = post_process_prediction

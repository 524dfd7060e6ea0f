"""Where a ``fairseq-train`` run stands (rows ``fairseq_train_summary`` and
``fairseq_train_progress_in_log``): at its end, a short summary (the best validation result and
its update, the best checkpoint, the command that scores it with this run's flags); and while it
runs with its log going to a file or a pipe, fairseq's ``simple`` progress lines every
``--log-interval`` updates in that log. Everything else fairseq prints is unchanged;
``ATTNZOO_COMPAT_DISABLE=fairseq_train_summary,fairseq_train_progress_in_log`` gives fairseq's
own output."""

import contextvars
import logging
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from ..checkpoints import LM_TASKS, load_stored, stored_update, stored_validation
from ..messages.command import program
from .data import segmentation_counts

logger = logging.getLogger("fairseq_attnzoo.summary")


@dataclass
class _Run:
    """What the summary of the run in progress needs: its validations (update, epoch, value of
    --best-checkpoint-metric) and its task (the target dictionary tells the segmentation)."""

    validations: List[tuple] = field(default_factory=list)
    task: object = None


#: the run in progress in this thread / task (:func:`summarizing` opens it), None outside one
_RUN: "contextvars.ContextVar[Optional[_Run]]" = contextvars.ContextVar("attnzoo_run",
                                                                         default=None)


# ---- what the summary says -----------------------------------------------------------------------

def _segmentation_flag(task) -> List[str]:
    """``--remove-bpe`` for the target dictionary's pieces (SentencePiece ``▁`` or subword-nmt
    ``@@``), or nothing for whole words."""
    dictionary = getattr(task, "target_dictionary", None)
    if dictionary is None:
        return []
    counts = segmentation_counts(dictionary)
    pieces, marked = counts["▁"], counts["@@"]
    if pieces > marked:
        return ["--remove-bpe", "sentencepiece"]
    return ["--remove-bpe"] if marked else []


def score_command(cfg, path: str, task=None) -> str:
    """The ``fairseq-generate`` (translation) or ``fairseq-eval-lm`` (language model) command
    that scores checkpoint ``path`` with this run's data, task and device flags."""
    name = cfg.task._name
    argv = [str(cfg.task.data)]
    if cfg.common.user_dir:
        argv += ["--user-dir", str(cfg.common.user_dir)]
    argv += ["--path", path, "--task", name]
    if name in LM_TASKS:
        argv = ["fairseq-eval-lm"] + argv + ["--tokens-per-sample",
                                            str(cfg.task.tokens_per_sample)]
        if name == "attnzoo_stream_lm":  # one stream per batch row, as in training
            batch = cfg.dataset.batch_size_valid or cfg.dataset.batch_size
            argv += ["--batch-size", str(batch)] if batch else []
    else:
        argv = ["fairseq-generate"] + argv
        for flag, value in (("--source-lang", getattr(cfg.task, "source_lang", None)),
                            ("--target-lang", getattr(cfg.task, "target_lang", None))):
            argv += [flag, str(value)] if value else []
        argv += _segmentation_flag(task)
    argv += [flag for flag, on in (("--cpu", cfg.common.cpu), ("--bf16", cfg.common.bf16),
                                   ("--fp16", cfg.common.fp16)) if on]
    return " ".join(shlex.quote(a) for a in argv)


def _best_of(cfg, validations) -> Optional[tuple]:
    """(update, epoch, value) of the best of this process's validations, or None."""
    found = [v for v in validations if v[2] is not None and not math.isnan(v[2])]
    if not found:
        return None
    pick = max if cfg.checkpoint.maximize_best_checkpoint_metric else min
    return pick(found, key=lambda v: v[2])


def summary_lines(cfg, validations, task=None) -> List[str]:
    """The run's summary: its best validation result and update, its best checkpoint (or its last,
    when there is no best) and the command that scores it. ``validations``: this process's
    (update, epoch, value); where training ran in other processes (fairseq's spawn) the best
    checkpoint tells."""
    ckpt = cfg.checkpoint
    metric = ckpt.best_checkpoint_metric
    suffix = ckpt.checkpoint_suffix or ""
    best = _best_of(cfg, validations)
    path = state = None
    for name in (f"checkpoint_best{suffix}.pt", f"checkpoint_last{suffix}.pt"):
        candidate = os.path.join(ckpt.save_dir, name)
        if not ckpt.no_save and os.path.exists(candidate):
            path, state = candidate, load_stored(candidate)
            break
    if best is None and path is not None and "_best" in path:
        best = stored_validation(state)
    if best is not None:
        update, epoch, value = best
        head = f"run summary: best valid {metric} {value:.4g} at update {update} (epoch {epoch})"
    else:
        head = "run summary: no validation result (--disable-validation, or none due yet)"
    if ckpt.no_save:
        return [f"{head}; nothing was saved (--no-save): no checkpoint to score"]
    if path is None:
        return [f"{head}; no checkpoint in {ckpt.save_dir}"]
    saved = stored_update(state)
    at = f" (update {saved})" if saved is not None else ""
    kind = "best" if "_best" in path else "last"
    return [f"{head}; {kind} checkpoint {path}{at}",
            f"score it: {score_command(cfg, path, task)}"]


# ---- the wrappers --------------------------------------------------------------------------------

def recording_validation(validate):
    """``fairseq_cli.train.validate`` that keeps each result (with its update and epoch) for the
    summary."""

    def validate_recorded(cfg, trainer, task, epoch_itr, subsets):
        valid_losses = validate(cfg, trainer, task, epoch_itr, subsets)
        run = _RUN.get()
        if run is not None:  # (fairseq_cli.train.main called without call_main: no summary)
            run.task = task
            run.validations.append((trainer.get_num_updates(), epoch_itr.epoch,
                                    valid_losses[0] if valid_losses else None))
        return valid_losses

    return validate_recorded


def summarizing(call_main):
    """``fairseq.distributed.utils.call_main`` that ends a finished training (fairseq-train's
    ``main``) with :func:`summary_lines`, printed once: by the process that started the run (rank
    0, or the parent of fairseq's spawned processes). ``call_main`` is wrapped rather than
    ``main``, which fairseq pickles into the processes it spawns. (fairseq-hydra-train loads the
    plugin inside ``main``, after its ``call_main`` started: no summary there.)"""

    def call_main_summarized(cfg, main, **kwargs):
        run = _Run()
        token = _RUN.set(run)
        try:
            out = call_main(cfg, main, **kwargs)
        finally:
            _RUN.reset(token)
        training = getattr(main, "__module__", "") == "fairseq_cli.train"
        if training and cfg.distributed_training.distributed_rank in (0, None):
            for line in summary_lines(cfg, run.validations, run.task):
                logger.info(line)
        return out

    return call_main_summarized


def logs_to_a_terminal() -> bool:
    """Whether fairseq's log lines (stdout, where its commands send them) reach a terminal."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def progress_in_log(progress_bar):
    """``fairseq.logging.progress_bar.progress_bar`` that, in fairseq-train, uses fairseq's
    ``simple`` format (a line every --log-interval updates, in the log) where fairseq would draw
    its tqdm bar but the log does not go to a terminal: fairseq asks only whether stderr (tqdm's
    stream) is one, so ``fairseq-train ... > train.log`` or ``| tee train.log`` left the log
    without a line between epochs. An explicit --log-format is kept."""

    def progress_bar_in_log(iterator, log_format: Optional[str] = None, *args, **kwargs):
        default = kwargs.get("default_log_format", "tqdm")
        if log_format is None and default == "tqdm" and program() == "fairseq-train" \
                and not logs_to_a_terminal():
            log_format = "simple"
        return progress_bar(iterator, log_format, *args, **kwargs)

    return progress_bar_in_log

"""The wrappers of the table's rows (:mod:`.fixes`) that fix how fairseq loads and batches its
data and checkpoints, and what it says about examples it leaves out: NumPy's and torch's loading,
the last batch, padding batches under DDP, eval-lm's blocks, examples skipped for their length (and
the score over the rest), ``--remove-bpe`` of the other segmentation, interactive text without the
``--bpe`` of SentencePiece data, its blank and too long lines, sacrebleu's score of text fairseq tokenized itself. Nothing here is applied on
import; the rows install them."""

import argparse
import contextvars
import inspect
import logging
import types
from typing import Callable, Dict, Optional

from ..messages.lengths import length_flags, position_numbers
from ..messages.errors import ZooConfigError
from .machinery import NOTHING_CHANGED

logger = logging.getLogger("fairseq_attnzoo.compat")  # the name its log lines have always had


# ---- loading: torch's weights-only allow-list and NumPy's alias ---------------------------------

def torch_has_safe_globals() -> Optional[str]:
    import torch

    ok = hasattr(getattr(torch, "serialization", None), "add_safe_globals")
    return None if ok else "torch has no serialization.add_safe_globals (torch < 2.4: not needed)"


def allow_namespace():
    """Allow-list ``argparse.Namespace`` for torch's weights-only loader; returns the undo, or
    NOTHING_CHANGED when it is allow-listed already."""
    import torch

    before = torch.serialization.get_safe_globals()
    if argparse.Namespace in before:
        return NOTHING_CHANGED
    torch.serialization.add_safe_globals([argparse.Namespace])

    def undo():
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)

    return undo


def numpy_lacks_compat_long() -> Optional[str]:
    import numpy as np

    if hasattr(getattr(np, "compat", None), "long"):
        return "numpy still has np.compat.long (NumPy < 2): nothing to restore"
    return None


def numpy_compat_long() -> Callable[[], None]:
    """Restore NumPy 1's ``np.compat.long`` alias (int64); returns the undo."""
    import numpy as np

    if not hasattr(np, "compat"):
        np.compat = types.SimpleNamespace(long=np.int64)
        return lambda: delattr(np, "compat")
    np.compat.long = np.int64  # pragma: no cover
    return lambda: delattr(np.compat, "long")  # pragma: no cover


# ---- batches -------------------------------------------------------------------------------------

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

    return batch_by_size_keeping_tail


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

    return train_step_counting_real_batches


# ---- fairseq-eval-lm's blocks --------------------------------------------------------------------

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


def checking_block_length(original):
    """``LanguageModelingTask.eval_lm_dataloader`` that says, or refuses, what it will skip
    (:func:`check_block_length`)."""

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

    return eval_lm_dataloader


# ---- examples skipped for their length, and the score over the rest ------------------------------

#: the last split fairseq filtered by size in this thread / task: {"split", "total", "skipped",
#: "max_positions"}
_LAST_FILTER: "contextvars.ContextVar[Dict[str, object]]" = contextvars.ContextVar(
    "attnzoo_last_filter", default={})


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
    where = f"'{split}' examples" if split else "examples"
    count = (f"all {total:,} {where} are skipped" if skipped == total else
             f"{skipped:,} of {total:,} {where} ({skipped / max(total, 1):.1%}) are skipped")
    if max_tokens is not None and min(position_numbers(max_positions), default=None) == max_tokens:
        return (f"{count}: longer than --max-tokens {max_tokens}, the most tokens a batch "
                f"holds; raise --max-tokens (or lower --tokens-per-sample for a language "
                f"model) to keep them")
    return (f"{count}: longer than the {max_positions} positions the model accepts; raise "
            f"{length_flags(max_positions)} to keep them")


def reporting_skipped(original):
    """``FairseqTask.filter_indices_by_size`` that says how many examples it skipped and which
    flag keeps them (:func:`skipped_line`), refuses when none is left, and notes the split for
    the score line (:data:`_LAST_FILTER`)."""

    def filter_indices_by_size(self, indices, dataset, max_positions=None,
                               ignore_invalid_inputs=False):
        total = len(indices)
        kept = original(self, indices, dataset, max_positions, ignore_invalid_inputs)
        skipped = total - len(kept)
        split = _split_name(self, dataset)
        _LAST_FILTER.set(dict(split=split, total=total, skipped=skipped,
                              max_positions=max_positions))
        if skipped:
            line = skipped_line(skipped, total, split, max_positions, caller_max_tokens())
            if not len(kept):  # nothing left: fairseq would fail later (an IndexError)
                raise ZooConfigError(line)
            logger.warning(line)
        return kept

    return filter_indices_by_size


def subset_note() -> str:
    """`` (scored N of M sentences: ...)`` when the split generated last lost examples to the size
    filter, else ""."""
    last = _LAST_FILTER.get()
    if not last.get("skipped"):
        return ""
    total, skipped = int(last["total"]), int(last["skipped"])
    return (f" [a subset: scored {total - skipped:,} of {total:,} sentences, {skipped:,} longer "
            f"than the model accepts were skipped; raise "
            f"{length_flags(last['max_positions'])}]")


def noting_subset(build_scorer):
    """``fairseq.scoring.build_scorer`` whose scorer's result line ends with :func:`subset_note`."""

    def build_scorer_noting_subset(choice, tgt_dict):
        scorer = build_scorer(choice, tgt_dict)
        result_string = scorer.result_string

        def result_string_noting_subset(*args, **kwargs):
            return result_string(*args, **kwargs) + subset_note()

        scorer.result_string = result_string_noting_subset
        return scorer

    return build_scorer_noting_subset


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


def checking_remove_bpe(original):
    """``fairseq.utils.post_process_prediction`` that refuses a ``--remove-bpe`` of the other
    segmentation (:func:`remove_bpe_mismatch`), once per dictionary and value."""

    def post_process_prediction(hypo_tokens, src_str, alignment, align_dict, tgt_dict,
                                remove_bpe=None, extra_symbols_to_ignore=None):
        # (the values checked against a dictionary live on it: it is read once, not per sentence)
        checked = vars(tgt_dict).setdefault("_attnzoo_remove_bpe_checked", set())
        if remove_bpe not in checked:
            line = remove_bpe_mismatch(tgt_dict, remove_bpe)
            if line:
                raise ZooConfigError(line)
            checked.add(remove_bpe)
        return original(hypo_tokens, src_str, alignment, align_dict, tgt_dict, remove_bpe,
                        extra_symbols_to_ignore)

    return post_process_prediction


# ---- fairseq-interactive: SentencePiece data without --bpe -------------------------------------

def sentencepiece_without_bpe(dictionary, bpe, lines) -> Optional[str]:
    """The one line refusing to look typed text up in a dictionary of SentencePiece pieces (most
    symbols start with ``▁``) when no ``--bpe`` encodes it first: every word would be one
    ``<unk>`` (text already written in pieces, with ``▁``, passes). None otherwise."""
    if bpe or any("▁" in line for line in lines):
        return None
    pieces = segmentation_counts(dictionary)["▁"]
    symbols = len(dictionary) - getattr(dictionary, "nspecial", 0)
    if not pieces or pieces * 4 < symbols:
        return None
    return (f"the dictionary holds SentencePiece pieces ({pieces:,} of {symbols:,} symbols start "
            "with '▁') and no --bpe is given: every word of the text would be looked up whole "
            "(mostly <unk>); pass --bpe sentencepiece --sentencepiece-model SPM.model (the "
            "model the data was made with: OUT/spm.model of scripts.data.prepare_text)")


def bpe_name(cfg_bpe) -> Optional[str]:
    """The --bpe of a command's config (None, or a config whose ``_name`` is None: no bpe)."""
    return getattr(cfg_bpe, "_name", None) if cfg_bpe is not None else None


def checking_bpe(make_batches):
    """``fairseq_cli.interactive.make_batches`` that refuses SentencePiece data without --bpe
    (:func:`sentencepiece_without_bpe`)."""

    def make_batches_checking_bpe(lines, cfg, task, max_positions, encode_fn):
        line = sentencepiece_without_bpe(task.source_dictionary, bpe_name(cfg.bpe), lines)
        if line:
            raise ZooConfigError(line)
        yield from make_batches(lines, cfg, task, max_positions, encode_fn)

    return make_batches_checking_bpe


# ---- fairseq-interactive: blank lines, and lines longer than the model accepts --------------------

#: the number (from 0) of the first line of the buffer fairseq-interactive translates now
_INTERACTIVE_START: "contextvars.ContextVar[int]" = contextvars.ContextVar(
    "attnzoo_interactive_start", default=0)


def _blank(line: str) -> bool:
    return not line.strip()


def _blank_apart(buffer):
    """``buffer`` as runs of non-blank lines, each blank line a run of its own, in order."""
    run = []
    for line in buffer:
        if _blank(line):
            if run:
                yield run
            yield [line]
            run = []
        else:
            run.append(line)
    if run:
        yield run


def print_empty_hypothesis(i: int):
    """fairseq-interactive's lines for input line ``i`` when it is blank: an empty source and an
    empty hypothesis (score 0: nothing was translated), so that ``grep ^H-`` keeps one line per
    input line."""
    for line in (f"S-{i}\t", f"W-{i}\t0.000\tseconds", f"H-{i}\t0.0\t", f"D-{i}\t0.0\t",
                 f"P-{i}\t"):
        print(line)


def blank_lines_apart(buffered_read):
    """``fairseq_cli.interactive.buffered_read`` that hands a blank line over as a buffer of its
    own, which :func:`interactive_lines` does not translate, and prints its empty hypothesis once
    fairseq has printed the lines before it (fairseq translated an empty line into whatever the
    model says after nothing: "day", "Image")."""

    def buffered_read_blank_apart(input, buffer_size):
        start = 0
        for buffer in buffered_read(input, buffer_size):
            for part in _blank_apart(buffer):
                _INTERACTIVE_START.set(start)
                yield part
                if _blank(part[0]):  # (resumed after fairseq printed the lines before it)
                    print_empty_hypothesis(start)
                start += len(part)

    return buffered_read_blank_apart


def too_long_line(number: int, line: str, length: int, max_positions) -> str:
    bound = max_positions[0] if isinstance(max_positions, tuple) else max_positions
    bound = min(position_numbers(bound), default=bound)
    text = line if len(line) <= 40 else line[:37] + "..."
    return (f"fairseq-interactive: line {number} ({length:,} tokens: {text!r}) is longer than "
            f"the {bound:,} positions the model accepts: skipped (split it into shorter lines, "
            f"or raise {length_flags(max_positions)} and retrain)")


def interactive_lines(make_batches):
    """``fairseq_cli.interactive.make_batches`` that translates neither blank lines (their empty
    hypothesis: :func:`blank_lines_apart`) nor lines longer than the model accepts: one warning
    line each, and the session goes on (fairseq ended it, with a message written for scoring a
    split). The batches keep the ids of the lines as given."""
    import numpy as np
    import torch

    def make_batches_fitting(lines, cfg, task, max_positions, encode_fn):
        keep = [i for i, line in enumerate(lines) if not _blank(line)]
        if keep and max_positions is not None:
            constraints = getattr(cfg.generation, "constraints", None)
            text = [lines[i].split("\t")[0] if constraints else lines[i] for i in keep]
            tokens, lengths = task.get_interactive_tokens_and_lengths(text, encode_fn)
            dataset = task.build_dataset_for_inference(tokens, lengths)
            fits, too_long = dataset.filter_indices_by_size(np.arange(len(keep)), max_positions)
            start = _INTERACTIVE_START.get()
            for j in too_long:
                logger.warning(too_long_line(start + keep[j] + 1, text[j], int(lengths[j]),
                                             max_positions))
            keep = [keep[j] for j in sorted(int(j) for j in fits)]
        if not keep:
            return
        ids = torch.tensor(keep)
        for batch in make_batches([lines[i] for i in keep], cfg, task, max_positions, encode_fn):
            yield batch._replace(ids=ids[batch.ids])

    return make_batches_fitting


# ---- sacrebleu: fairseq's own tokenization is not a forgotten detokenization ---------------------

def forcing_tokenized(score):
    """``SacrebleuScorer._score`` whose ``corpus_bleu`` gets ``force=True``: fairseq tokenizes
    both sides itself (``--sacrebleu-tokenizer``, 13a) and hands sacrebleu ``tokenize="none"``,
    so sacrebleu's "forgot to detokenize" guess (100 lines ending in ' .') is always wrong."""

    def _score(self, order=4):
        real = self.sacrebleu
        self.sacrebleu = types.SimpleNamespace(
            corpus_bleu=lambda *a, **kw: real.corpus_bleu(*a, **dict(kw, force=True)))
        try:
            return score(self, order)
        finally:
            self.sacrebleu = real

    return _score

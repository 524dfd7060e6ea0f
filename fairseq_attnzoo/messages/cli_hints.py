"""One line for every error a user can cause, in the fairseq command-line tools.

Installed (compat entry ``fairseq_cli_hints``) only when the running program is a fairseq console
script (``fairseq-train``, ``fairseq-hydra-train``, ``fairseq-generate``, ..., or ``python -m
fairseq_cli.<name>``) and our plugin was loaded (``--user-dir``). For an uncaught exception the
hook prints

- our own errors (:class:`~.errors.ZooConfigError`, or a ``ValueError`` raised by a ``raise``
  statement in this package): ``fairseq-attnzoo: <message>``, nothing else;
- a fairseq/torch error we recognise (:func:`hint_for`, which asks the named rules of
  :data:`RULES` in order): ``fairseq-attnzoo: <hint>`` naming the flag and the fix, without
  fairseq's traceback;
- anything else: the usual traceback, unchanged.

``ATTNZOO_TRACEBACK=1`` prints the traceback in every case (the one line still follows it).

Also here, for the compat entries that change what fairseq's commands print: the one-line parser
errors (``fairseq_parser_one_line``, ``fairseq_train_parser_one_line``), the unraisable error of a
half-built dataset (``fairseq_mmap_dataset_del``), the root logger's level
(``fairseq_root_log_level``), and the flags that bound an example's length (named by
``fairseq_skipped_examples``, ``fairseq_subset_score`` and the hook; noted per thread by the model
built last, :func:`note_length_limit`).
"""

import argparse
import contextvars
import difflib
import inspect
import linecache
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .errors import ZooConfigError

ENV_TRACEBACK = "ATTNZOO_TRACEBACK"
PREFIX = "fairseq-attnzoo: "
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def program() -> str:
    """The fairseq console script running (``fairseq-train``, ...; ``python -m fairseq_cli.train``
    counts as ``fairseq-train``), else the program's file name."""
    path = sys.argv[0] if sys.argv else ""
    name = os.path.basename(path)
    if os.path.basename(os.path.dirname(path)) == "fairseq_cli" and name.endswith(".py"):
        return "fairseq-" + name[:-3].replace("_", "-")
    return name


def in_console_script() -> bool:
    return program().startswith("fairseq-")


def traceback_wanted() -> bool:
    return os.environ.get(ENV_TRACEBACK, "").strip().lower() not in ("", "0", "false", "no")


def _in_package(filename: str) -> bool:
    path = os.path.abspath(filename or "")
    return path.startswith(PACKAGE_DIR + os.sep)


def _raising_frame(tb):
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def is_user_error(exc: BaseException) -> bool:
    """Our one-line validation errors: a ZooConfigError anywhere, or a ValueError raised by a
    ``raise`` statement of this package (so validation code written before ZooConfigError needs no
    edit; a ValueError from a library call inside our code is not one of them)."""
    if isinstance(exc, ZooConfigError):
        return True
    if not isinstance(exc, ValueError) or type(exc).__module__ != "builtins":
        return False
    tb = _raising_frame(exc.__traceback__)
    if tb is None:
        return False
    filename = tb.tb_frame.f_code.co_filename
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return _in_package(filename) and line.startswith("raise ")


def _frames(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def _frame_local(exc: BaseException, function: str, name: str):
    """The local ``name`` of the innermost frame of ``exc``'s traceback running ``function``."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == function and name in frame.f_locals:
            found = frame.f_locals[name]
        tb = tb.tb_next
    return found


def _argv_value(*flags: str):
    """The value of the last of ``flags`` on the command line (``--flag V`` or ``--flag=V``)."""
    argv, value = sys.argv[1:], None
    for i, a in enumerate(argv):
        for flag in flags:
            if a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(flag + "="):
                value = a[len(flag) + 1:]
    return value


_EMBED_MISMATCH = re.compile(
    r"size mismatch for (\S*embed_tokens\.weight): copying a param with shape "
    r"torch\.Size\(\[(\d+), \d+\]\) from checkpoint, the shape in current model is "
    r"torch\.Size\(\[(\d+), \d+\]\)")


_TOO_LONG = re.compile(r"Size of sample #(\d+) is invalid \(=(.*)\) since max_positions=(.*), "
                      r"skip this example with --skip-invalid-size-inputs-valid-test")


def dictionary_mismatch(text: str):
    """(symbols in the checkpoint's dictionary, symbols in the data's) from torch's
    ``load_state_dict`` message when the embedding tables differ in rows, else None."""
    m = _EMBED_MISMATCH.search(text)
    if m is None or m.group(2) == m.group(3):  # same rows: another embedding width, not dictionary
        return None
    return int(m.group(2)), int(m.group(3))


def cfg_get(cfg, key):
    return cfg.get(key, None) if hasattr(cfg, "get") else getattr(cfg, key, None)


def model_flag_differences(stored, current, defaults: Optional[Dict[str, tuple]] = None):
    """``--flag X (checkpoint) vs Y (this run)`` for each model flag of the arch's model class
    whose value differs between the checkpoint's model config ``stored`` and this run's
    ``current`` (argparse namespaces or dict configs), in the parser's order. ``defaults``:
    ``{dest: (default, ...)}`` of options an older checkpoint may lack (read as the default)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    model_cls = ARCH_MODEL_REGISTRY.get(cfg_get(current, "arch") or cfg_get(current, "_name"))
    if model_cls is None or stored is None:
        return []
    parser = argparse.ArgumentParser(add_help=False)
    try:
        model_cls.add_args(parser)
    except Exception:  # an unusual model: nothing to compare
        return []
    out = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        before, now = cfg_get(stored, action.dest), cfg_get(current, action.dest)
        if before is None and action.dest in (defaults or {}):
            before = defaults[action.dest][0]
        if before != now:
            out.append(f"{action.option_strings[0]} {before} (checkpoint) vs {now} (this run)")
    return out


def dictionary_mismatch_line(rows, data, checkpoint: str = "the checkpoint") -> str:
    stored, here = rows
    return (f"{checkpoint} was trained with a dictionary of {stored:,} symbols but {data}'s has "
            f"{here:,}: pass the data directory the checkpoint was trained on (its "
            "dict*.txt)")


def load_stored(path: str):
    """The fairseq checkpoint at ``path`` (its tensors memory-mapped, not read), or None when it
    does not load (missing, truncated, not a checkpoint)."""
    try:
        import torch

        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as e:  # not a zip file: no mmap (a truncated zip file stays refused)
            if "failed reading zip archive" in str(e):
                return None
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # unreadable: say nothing about it
        return None


def stored_section(state, section: str):
    """The ``model`` or ``task`` config of a loaded checkpoint (``cfg``, or the ``args`` of an
    older one), or None."""
    if not isinstance(state, dict):
        return None
    cfg = state.get("cfg") or {}
    part = cfg.get(section) if hasattr(cfg, "get") else None
    return part if part is not None else state.get("args")


def stored_arch(path: str):
    """The ``--arch`` a fairseq checkpoint was trained with, or None."""
    model = stored_section(load_stored(path), "model")
    if model is None:
        return None
    return cfg_get(model, "arch") or cfg_get(model, "_name")


def stored_update(state) -> Optional[int]:
    """The update a loaded checkpoint was saved after, or None."""
    try:
        return int(state["optimizer_history"][-1]["num_updates"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


SPLIT_FIX = {
    "train": "binarise a non-empty --trainpref file",
    "valid": "binarise a non-empty --validpref file, or train without validation "
             "(--disable-validation)",
    "test": "binarise a non-empty --testpref file, or score another split (--gen-subset valid)",
}


NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver",
           "No CUDA GPUs are available")


@dataclass
class HintContext:
    """What a rule knows besides the exception: the data directory (the command line's first
    positional argument unless given), whether this is ``fairseq-hydra-train`` (its flags are
    ``key=value`` overrides) and whether a GPU is usable (None: ask torch when a rule needs it)."""

    data: Optional[str]
    hydra: bool
    cuda: Optional[bool] = None


def hint_lm_arch_under_translation(exc, text, ctx) -> Optional[str]:
    """One of our language-model archs run under the default translation task."""
    if "Could not infer language pair" in text or (
            isinstance(exc, FileNotFoundError) and re.fullmatch(
                r"dict\.[^.]+\.txt", os.path.basename(str(exc.filename or "")))):
        arch = _argv_value("--arch", "-a")
        wanted = _zoo_task(arch)
        if wanted and wanted != "translation" and (_argv_value("--task") or "translation") != wanted:
            return (f"--arch {arch} is a language model and this run's task is translation: add "
                    f"--task {wanted}")
    return None


def hint_missing_data(exc, text, ctx) -> Optional[str]:
    """No data directory, no dictionary in it, or translation data given to a language model."""
    if not isinstance(exc, FileNotFoundError):
        return None
    missing, data = exc.filename or "", ctx.data
    if data and os.path.abspath(str(missing)) == os.path.abspath(data):
        return (f"data directory {data} does not exist: pass the directory written by "
                "fairseq-preprocess (for the demo corpus run `make data`)")
    if os.path.basename(str(missing)).startswith("dict."):
        where = data or os.path.dirname(str(missing))
        folder = os.path.dirname(str(missing)) or "."
        pair = sorted(f for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                      if re.fullmatch(r"dict\.[^.]+\.txt", f))
        if os.path.basename(str(missing)) == "dict.txt" and pair:
            return (f"{where} is translation data ({', '.join(pair)}), not language-model data "
                    "(dict.txt): binarise the text with fairseq-preprocess --only-source for a "
                    "language model, or train a translation arch (--task translation)")
        return (f"{missing} is missing: {where} is not a binarised fairseq data directory; run "
                "fairseq-preprocess on your text first (for the demo corpus run `make data`)")
    return None


def hint_no_cuda(exc, text, ctx) -> Optional[str]:
    """A run that needs a GPU (``--fp16``'s master weights, or no ``--cpu``) on a machine
    without one."""
    if not any(m in text for m in NO_CUDA):
        return None
    if any(f.endswith(os.path.join("optim", "fp16_optimizer.py")) for f in _frames(exc)):
        if ctx.hydra:
            return ("common.fp16=true (set by the shipped configs) trains only on a CUDA GPU "
                    "and this machine has none: on a CPU add common.fp16=false common.cpu=true")
        return ("--fp16 trains only on a CUDA GPU (fairseq keeps its fp32 master weights "
                "there) and this machine has none: on a CPU drop --fp16 and pass --cpu")
    if ctx.hydra:
        return "this run needs a CUDA GPU and this machine has none: add common.cpu=true"
    return "this command needs a CUDA GPU and this machine has none: pass --cpu"


def hint_bf16_without_xla(exc, text, ctx) -> Optional[str]:
    """fairseq's ``--bf16`` turned on ``--tpu`` and there is no torch_xla: reached only when the
    compat entry fairseq_bf16_without_tpu did not apply (disabled, --tpu given or another fairseq
    version)."""
    if "xla_device" not in text:
        return None
    cuda = _cuda_available() if ctx.cuda is None else ctx.cuda
    fix = ("fairseq 0.12's --bf16 implies --tpu (torch_xla), and the plugin's fix did not "
           "apply (compat entry fairseq_bf16_without_tpu: disabled, --tpu given or another "
           "fairseq version): ")
    if cuda:
        return fix + ("re-enable it, or use --amp (fp16 autocast, fp32 weights) or --fp16 "
                      "(docs/precision.md)")
    return fix + ("re-enable it and pass --cpu, or drop --bf16 and pass --cpu (fp32) "
                  "(docs/precision.md)")


def hint_master_weights_layout(exc, text, ctx) -> Optional[str]:
    """torch's ``Optimizer.load_state_dict``: the checkpoint's fp32 masters are laid out
    otherwise."""
    if "doesn't match the size of optimizer's group" not in text:
        return None
    return ("the checkpoint's optimizer state holds another layout of the fp32 master weights "
            "(one flat buffer, or one per parameter: --fp16-no-flatten-grads, and --bf16 "
            "checkpoints written before the compat entry fairseq_bf16_flat_masters): resume "
            "with the flags it was trained with (for such a bf16 checkpoint add "
            "--fp16-no-flatten-grads), or pass --reset-optimizer")


def hint_optimizer_or_criterion_changed(exc, text, ctx) -> Optional[str]:
    """Resuming with another --optimizer or --criterion than the checkpoint's."""
    mismatch = re.match(r"(Optimizer|Criterion) does not match; .* (\S+) vs (\S+)$", text)
    if not (isinstance(exc, AssertionError) and mismatch):
        return None
    kind, stored, now = mismatch.groups()
    flag = "--" + kind.lower()
    stored, now = (_registry_name(kind, n) for n in (stored, now))
    return (f"the checkpoint was trained with {flag} {stored}, this run has {flag} {now}: "
            f"resume with {flag} {stored}, or pass --reset-optimizer to start {now}'s state "
            "afresh (the model's weights are still loaded)")


def hint_missing_finetune_checkpoint(exc, text, ctx) -> Optional[str]:
    if not (text.startswith("--finetune-from-model ") and text.endswith(" does not exist")):
        return None
    path = text[len("--finetune-from-model "):-len(" does not exist")]
    return (f"--finetune-from-model {path} does not exist: pass the path of the checkpoint to "
            "fine-tune (for a conversion, the OUT file attnzoo-collab-reparametrize wrote)")


def hint_empty_split(exc, text, ctx) -> Optional[str]:
    """fairseq-preprocess was given an empty file: its ``.bin`` cannot be memory-mapped."""
    if not (isinstance(exc, ValueError) and "cannot mmap an empty file" in text):
        return None
    path = _frame_local(exc, "_do_init", "path")
    if not path:
        return None
    split = os.path.basename(str(path)).split(".")[0]
    fix = SPLIT_FIX.get(split, "binarise a non-empty text file for it, or leave the split out")
    return (f"{path}.bin is empty: the '{split}' split has no examples "
            f"(fairseq-preprocess was given an empty file): {fix}")


def hint_checkpoint_of_another_model(exc, text, ctx) -> Optional[str]:
    """A checkpoint whose parameters do not fit this run's model: another --arch, another
    dictionary, other model flags (named when the configs say which), or other sizes."""
    if "please ensure that the architectures match" not in text:
        return None
    path = text.split("Cannot load model parameters from checkpoint ", 1)[-1].split(";")[0]
    trained, now = stored_arch(path), _argv_value("--arch", "-a")
    if trained and now and trained != now:
        return (f"{path} was trained with --arch {trained}, this run has --arch {now}: resume "
                f"with --arch {trained} (and the flags it was trained with), or start a new "
                "run in another --save-dir")
    rows = dictionary_mismatch(str(exc.__context__ or ""))
    if rows:
        return dictionary_mismatch_line(rows, ctx.data, path)
    state, trainer = (_frame_local(exc, "load_checkpoint", n) for n in ("state", "self"))
    try:
        differ = model_flag_differences(cfg_get(cfg_get(state, "cfg"), "model"),
                                        trainer.cfg.model)
    except Exception:  # no readable configs: the general line below
        differ = []
    if differ:
        return (f"{path} holds parameters of other shapes than this run's flags build; its "
                f"model flags differ: {', '.join(differ)}: resume with the checkpoint's "
                "values, or start a new run in another --save-dir")
    return (f"{path} holds a model of other sizes or sublayers than this run's flags build: "
            "resume with the flags it was trained with, or start a new run in another "
            "--save-dir")


def hint_example_too_long(exc, text, ctx) -> Optional[str]:
    """An evaluated example longer than the model accepts (no --skip-invalid-size-inputs-...)."""
    m = _TOO_LONG.search(text)
    if not m:
        return None
    size = re.sub(r"np\.\w+\((\d+)\)", r"\1", m.group(2))
    bound = re.sub(r"np\.\w+\((\d+)\)", r"\1", m.group(3))
    flags = length_flags([int(n) for n in re.findall(r"\d+", bound)])
    return (f"example #{m.group(1)} of the evaluated split is longer ({size}) than the "
            f"{bound} positions the model accepts: raise {flags} (and retrain), or pass "
            "--skip-invalid-size-inputs-valid-test to leave such examples out (the score "
            "then covers a subset, and says so)")


def hint_no_batch_size(exc, text, ctx) -> Optional[str]:
    if "Must specify batch size either with --max-tokens or --batch-size" not in text:
        return None
    if ctx.hydra:
        return "no batch size: set dataset.max_tokens=N or dataset.batch_size=N"
    return "no batch size: pass --max-tokens N (tokens per batch) or --batch-size N (sentences)"


def hint_dictionary_of_another_size(exc, text, ctx) -> Optional[str]:
    """A checkpoint (``--path``) trained with a dictionary of another size than the data's."""
    rows = dictionary_mismatch(text)
    if not rows:
        return None
    return dictionary_mismatch_line(rows, ctx.data, _argv_value("--path") or "the checkpoint")


def _dictionaries(folder: Optional[str]) -> List[str]:
    """The fairseq dictionaries (``dict*.txt``) in ``folder``."""
    if not folder or not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if re.fullmatch(r"dict(\.[^.]+)?\.txt", f))


def _no_dictionary(exc, text) -> bool:
    """fairseq found no dictionary where it looked: no language pair, or a missing dict*.txt."""
    return "Could not infer language pair" in text or (
        isinstance(exc, FileNotFoundError)
        and os.path.basename(str(exc.filename or "")).startswith("dict."))


def hint_binarised_data_below(exc, text, ctx) -> Optional[str]:
    """The folder ``scripts.data.prepare_text`` (or a ``fairseq-preprocess --destdir OUT/bin``)
    wrote, given instead of its ``bin`` folder."""
    if not _no_dictionary(exc, text) or _dictionaries(ctx.data):
        return None
    below = os.path.join(ctx.data or "", "bin")
    if not _dictionaries(below):
        return None
    return (f"{ctx.data} holds no binarised data; {below} does (the folder prepare_text or "
            f"fairseq-preprocess --destdir wrote): pass {below}")


def hint_no_language_pair(exc, text, ctx) -> Optional[str]:
    if "Could not infer language pair" not in text:
        return None
    if "dict.txt" in _dictionaries(ctx.data):  # binarised with --only-source
        what = f"{ctx.data} is language-model data (dict.txt, binarised with --only-source)"
        if program() in ("fairseq-generate", "fairseq-interactive"):
            path = _argv_value("--path") or "CHECKPOINT"
            return (f"{what}, and {program()} translates: score a language model on it with "
                    f"fairseq-eval-lm {ctx.data} --path {path}, or continue text with "
                    "attnzoo-sample; to translate, pass translation data (dict.SRC.txt, "
                    "dict.TGT.txt)")
        return (f"{what}, and this run's task is translation: train a language model with "
                "--task language_modeling and an LM arch (README, 'Word language model'), or "
                "binarise parallel text for translation")
    return (f"{ctx.data} has no binarised language pair (dict.SRC.txt / train.SRC-TGT.*.bin): run "
            "fairseq-preprocess first, or pass --source-lang/--target-lang")


#: what gloo / NCCL say on a process whose peer process ended (crashed, or stopped at its error)
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _rank() -> Optional[int]:
    """This process's rank in a multi-process job (torchrun's RANK, or torch.distributed's), or
    None in a single-process run."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.get_rank()
    except Exception:  # pragma: no cover - a torch without distributed
        pass
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    return None


def hint_lost_peer(exc, text, ctx) -> Optional[str]:
    """In a multi-process job, a collective that failed because another process of the job
    ended: that process's own error is the one to read, so this one is a single line, not a
    traceback per surviving rank."""
    if not (isinstance(exc, RuntimeError) and any(m in text for m in LOST_PEER)):
        return None
    if not any(os.path.join("torch", "distributed") in f for f in _frames(exc)):
        return None
    rank = _rank()
    if rank is None:
        return None
    said = next(m for m in LOST_PEER if m in text)
    return (f"rank {rank} stopped: another process of this job ended ({said} in a "
            "collective); that process's own error, printed with its rank, is the one to read")


#: the tasks whose checkpoints are language models
LM_TASKS = ("language_modeling", "attnzoo_stream_lm")


def _loading_checkpoints(folder: str, but: str) -> List[str]:
    """``name (update N)`` of each checkpoint in ``folder`` other than ``but`` that loads, the
    latest update first."""
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if not name.endswith(".pt") or os.path.abspath(path) == os.path.abspath(but):
            continue
        state = load_stored(path)
        if state is not None:
            found.append((stored_update(state) or 0, name))
    found.sort(key=lambda x: -x[0])
    return [f"{name} (update {update})" for update, name in found]


def hint_truncated_checkpoint(exc, text, ctx) -> Optional[str]:
    """A checkpoint cut short (a crash or a full disk during its save): torch's zip reader fails.
    Names the file and the other checkpoints of its folder that load."""
    if "PytorchStreamReader failed reading zip archive" not in text:
        return None
    path = (_frame_local(exc, "load_checkpoint_to_cpu", "path")
            or _frame_local(exc, "load_checkpoint", "filename") or _argv_value("--path"))
    if not path:
        return None
    folder = os.path.dirname(str(path)) or "."
    good = _loading_checkpoints(folder, str(path))
    head = (f"{path} is not a whole checkpoint (torch cannot read its zip archive: its save was "
            "cut short, by a crash or a full disk)")
    if not good:
        return f"{head}, and no other checkpoint in {folder} loads: train it again"
    first = os.path.join(folder, good[0].split()[0])
    fix = (f"resume with --restore-file {first}" if program() == "fairseq-train"
           else f"pass --path {first}")
    return f"{head}; these in {folder} load: {', '.join(good[:4])}: {fix}"


def hint_not_a_language_model(exc, text, ctx) -> Optional[str]:
    """fairseq-eval-lm with a translation checkpoint: the LM task asks the model for
    ``supported_targets``, which encoder-decoder models lack."""
    if not (isinstance(exc, AttributeError) and "supported_targets" in text):
        return None
    path = _argv_value("--path") or "the checkpoint"
    arch = stored_arch(path) if path != "the checkpoint" else None
    what = f"a translation model (--arch {arch})" if arch else "a translation model"
    return (f"{path} is {what}: fairseq-eval-lm scores language models; score a translation "
            f"model on its translation data with fairseq-generate DATA --path {path} (BLEU) or "
            "fairseq-validate (loss)")


#: the values of --remove-bpe / --post-process that fairseq's post_process knows
POST_PROCESS = ("sentencepiece", "wordpiece", "letter", "silence", "_EOW", "subword_nmt", "@@ ",
                "@@", "none")


def hint_post_process(exc, text, ctx) -> Optional[str]:
    """A --remove-bpe (--post-process) value fairseq does not know: a NotImplementedError at the
    first sentence decoded, after the model was loaded."""
    m = re.fullmatch(r"Unknown post_process option: (.*)", text, flags=re.S)
    if not (isinstance(exc, NotImplementedError) and m):
        return None
    value = m.group(1)
    flag = "--post-process" if _argv_value("--post-process") == value else "--remove-bpe"
    close = difflib.get_close_matches(value, POST_PROCESS, n=1, cutoff=0.6)
    known = ", ".join(repr(v) if " " in v else v for v in POST_PROCESS)
    fix = f"did you mean {flag} {close[0]}?" if close else f"pass one of {known}"
    return f"{flag} {value} is not a value fairseq knows ({known}): {fix}"


def hint_checkpoint_of_another_task(exc, text, ctx) -> Optional[str]:
    """A language model's checkpoint given to fairseq-generate (the translation task), or a
    translation checkpoint to a language-model task: fairseq builds it with this task's
    dictionaries, and torch reports embedding tables of other sizes."""
    if dictionary_mismatch(text) is None:
        return None
    path = _argv_value("--path")
    stored = stored_section(load_stored(path), "task") if path else None
    trained = cfg_get(stored, "_name") or cfg_get(stored, "task") if stored is not None else None
    now = _argv_value("--task") or "translation"
    if not trained or (trained in LM_TASKS) == (now in LM_TASKS):
        return None
    if trained in LM_TASKS:
        return (f"{path} is a language model (trained with --task {trained}) and this run's task "
                f"is {now}: {program()} translates with a translation checkpoint; score a "
                f"language model on its own data with fairseq-eval-lm DATA --path {path}, or "
                "continue text with attnzoo-sample")
    return (f"{path} is a translation model (trained with --task {trained}) and this run's task "
            f"is {now}: translate with fairseq-generate / fairseq-interactive (--task "
            f"{trained}), or pass a language model's checkpoint")


#: the rules :func:`hint_for` asks, in order: the first line one of them gives is the hint
RULES: List[Callable[[BaseException, str, HintContext], Optional[str]]] = [
    hint_lost_peer,
    hint_truncated_checkpoint,
    hint_not_a_language_model,
    hint_post_process,
    hint_binarised_data_below,
    hint_lm_arch_under_translation,
    hint_missing_data,
    hint_no_cuda,
    hint_bf16_without_xla,
    hint_master_weights_layout,
    hint_optimizer_or_criterion_changed,
    hint_missing_finetune_checkpoint,
    hint_empty_split,
    hint_checkpoint_of_another_model,
    hint_example_too_long,
    hint_no_batch_size,
    hint_checkpoint_of_another_task,
    hint_dictionary_of_another_size,
    hint_no_language_pair,
]


def hint_for(exc: BaseException, cuda=None, data=None) -> Optional[str]:
    """One line naming the problem and the fix for a fairseq/torch error a user causes with flags or
    data, or None: the first line a rule of :data:`RULES` gives. ``cuda``: whether a GPU is usable
    (default: ask torch); ``data``: the data directory (default: the command line's first
    positional argument)."""
    if data is None:
        data = next((a for a in sys.argv[1:] if not a.startswith("-") and "=" not in a), None)
    ctx = HintContext(data=data, hydra=program() == "fairseq-hydra-train", cuda=cuda)
    text = str(exc)
    for rule in RULES:
        line = rule(exc, text, ctx)
        if line is not None:
            return line
    return None


def _registry_name(kind: str, class_name: str) -> str:
    """The --optimizer / --criterion name registered for the class ``class_name`` (a checkpoint
    stores the class name), else the class name."""
    try:
        if kind == "Optimizer":
            from fairseq.optim import OPTIMIZER_REGISTRY as registry
        else:
            from fairseq.criterions import CRITERION_REGISTRY as registry
    except ImportError:  # pragma: no cover
        return class_name
    return next((n for n, c in registry.items() if c.__name__ == class_name), class_name)


# ---- --arch --------------------------------------------------------------------------------------

def arch_suggestions(name: str, n: int = 3):
    """The registered arch names closest to ``name`` (ours and fairseq's), closest first."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    names = list(ARCH_MODEL_REGISTRY)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    if not close:  # e.g. a prefix: "synth_dense" -> transformer_synth_dense
        close = sorted((a for a in names if name and name in a), key=len)[:n]
    return close


def arch_error(name: str) -> str:
    close = arch_suggestions(name)
    hint = f"did you mean {' or '.join(close)}?" if close else "see the arch table in the README"
    return f"unknown arch {name!r}: {hint}"


def arch_type(value: str) -> str:
    """argparse ``type`` of --arch (compat entry ``fairseq_train_parser_one_line``): a known name is
    returned unchanged; an unknown one is an error naming the closest names (argparse checks the
    type before its list of ~200 choices)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    if value in ARCH_MODEL_REGISTRY:
        return value
    raise argparse.ArgumentTypeError(arch_error(value))


def _zoo_task(arch):
    """The task our arch ``arch`` trains with (its model's ``zoo_task``), or None."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    return getattr(ARCH_MODEL_REGISTRY.get(arch), "zoo_task", None)


def task_hint(message: str, parser=None):
    """For argparse's "unrecognized arguments: ..." in a run of one of our archs under another
    task than the one it trains with: which task has those flags (an adaptive-span arch without
    --task attnzoo_stream_lm does not know --tokens-per-sample). None otherwise."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    arch = _argv_value("--arch", "-a")
    wanted = getattr(ARCH_MODEL_REGISTRY.get(arch), "zoo_task", None)
    task = _argv_value("--task") or (parser.get_default("task") if parser else None)
    if not wanted or task == wanted or task is None or wanted not in TASK_DATACLASS_REGISTRY:
        return None
    fields = TASK_DATACLASS_REGISTRY[wanted].__dataclass_fields__
    flags = [a for a in message[len(prefix):].split() if a.startswith("--")]
    known = [f for f in flags if f[2:].split("=")[0].replace("-", "_") in fields]
    if not known:
        return None
    return (f"{message}: --arch {arch} trains with --task {wanted}, which has "
            f"{', '.join(known)} (this run's task is {task}): add --task {wanted}")


def flag_hint(message: str, parser=None) -> Optional[str]:
    """For argparse's "unrecognized arguments: ...": the parser's flag closest to each unknown
    one (``--pkm-nkeys``: did you mean ``--pkm-n-keys``?), or None when none is close."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix) or parser is None:
        return None
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in message[len(prefix):].split():
        flag = word.split("=")[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8) if flag.startswith(
            "--") else []
        if close:
            hints.append((flag, close[0]))
    if not hints:
        return None
    if len(hints) == 1:
        return f"{message}: did you mean {hints[0][1]}?"
    return f"{message}: did you mean {', '.join(f'{c} for {f}' for f, c in hints)}?"


def one_line_parser_errors(parser: argparse.ArgumentParser):
    """In a console script, ``parser.error`` prints ``fairseq-attnzoo: <argparse's message>`` and
    exits 2, without the usage (thousands of flags in fairseq-train); ``--help`` still lists them."""
    if not in_console_script() or getattr(parser.error, "_attnzoo", False):
        return
    error = parser.error

    def one_line_error(message):
        if traceback_wanted():
            error(message)
        hint = task_hint(message, parser) or flag_hint(message, parser)
        if hint:
            message, more = hint, ""
        else:
            more = "" if "did you mean" in message else f" ({program()} --help lists the flags)"
        print(f"{PREFIX}{message}{more}", file=sys.stderr)
        raise SystemExit(2)

    one_line_error._attnzoo = True
    parser.error = one_line_error


# ---- the hook ------------------------------------------------------------------------------------

def interrupted_line(exc: BaseException) -> Optional[str]:
    """For Ctrl-C (``KeyboardInterrupt``) in fairseq-train: where the same command resumes (the
    last checkpoint in the save dir and its update), or that nothing was saved; None elsewhere."""
    if program() not in ("fairseq-train", "fairseq-hydra-train"):
        return None
    cfg = cfg_get(_frame_local(exc, "main", "cfg"), "checkpoint")
    save_dir = cfg_get(cfg, "save_dir") or _argv_value("--save-dir") or "checkpoints"
    restore = cfg_get(cfg, "restore_file") or _argv_value("--restore-file") or "checkpoint_last.pt"
    no_save = cfg_get(cfg, "no_save") if cfg is not None else "--no-save" in sys.argv
    last = os.path.join(save_dir, "checkpoint_last.pt")
    if no_save:
        return interrupted_without_saving(last if restore == "checkpoint_last.pt" else restore)
    state = load_stored(last) if os.path.exists(last) else None
    if state is None and os.path.exists(last):  # the interrupt cut its copy short
        good = _loading_checkpoints(save_dir, last)
        fix = (f"resume with --restore-file {os.path.join(save_dir, good[0].split()[0])} "
               f"({', '.join(good[:3])} load)" if good else "no checkpoint there loads")
        return f"interrupted while {last} was written, which does not load: {fix}"
    if state is None:
        start = (f"from --restore-file {restore}" if restore != "checkpoint_last.pt"
                 else "at update 0")
        return (f"interrupted before a checkpoint was saved in {save_dir}: the same command "
                f"starts again {start} (--save-interval-updates N saves every N updates)")
    held = f"{last} holds update {stored_update(state)}"
    if restore != "checkpoint_last.pt":  # fairseq loads --restore-file whenever it is given
        return (f"interrupted: {held}; the same command starts again from --restore-file "
                f"{restore}: drop --restore-file to resume from {last}")
    return f"interrupted: {held}; the same command resumes from it"


def interrupted_without_saving(loaded: str) -> str:
    """Ctrl-C in a --no-save run: fairseq still loads ``loaded`` (``SAVE_DIR/checkpoint_last.pt``,
    or ``--restore-file``) when it is there, and goes on from its update; nothing new was saved,
    so the same command starts from that update again."""
    state = load_stored(loaded) if os.path.exists(loaded) else None
    update = stored_update(state)
    if update is None:
        return ("interrupted: nothing was saved (--no-save); the same command starts again at "
                "update 0")
    return (f"interrupted: nothing new was saved (--no-save); this run had loaded update {update} "
            f"from {loaded} and went on from it, so the same command starts again from update "
            f"{update}")


def one_line(exc: BaseException):
    """The line this hook prints for ``exc`` (without the prefix), or None."""
    if isinstance(exc, KeyboardInterrupt):
        return interrupted_line(exc)
    if not isinstance(exc, Exception):
        return None
    if is_user_error(exc):
        return " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    return hint_for(exc)


def install():
    """In a console script, ``sys.excepthook`` prints :func:`one_line` for the errors it knows
    (compat entry ``fairseq_cli_hints``, with :func:`hydra_full_error`); returns the undo (None:
    nothing installed)."""
    if not in_console_script() or getattr(sys.excepthook, "_attnzoo", False):
        return None
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        line = one_line(exc)
        if line is None or traceback_wanted():
            previous(exc_type, exc, tb)
        if line is not None:
            print(PREFIX + line, file=sys.stderr)

    hook._attnzoo = True
    sys.excepthook = hook
    return lambda: setattr(sys, "excepthook", previous)


def hydra_full_error(value: Optional[str]) -> Optional[str]:
    """``HYDRA_FULL_ERROR`` beside :func:`install`'s hook (``value``: the variable's, None when
    unset): hydra prints errors raised inside fairseq-hydra-train's job itself and exits 1, so no
    excepthook ever sees them; with HYDRA_FULL_ERROR=1 it re-raises them to the hook (read when it
    happens). A value the user set stays."""
    return "1" if value is None and program() == "fairseq-hydra-train" else value


def ignore_half_built_mmap_dataset():
    """In a console script, ``sys.unraisablehook`` passes over the one error fairseq's
    MMapIndexedDataset raises again in ``__del__`` when its ``np.memmap`` failed (an empty split:
    "Exception ignored in ..." and a traceback after the hint's line); every other one is printed
    as before (compat entry ``fairseq_mmap_dataset_del``). Returns the undo (None: nothing)."""
    if not in_console_script():
        return None
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, AttributeError)
                and "_bin_buffer_mmap" in str(unraisable.exc_value)):
            previous(unraisable)

    sys.unraisablehook = hook
    return lambda: setattr(sys, "unraisablehook", previous)


# ---- the flags that bound an example's length ----------------------------------------------------

#: flags that bound the length the model built last in this thread / task accepts (flag ->
#: value), noted by its sublayers' builders (:func:`note_length_limit`, e.g. the synthesizer's
#: --synth-max-len): the flag to raise when fairseq skips longer examples
_LENGTH_LIMITS: "contextvars.ContextVar[Optional[Dict[str, int]]]" = contextvars.ContextVar(
    "attnzoo_length_limits", default=None)


def forget_length_limits():
    """A new model is being built: the limits noted so far were another model's."""
    _LENGTH_LIMITS.set({})


def note_length_limit(flag: str, value: int):
    """For a builder whose module accepts at most ``value`` positions because of ``flag``."""
    limits = _LENGTH_LIMITS.get()
    if limits is None:
        limits = {}
        _LENGTH_LIMITS.set(limits)
    limits[flag] = int(value)


def length_limits() -> Dict[str, int]:
    """The limits noted for the model built last in this thread / task."""
    return dict(_LENGTH_LIMITS.get() or {})


def position_numbers(x) -> List[float]:
    """The numbers in fairseq's ``max_positions`` (a number, or tuples / dicts of them)."""
    if isinstance(x, (tuple, list)):
        return [n for v in x for n in position_numbers(v)]
    if isinstance(x, dict):
        return [n for v in x.values() for n in position_numbers(v)]
    return [x] if isinstance(x, (int, float)) else []


def length_flags(max_positions) -> str:
    """The flag(s) that keep examples longer than ``max_positions`` (a number or fairseq's tuple
    of them): one of ours when it is the bound, else fairseq's position flags."""
    bound = min(position_numbers(max_positions), default=None)
    ours = [f"{flag} (now {value})" for flag, value in length_limits().items() if value == bound]
    if ours:
        return " and ".join(ours)
    return ("--max-source-positions/--max-target-positions (--tokens-per-sample for a language "
            "model)")


# ---- compat entries: fairseq's parsers and the root logger in console scripts -------------------

def arch_checked(add_model_args):
    """``fairseq.options.add_model_args`` whose --arch is checked by :func:`arch_type` (compat
    entry ``fairseq_train_parser_one_line``)."""

    def add_model_args_checked(parser):
        group = add_model_args(parser)
        for action in group._group_actions:
            if "--arch" in action.option_strings:
                action.type = arch_type
        return group

    return add_model_args_checked


def parsing_in_one_line(add_dataset_args):
    """``fairseq.options.add_dataset_args`` (every command's parser adds it) that makes the parser
    answer in one line (compat entry ``fairseq_parser_one_line``)."""

    def add_dataset_args_one_line(parser, *args, **kwargs):
        one_line_parser_errors(parser)
        return add_dataset_args(parser, *args, **kwargs)

    return add_dataset_args_one_line


def debug_root_logger() -> Optional[str]:
    """None when fairseq's wav2vec2_classification module sets the root logger to DEBUG at import
    (``logging.basicConfig(level=logging.DEBUG)``, fairseq-fixed 0.12.3)."""
    try:
        from fairseq.models.wav2vec import wav2vec2_classification as module
    except ImportError as e:
        return f"target not found ({e})"
    if "logging.basicConfig(level=logging.DEBUG)" in inspect.getsource(module):
        return None
    return "fairseq.models.wav2vec.wav2vec2_classification no longer sets the root logger to DEBUG"


def root_log_level():
    """In a console script, ours (``attnzoo-sample``) too, a root logger left at DEBUG goes back to
    ``$LOGLEVEL`` (INFO) (compat entry ``fairseq_root_log_level``); returns the undo (None:
    nothing changed)."""
    root = logging.getLogger()
    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    ours = in_console_script() or program().startswith("attnzoo-")
    if ours and root.level == logging.DEBUG and wanted != "DEBUG":
        root.setLevel(wanted)
        return lambda: root.setLevel(logging.DEBUG)
    return None

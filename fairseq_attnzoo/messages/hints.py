"""The hint rules: for a fairseq or torch error a user causes with flags or data, one line naming
the problem and the fix (the console hook prints it instead of the traceback, compat entry
``fairseq_cli_hints``). :func:`hint_for` asks the named rules of :data:`RULES` in order; each rule
answers for its own error alone, and None for any other. This module imports nothing else of ours
but this package and the checkpoint readers."""

import difflib
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

from ..checkpoints import (LM_TASKS, cfg_get, load_stored, loading_checkpoints,
                           model_flag_differences, stored_arch, stored_section)
from .command import argv_value, frame_local, frames, program
from .lengths import length_flags
from .parser_hints import zoo_task


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


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


def dictionary_mismatch_line(rows, data, checkpoint: str = "the checkpoint") -> str:
    stored, here = rows
    return (f"{checkpoint} was trained with a dictionary of {stored:,} symbols but {data}'s has "
            f"{here:,}: pass the data directory the checkpoint was trained on (its "
            "dict*.txt)")


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
        arch = argv_value("--arch", "-a")
        wanted = zoo_task(arch)
        if wanted and wanted != "translation" and (argv_value("--task") or "translation") != wanted:
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
        pair = [f for f in _dictionaries(folder) if f != "dict.txt"]
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
    if any(f.endswith(os.path.join("optim", "fp16_optimizer.py")) for f in frames(exc)):
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
    path = frame_local(exc, "_do_init", "path")
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
    trained, now = stored_arch(path), argv_value("--arch", "-a")
    if trained and now and trained != now:
        return (f"{path} was trained with --arch {trained}, this run has --arch {now}: resume "
                f"with --arch {trained} (and the flags it was trained with), or start a new "
                "run in another --save-dir")
    rows = dictionary_mismatch(str(exc.__context__ or ""))
    if rows:
        return dictionary_mismatch_line(rows, ctx.data, path)
    state, trainer = (frame_local(exc, "load_checkpoint", n) for n in ("state", "self"))
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
    return dictionary_mismatch_line(rows, ctx.data, argv_value("--path") or "the checkpoint")


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
            path = argv_value("--path") or "CHECKPOINT"
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
    if not any(os.path.join("torch", "distributed") in f for f in frames(exc)):
        return None
    rank = _rank()
    if rank is None:
        return None
    said = next(m for m in LOST_PEER if m in text)
    return (f"rank {rank} stopped: another process of this job ended ({said} in a "
            "collective); that process's own error, printed with its rank, is the one to read")


def hint_truncated_checkpoint(exc, text, ctx) -> Optional[str]:
    """A checkpoint cut short (a crash or a full disk during its save): torch's zip reader fails.
    Names the file and the other checkpoints of its folder that load."""
    if "PytorchStreamReader failed reading zip archive" not in text:
        return None
    path = (frame_local(exc, "load_checkpoint_to_cpu", "path")
            or frame_local(exc, "load_checkpoint", "filename") or argv_value("--path"))
    if not path:
        return None
    folder = os.path.dirname(str(path)) or "."
    good = loading_checkpoints(folder, str(path))
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
    path = argv_value("--path") or "the checkpoint"
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
    flag = "--post-process" if argv_value("--post-process") == value else "--remove-bpe"
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
    path = argv_value("--path")
    stored = stored_section(load_stored(path), "task") if path else None
    trained = cfg_get(stored, "_name") or cfg_get(stored, "task") if stored is not None else None
    now = argv_value("--task") or "translation"
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

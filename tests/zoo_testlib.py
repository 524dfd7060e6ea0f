"""Helpers for the generic sweep: arch discovery, tiny configs, tiny data, in-process fairseq CLIs.

Every arch registered on a model class with a ``zoo_task`` attribute is swept automatically. An
arch's own test hooks (size overrides, extra CLI flags its task needs, e.g. a criterion, eval-lm
flags, tolerances) come from the arch registry (``register_arch``/``register_base_arch`` with
``tiny=``/``test=``, read by :func:`hooks`); sublayers add theirs through
``register_sublayer(tiny=...)``.
"""

import contextlib
import functools
import io
import json
import logging
import os
import random
import shutil
import sys
from typing import Dict, List, Optional

import torch
from collections import Counter
from torch.utils._python_dispatch import TorchDispatchMode

import fairseq_attnzoo
from fairseq import options, tasks
from fairseq.models import ARCH_MODEL_REGISTRY

from fairseq_attnzoo.models.registry import ArchTests, arch_tests
from fairseq_attnzoo.models.sublayers import (SLOT_FLAGS, SUBLAYER_REGISTRY, layer_names,
                                              tiny_overrides)
from preptest_util import REPO

# the suite drives fairseq in-process (its CLIs, checkpoints, stock tasks) with the plugin, as a
# script does: `--user-dir` finds the package already imported, so enable the compat table here
fairseq_attnzoo.enable()

class DispatchedOps(TorchDispatchMode):
    """The aten ops dispatched inside ``with DispatchedOps() as ops:``, below autograd (so the
    backward's too): ``ops.calls``, each ``(name, func, args)`` in order; ``ops.names``, their
    names; ``ops.n``, how often each name came."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket.__name__, func, args))
        return func(*args, **(kwargs or {}))

    @property
    def names(self) -> List[str]:
        return [name for name, _, _ in self.calls]

    @property
    def n(self) -> Counter:
        return Counter(self.names)


def record_sdpa(monkeypatch) -> List[tuple]:
    """Every later call of ``F.scaled_dot_product_attention``, as ``(q, k, v, kwargs)``, in
    order (the call still runs)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    return calls


USER_DIR = os.path.join(REPO, "fairseq_attnzoo")

TINY_MT = {
    "encoder_embed_dim": 32, "encoder_ffn_embed_dim": 64, "encoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_embed_dim": 32, "decoder_ffn_embed_dim": 64,
    "decoder_layers": 2, "decoder_attention_heads": 4,
}
TINY_LM = {
    "decoder_embed_dim": 32, "decoder_ffn_embed_dim": 64, "decoder_layers": 2,
    "decoder_attention_heads": 4, "tokens_per_sample": 24,
}


def zoo_archs() -> List[str]:
    """Every arch of every zoo model class (no list to maintain)."""
    return sorted(a for a, cls in ARCH_MODEL_REGISTRY.items() if getattr(cls, "zoo_task", None))


def model_class(arch):
    return ARCH_MODEL_REGISTRY[arch]


def hooks(arch) -> ArchTests:
    """The arch's test hooks from the registry (tiny sizes, flags, eval-lm flags, tolerances)."""
    return arch_tests(arch)


def train_flags(arch) -> List[str]:
    """Extra flags of fairseq-train runs of ``arch``."""
    return list(hooks(arch).train_flags)


def eval_flags(arch) -> List[str]:
    """fairseq-eval-lm flags of an LM arch."""
    flags = hooks(arch).eval_flags
    return ["--tokens-per-sample", "24"] if flags is None else list(flags)


@functools.lru_cache(maxsize=None)
def wiring(arch: str) -> tuple:
    """What a tiny end-to-end run of ``arch`` exercises: its model class and task, its test and
    fairseq-train/eval-lm flags, and every option of its tiny config but the arch's name, with a
    float option (a dropout rate, a loss weight, a RoPE base) reduced to whether it is 0: a
    value, not a code path. Presets that differ only in sizes the tests shrink away or in such
    values (``adaptive_span_lm`` / ``_large``, ``attnzoo_lm_llama`` / ``_small``) share a wiring."""
    cls = model_class(arch)
    parsed = parse(arch, "DATA")  # parsing reads no data
    config = tuple(sorted((k, bool(v) if isinstance(v, float) else v)
                          for k, v in vars(parsed).items() if k != "arch"))
    return (cls, cls.zoo_task, tuple(hooks(arch).flags), tuple(train_flags(arch)),
            tuple(eval_flags(arch)) if is_lm(arch) else (), repr(config))


def wirings(archs: List[str]) -> Dict[str, List[str]]:
    """Each distinct wiring's first arch -> the archs that share it (itself first)."""
    out: Dict[str, List[str]] = {}
    first: Dict[tuple, str] = {}
    for arch in archs:
        out.setdefault(first.setdefault(wiring(arch), arch), []).append(arch)
    return out


def one_per_wiring(archs: List[str], all_fast: bool = True) -> list:
    """pytest params for the arch-generic checks: the first arch of each distinct
    :func:`wiring` (the other presets of a wiring: ``test_sweep.test_preset_builds_its_wiring``).
    With ``all_fast=False`` (the end-to-end runs) only the first of each (model class, task, test
    flags) runs in ``make test-fast``, the others are marked ``slow``."""
    import pytest

    seen, out = set(), []
    for arch in wirings(archs):
        cls = model_class(arch)
        key = (cls, cls.zoo_task, tuple(hooks(arch).flags))
        out.append(arch if all_fast or key not in seen
                   else pytest.param(arch, marks=pytest.mark.slow))
        seen.add(key)
    return out


def is_lm(arch) -> bool:
    return model_class(arch).zoo_task != "translation"


def to_flags(overrides: Dict) -> List[str]:
    out = []
    for k, v in overrides.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                out.append(flag)
        else:
            out += [flag, str(v)]
    return out


def sublayers_of(args) -> List[str]:
    """The registered sublayer names a parsed config builds."""
    names = set()
    for attr in SLOT_FLAGS:
        if getattr(args, attr, None) is not None:
            names.update(layer_names(args, attr))
    return sorted(names)


def tolerance(args, check: str, default: float) -> float:
    """The bound of a named generic check: ``default``, unless a sublayer of this config registered
    a looser one (``register_sublayer(tolerances={check: ...})``)."""
    return max([default] + [SUBLAYER_REGISTRY[n].tolerances[check] for n in sublayers_of(args)
                            if check in SUBLAYER_REGISTRY[n].tolerances])


def _sublayer_names(arch: str, base_args: List[str]) -> List[str]:
    parser = options.get_training_parser()
    return sublayers_of(options.parse_args_and_arch(parser, base_args))


def tiny_flags(arch: str, data: str) -> List[str]:
    """Size flags that make ``arch`` tiny, plus its task/criterion flags."""
    cls = model_class(arch)
    sizes = dict(TINY_LM if is_lm(arch) else TINY_MT)
    sizes.update(hooks(arch).tiny)
    head = [data, "--user-dir", USER_DIR, "--arch", arch, "--task", cls.zoo_task, "--cpu"]
    head += list(hooks(arch).flags)
    names = _sublayer_names(arch, head + to_flags(sizes))
    sizes.update(tiny_overrides(names))
    return head + to_flags(sizes)


def parse(arch: str, data: str, extra: Optional[List[str]] = None):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, tiny_flags(arch, data) + list(extra or []))


def build(arch: str, data: str, extra: Optional[List[str]] = None, seed: int = 1):
    args = parse(arch, data, extra)
    torch.manual_seed(seed)
    task = tasks.setup_task(args)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    return args, task, model, criterion


# ---- the sweep's batch and decoding helpers (shared by test_sweep and test_precision) ----------

def sweep_batch(task, args, split="train", n=8, seed=0):
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_sentences=n, max_tokens=4096, seed=seed,
        max_positions=None, ignore_invalid_inputs=True,
    ).next_epoch_itr(shuffle=False)
    # the first batch with padding (the tiny corpora have ragged lengths)
    pad = task.source_dictionary.pad()
    first = None
    for sample in itr:
        first = first or sample
        tokens = sample["net_input"]["src_tokens"]
        if tokens.eq(pad).any() and tokens.size(0) > 1:
            return sample
    # streaming tasks never pad: right-pad the tail of the first row ourselves
    sample = first
    for key in ("src_tokens", "prev_output_tokens"):
        if key in sample["net_input"]:
            sample["net_input"][key][0, -3:] = pad
    sample["target"][0, -3:] = pad
    sample["ntokens"] = int(sample["target"].ne(pad).sum())
    return sample


def lm_extra(arch):
    return ["--sample-break-mode", "eos"] if model_class(arch).zoo_task == "language_modeling" else []


def decoder_inputs(model, arch, net_input):
    """(decoder tokens, encoder output or None) of a batch, for LMs and translation models."""
    if is_lm(arch):
        return net_input["src_tokens"], None
    enc = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    return net_input["prev_output_tokens"], enc


def incremental_vs_full(model, tokens, encoder_out, pad: int, transform=None) -> float:
    """max |full forward - token-by-token decoding| over non-pad positions (after ``transform``,
    e.g. log-softmax). The one incremental == full check of the sweep and the precision sweep."""
    transform = transform or (lambda x: x)
    full = transform(model.decoder(tokens, encoder_out=encoder_out)[0])
    step = transform(decode_steps(model, tokens, encoder_out)[0])
    keep = tokens.ne(pad).unsqueeze(-1)
    return ((full - step).abs() * keep).max().item()


def decode_steps(model, tokens, encoder_out, new_order=None, reorder_at=None, state=None):
    """Token-by-token decoding with fairseq's incremental state (``state``: a dict to fill, to
    look at the cache afterwards); optionally reorder the beam before step ``reorder_at``."""
    state = {} if state is None else state
    outs = []
    for t in range(tokens.size(1)):
        if reorder_at is not None and t == reorder_at:
            model.decoder.reorder_incremental_state_scripting(state, new_order)
            if encoder_out is not None:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
            tokens = tokens.index_select(0, new_order)
            outs = [o.index_select(0, new_order) for o in outs]
        out = model.decoder(tokens[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
        outs.append(out[:, -1:])
    return torch.cat(outs, dim=1), tokens


# ---- the sweep's tiny fairseq-train run (one per wiring and test run: conftest's `trained`) -----

def sweep_train_flags(arch: str, data: str, save_dir: str, max_update: int) -> List[str]:
    """fairseq-train flags of the sweep's tiny run of ``arch``."""
    return tiny_flags(arch, data) + [
        "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "400", "--max-update",
        str(max_update), "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "json",
        "--log-interval", "1", "--seed", "1", "--num-workers", "0",
        "--skip-invalid-size-inputs-valid-test",
    ] + train_flags(arch)


#: updates of the shared tiny run
TRAINED_UPDATES = 3


def train_once(arch: str, data: str, folder: str):
    """The shared tiny run: fairseq-train ``arch`` for TRAINED_UPDATES updates into ``folder``
    (checkpoint_last.pt, checkpoint_best.pt), its log lines in ``folder/train.log``."""
    logs = run_cli("train", sweep_train_flags(arch, data, folder, TRAINED_UPDATES))
    with open(os.path.join(folder, "train.log"), "w") as f:
        f.write("\n".join(logs) + "\n")


class TrainedRun:
    """A finished shared tiny run (conftest's ``trained``): read-only."""

    def __init__(self, folder: str, data: str):
        self.folder, self.data = folder, data
        self.ckpt = os.path.join(folder, "checkpoint_last.pt")

    @property
    def logs(self) -> List[str]:
        with open(os.path.join(self.folder, "train.log")) as f:
            return f.read().splitlines()

    def copy_to(self, path: str) -> str:
        """A writable copy of the run's folder at ``path`` (to resume it, to write beside it)."""
        shutil.copytree(self.folder, path, ignore=shutil.ignore_patterns(".done"))
        return str(path)


# ---- tiny data --------------------------------------------------------------------------------

def make_parallel_text(root: str, n_train=160, n_valid=16, n_test=16, seed=0):
    """A learnable toy translation task: target = source words mapped and reversed."""
    rng = random.Random(seed)
    src_vocab = [f"s{i}" for i in range(24)]
    os.makedirs(root, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        with open(f"{root}/{split}.src", "w") as fs, open(f"{root}/{split}.tgt", "w") as ft:
            for _ in range(n):
                words = [rng.choice(src_vocab) for _ in range(rng.randint(2, 12))]
                fs.write(" ".join(words) + "\n")
                ft.write(" ".join("t" + w[1:] for w in reversed(words)) + "\n")


def make_mono_text(root: str, n_train=200, n_valid=20, n_test=20, seed=0):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(30)]
    os.makedirs(root, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        with open(f"{root}/{split}.txt", "w") as f:
            for _ in range(n):
                # a little structure so the LM has something to learn
                start = rng.randrange(len(vocab))
                f.write(" ".join(vocab[(start + 2 * i) % len(vocab)]
                                 for i in range(rng.randint(3, 14))) + "\n")


def preprocess(argv: List[str]):
    from fairseq_cli import preprocess as pre

    parser = options.get_preprocessing_parser()
    with quiet():
        pre.main(parser.parse_args(argv))


@contextlib.contextmanager
def quiet():
    """Silence fairseq's INFO logging inside a test (errors still propagate)."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(old)


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: List[str] = []

    def emit(self, record):
        # keep the logger name: fairseq's json progress bar renames its logger to the tag
        self.records.append(f"[{record.name}] {record.getMessage()}")


def run_cli(module: str, argv: List[str]) -> List[str]:
    """Run a fairseq console entry point in-process (same code as the `fairseq-*` script);
    return its log messages. Data is loaded in this process (``--num-workers 0`` unless ``argv``
    names it): a DataLoader worker started in-process is joined when its loader is collected,
    which waits out torch's 5 s status-check interval each time, where a console process just
    exits (measured: generate 0.4 s, then 5.2 s in gc.collect)."""
    import importlib

    if "--num-workers" not in argv:
        argv = argv + ["--num-workers", "0"]

    mod = importlib.import_module(f"fairseq_cli.{module}")
    # fairseq keeps the best validation result of a process on its save_checkpoint function: a
    # run in a fresh process starts without one (else a run no better than an earlier test's in
    # this process would write no checkpoint_best.pt)
    from fairseq import checkpoint_utils

    vars(checkpoint_utils.save_checkpoint).pop("best", None)
    cap = LogCapture()
    root = logging.getLogger()
    root.addHandler(cap)
    old_argv, old_level = sys.argv, root.level
    sys.argv = [module] + argv
    root.setLevel(logging.INFO)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            mod.cli_main()
    finally:
        sys.argv = old_argv
        root.removeHandler(cap)
        root.setLevel(old_level)
    return cap.records + out.getvalue().splitlines()


def json_logs(lines: List[str], tag: str) -> List[Dict]:
    """Parse fairseq ``--log-format json`` lines of one kind (train_inner, valid, train)."""
    out = []
    prefix = f"[{tag}] {{"
    for line in lines:
        if line.startswith(prefix):
            try:
                out.append(json.loads(line[len(prefix) - 1:]))
            except json.JSONDecodeError:
                continue
    return out

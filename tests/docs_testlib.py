"""The documented commands as data, and a toy copy of the demo data layout to run them on
(tests/test_docs_commands.py; the convention is described in docs/testing.md).

A documented command is a fenced ```bash or ```sh block of README.md, docs/*.md or
examples/*/README.md, plus the ```python blocks of the README's "In your own PyTorch model". A block
that cannot run in the test (a GPU, the internet, hours of training) carries an HTML comment as the
last non-blank line before its fence: ``<!-- not-run: the reason -->``.
"""
import os
import random
import re
import stat
from dataclasses import dataclass
from typing import List, Optional

from preptest_util import REPO


#: appended to every documented ``fairseq-train`` (later flags win in argparse) and
#: ``fairseq-hydra-train`` (later overrides win) by the wrappers put first on PATH: the commands
#: run as written, for two updates
TOY_TRAIN = "--max-update 2 --num-workers 0"
TOY_HYDRA = "optimization.max_update=2 dataset.num_workers=0"

NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```\s*([A-Za-z0-9_+-]*)\s*$")
PYTORCH_SECTION = "In your own PyTorch model"


@dataclass
class Block:
    path: str          # relative to the repository root
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    section: str       # the heading the block is under
    not_run: Optional[str]  # the reason of a not-run marker, None when the block runs

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> List[str]:
    """Every Markdown file whose commands the test checks (relative paths, sorted)."""
    names = ["README.md"]
    names += sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                    if f.endswith(".md"))
    examples = os.path.join(REPO, "examples")
    names += sorted(os.path.join("examples", d, "README.md") for d in os.listdir(examples)
                    if os.path.isfile(os.path.join(examples, d, "README.md")))
    return names


def blocks(path: str) -> List[Block]:
    """The fenced blocks of one Markdown file, with the not-run marker in front of each."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        m = FENCE.match(line.strip()) if line.lstrip().startswith("```") else None
        if m is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = NOT_RUN.match(lines[j].strip()) if j >= 0 else None
        out.append(Block(path, start + 1, m.group(1).lower(), "\n".join(body) + "\n", section,
                         marker.group(1) if marker else None))
        i += 1
    return out


def stray_markers(path: str) -> List[int]:
    """Lines of not-run markers that are not right in front of a fenced block."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    stray = []
    for n, line in enumerate(lines):
        if line.strip().startswith("<!--") and "not-run" in line:
            k = n + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k >= len(lines) or not lines[k].lstrip().startswith("```"):
                stray.append(n + 1)
    return stray


def is_shell(block: Block) -> bool:
    return block.lang in ("bash", "sh", "shell", "console")


def is_pytorch_example(block: Block) -> bool:
    return block.path == "README.md" and block.lang == "python" and \
        block.section.startswith(PYTORCH_SECTION)


# ---- the toy demo layout ----------------------------------------------------------------------

_DE = ("Wählen Sie", "Klicken Sie auf", "die Tabelle", "das Dokument", "den Text", "im Menü",
       "Format", "Einfügen", "Zeilen", "Spalten", "und", "die Zellen", "öffnen", "speichern")
_EN = ("Choose", "Click", "the table", "the document", "the text", "in the menu", "Format",
       "Insert", "rows", "columns", "and", "the cells", "open", "save")
_WIKI = ("The history of", "the city", "was", "written", "in", "1850", "by", "a", "German",
         "author", "[[Category:", "people]]", "and", "its", "river", "is", "long", "of", "the")


def _write(path: str, lines: List[str]):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def build_demo_data(root: str, seed: int = 0) -> str:
    """``root/data`` as ``make data`` lays it out, at toy size: ``libreoffice/`` (raw German and
    English text, a SentencePiece model, the encoded pieces and their fairseq binaries, source de,
    target en, joined dictionary) and ``wiki-gensim/`` (one token per byte, binarised)."""
    import sentencepiece as spm
    from zoo_testlib import preprocess

    rng = random.Random(seed)
    data = os.path.join(root, "data")
    lo = os.path.join(data, "libreoffice")
    sizes = {"train": 240, "valid": 16, "test": 12}
    for split, n in sizes.items():
        de, en = [], []
        for _ in range(n):
            ids = [rng.randrange(len(_DE)) for _ in range(rng.randint(2, 7))]
            de.append(" ".join(_DE[k] for k in ids) + ".")
            en.append(" ".join(_EN[k] for k in ids) + ".")
        _write(f"{lo}/raw/{split}.de", de)
        _write(f"{lo}/raw/{split}.en", en)
    spm.SentencePieceTrainer.train(
        input=f"{lo}/raw/train.de,{lo}/raw/train.en", model_prefix=f"{lo}/spm", vocab_size=120,
        character_coverage=1.0, model_type="unigram", hard_vocab_limit=False, seed_sentencepiece_size=10000,
        minloglevel=2, num_threads=1)
    sp = spm.SentencePieceProcessor(model_file=f"{lo}/spm.model")
    for split in sizes:
        for lang in ("de", "en"):
            with open(f"{lo}/raw/{split}.{lang}", encoding="utf-8") as f:
                _write(f"{lo}/spm/{split}.{lang}",
                       [" ".join(sp.encode(line.rstrip("\n"), out_type=str)) for line in f])
    preprocess(["--source-lang", "de", "--target-lang", "en", "--trainpref", f"{lo}/spm/train",
                "--validpref", f"{lo}/spm/valid", "--testpref", f"{lo}/spm/test",
                "--destdir", f"{lo}/bin", "--joined-dictionary", "--workers", "1"])

    wiki = os.path.join(data, "wiki-gensim")
    for split, n in (("train", 600), ("valid", 60), ("test", 60)):
        text = [" ".join(rng.choice(_WIKI) for _ in range(rng.randint(4, 12))) for _ in range(n)]
        _write(f"{wiki}/{split}.txt", [" ".join(str(b) for b in t.encode()) for t in text])
    preprocess(["--only-source", "--trainpref", f"{wiki}/train.txt", "--validpref",
                f"{wiki}/valid.txt", "--testpref", f"{wiki}/test.txt", "--destdir",
                f"{wiki}/bin", "--workers", "1"])
    return data


DEMO_CKPT = re.compile(r"work/demo/([A-Za-z0-9_]+)/checkpoints/")


def demo_rows_used(texts: List[str]) -> List[str]:
    """The ``make demo`` rows whose checkpoints these commands read."""
    return sorted({m.group(1) for t in texts for m in DEMO_CKPT.finditer(t)})


def train_demo_rows(root: str, rows: List[str], env: dict):
    """``root/work/demo/ROW/checkpoints/checkpoint_last.pt`` as ``make demo`` leaves it, for the
    translation rows of plain archs and the character-LM rows, with the demo's flags and
    the toy update count (the data under ``root/data``)."""
    import shlex
    import subprocess

    from scripts.demo import config

    lm_rows = config.lm_rows()
    for row in rows:
        save = os.path.join("work", "demo", row, "checkpoints")
        if row in lm_rows:
            cmd = ["fairseq-train", "data/wiki-gensim/bin", "--arch", row]
            cmd += shlex.split(config.LM_COMMON) + config.method_flags(row)
        else:
            spec = config.mt_rows()[row]
            assert "from" not in spec, f"demo row {row} derives from another row: not built here"
            cmd = ["fairseq-train", "data/libreoffice/bin", "--arch", spec.get("arch", row),
                   "--task", "translation"]
            cmd += shlex.split(config.COMMON) + shlex.split(spec.get("flags", ""))
        cmd += ["--user-dir", "fairseq_attnzoo", "--cpu", "--save-dir", save, "--seed", "1",
                "--no-epoch-checkpoints"] + TOY_TRAIN.split()
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and os.path.exists(os.path.join(root, save, "checkpoint_last.pt")), \
            f"demo row {row}: {p.stderr[-3000:]}"


def make_workdir(root: str, data: str) -> str:
    """A directory laid out like the repository after ``make data``: the package, examples and
    scripts linked in, ``data/`` holding (links to) the toy corpora. Returns its path."""
    os.makedirs(os.path.join(root, "data"))
    for name in os.listdir(data):
        os.symlink(os.path.join(data, name), os.path.join(root, "data", name))
    for name in ("fairseq_attnzoo", "examples", "scripts", "Makefile", "constraints.txt",
                 "setup.py"):
        os.symlink(os.path.join(REPO, name), os.path.join(root, name))
    return root


def make_toy_wrappers(bin_dir: str, commands: str) -> str:
    """``fairseq-train`` and ``fairseq-hydra-train`` wrappers in ``bin_dir`` that run the command
    of that name in ``commands`` (the scripts' folder, or their console-server shims) with the toy
    sizes appended. Returns ``bin_dir`` (put it first on PATH)."""
    os.makedirs(bin_dir, exist_ok=True)
    for name, toy in (("fairseq-train", TOY_TRAIN), ("fairseq-hydra-train", TOY_HYDRA)):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/bash\nexec "{os.path.join(commands, name)}" "$@" {toy}\n')
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


#: run in front of every README PyTorch example: fairseq cannot be imported, and at exit no
#: fairseq module may have been loaded and no process-wide torch.optim hook installed
BLOCK_FAIRSEQ = '''
import atexit, importlib.abc, os, sys

class _NoFairseq(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fairseq" or name.startswith("fairseq.") or name == "fairseq_cli" \\
                or name.startswith("fairseq_cli."):
            raise ImportError(f"fairseq is blocked in this test (import {name})")
        return None

sys.meta_path.insert(0, _NoFairseq())

def _check():
    loaded = sorted(m for m in sys.modules if m == "fairseq" or m.startswith(("fairseq.", "fairseq_cli")))
    if loaded:
        sys.stderr.write(f"fairseq modules loaded: {loaded[:5]}\\n")
        os._exit(3)
    optim = sys.modules.get("torch.optim.optimizer")
    hooks = [n for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
             if optim is not None and getattr(optim, n, None)]
    if hooks:
        sys.stderr.write(f"global torch.optim hooks installed: {hooks}\\n")
        os._exit(4)

atexit.register(_check)
'''

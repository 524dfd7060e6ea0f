"""Every documented command runs as written (docs/testing.md, "Documented commands").

The fenced ```bash/```sh blocks of README.md, docs/*.md and examples/*/README.md run with bash, in
document order, in a directory laid out like the repository after ``make data`` (toy corpora in the
demo's paths), with ``fairseq-train`` / ``fairseq-hydra-train`` wrappers first on PATH that append
two-update toy flags (docs_testlib.TOY_TRAIN / TOY_HYDRA); the ``fairseq-*`` commands run
through tests/console_server.py (each its own process, forked from one that did fairseq's
imports). A block that cannot run here is marked ``<!-- not-run: reason -->`` right before its
fence. The README's "In your own PyTorch model" examples run with fairseq blocked from import.
"""
import os
import re
import subprocess
import time

import pytest

from console_server import BIN, SERVERS
from docs_testlib import (BLOCK_FAIRSEQ, REPO, blocks, build_demo_data, doc_files, is_pytorch_example,
                          demo_rows_used, is_shell, make_toy_wrappers, make_workdir,
                          stray_markers, train_demo_rows)

BLOCK_TIMEOUT = 300
FAMILIES = ("ProductKeyMemory", "SynthesizerAttention", "AttentionOverParameters",
            "CollaborativeAttention", "AdaptiveSpanAttention")


def _runnable(path):
    return [b for b in blocks(path) if is_shell(b) and b.not_run is None]


def test_every_shell_block_runs_or_says_why_not():
    """A not-run marker gives a reason and stands right in front of a fenced block; the README's
    PyTorch section has an example per family, all run."""
    for path in doc_files():
        assert not stray_markers(path), f"{path}: not-run marker not in front of a fence, lines " \
                                        f"{stray_markers(path)}"
        for b in blocks(path):
            if b.not_run is not None:
                assert b.not_run.strip(), f"{b.where}: a not-run marker needs a reason"
                assert is_shell(b), f"{b.where}: only shell blocks may be marked not-run"
        for b in _runnable(path):  # the toy-size wrappers must see every training
            assert "fairseq_cli.train" not in b.text and "fairseq_cli.hydra_train" not in b.text, \
                f"{b.where}: call fairseq-train / fairseq-hydra-train, not fairseq_cli (toy sizes)"
    examples = [b for b in blocks("README.md") if is_pytorch_example(b)]
    for name in FAMILIES:
        assert any(name in b.text for b in examples), f"README's PyTorch section lacks {name}"


def test_readme_fits_first_contact():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= 150, f"README.md has {n} lines (at most 150: the rest belongs in docs/)"


@pytest.fixture(scope="module")
def shims(console_shims):
    """The fairseq and attnzoo console scripts the blocks call, run through
    tests/console_server.py: the same commands, each in a process of its own, without each
    paying fairseq's imports."""
    return console_shims(*sorted({name for p in doc_files() for b in _runnable(p)
                                  for name in re.findall(r"\b(?:fairseq|attnzoo)-[a-z-]+", b.text)
                                  if os.path.exists(os.path.join(BIN, name))}))


#: the modules the blocks run with ``python -m`` (and those start with ``sys.executable -m``)
PYTHON_MODULES = ["scripts.bench", "scripts.bench.harness", "scripts.data.prepare_text",
                  "fairseq_cli.preprocess"]


def _env(tmp_path, shims, cwd=None):
    """The blocks' environment; with ``cwd``, a ``python`` whose ``-m`` of PYTHON_MODULES runs
    through console servers started there (each command its own process, as in
    tests/console_server.py)."""
    wrappers = make_toy_wrappers(str(tmp_path / "toybin"), shims)
    if cwd:
        wrappers += ":" + SERVERS.python_shim(str(tmp_path / "pybin"), PYTHON_MODULES, cwd=cwd)
    return dict(os.environ, PATH=f"{wrappers}:{shims}:{BIN}:{os.environ.get('PATH', '')}",
                PYTHONPATH=REPO, OMP_NUM_THREADS="1", ATTNZOO_TRACEBACK="1",
                MPLBACKEND="Agg")


def _ran(where, code, stdout, stderr):
    assert code == 0, (f"{where} failed (exit {code}):\n--- stdout\n{stdout[-3000:]}\n"
                       f"--- stderr\n{stderr[-5000:]}")


def _run(cmd, cwd, env, where, **kwargs):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT, **kwargs)
    _ran(where, p.returncode, p.stdout, p.stderr)
    return p


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory, shims):
    """data/ as `make data` leaves it, and work/demo/ROW/checkpoints of every demo row a
    documented command reads, as `make demo` leaves them (toy sizes)."""
    root = tmp_path_factory.mktemp("demo")
    data = build_demo_data(str(root))
    rows = demo_rows_used([b.text for p in doc_files() for b in _runnable(p)])
    if rows:
        train_demo_rows(make_workdir(str(root / "trained"), data), rows, _env(root, shims))
        os.symlink(str(root / "trained" / "work"), os.path.join(data, "..", "work"))
    return data


# one worker runs them all: demo_data (toy corpora and demo checkpoints) is built once
@pytest.mark.xdist_group("docs")
@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in doc_files() if _runnable(p)])
def test_documented_commands_run(path, demo_data, shims, tmp_path):
    """Each file's runnable shell blocks, in order, in a fresh copy of the demo layout (a block
    may use what an earlier block of the same file wrote, never another file's)."""
    cwd = make_workdir(str(tmp_path / "repo"), demo_data)
    work = os.path.join(demo_data, "..", "work")
    if os.path.exists(work):  # the demo's checkpoints, read-only in spirit
        os.makedirs(os.path.join(cwd, "work"))
        os.symlink(os.path.join(os.path.realpath(work), "demo"), os.path.join(cwd, "work", "demo"))
    env = _env(tmp_path, shims, cwd)
    for b in _runnable(path):
        t0 = time.time()
        _run(["bash", "-e", "-o", "pipefail", "-c", b.text], cwd, env, b.where)
        print(f"{b.where}: {time.time() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len([b for b in blocks("README.md")
                                              if is_pytorch_example(b)])))
def test_pytorch_example_runs_without_fairseq(index, tmp_path):
    """The README's plain-PyTorch examples: fairseq cannot be imported and none of it loads."""
    b = [b for b in blocks("README.md") if is_pytorch_example(b)][index]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    # (as python -c, forked from a console server that imported torch, never fairseq)
    _ran(b.where, *SERVERS.run("-c", [BLOCK_FAIRSEQ + "\n" + b.text], env=env, cwd=tmp_path,
                               timeout=BLOCK_TIMEOUT))

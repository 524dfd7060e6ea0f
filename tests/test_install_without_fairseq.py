"""The plain PyTorch modules install with torch alone (issue 45): the README's install line of "In
your own PyTorch model" runs in a fresh virtual environment that holds torch (and its own
dependencies) but no fairseq, with no package index, and the README's PyTorch examples run there
against the installed package.

No network: the fresh environment sees torch, its dependencies and pip/setuptools/wheel of this
interpreter through links in one directory named by a ``.pth`` file (nothing else of this
interpreter's site-packages, so ``import fairseq`` fails there as on a machine without it).
"""

import importlib.metadata as metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv

import pytest

from docs_testlib import REPO, blocks, is_pytorch_example

PYTORCH_SECTION = "In your own PyTorch model"
#: what the fresh environment may import from this interpreter
BASE = ("torch", "pip", "setuptools", "wheel")


def _closure(names):
    """The distributions ``names`` and everything they require (extras left out)."""
    seen, todo = {}, list(names)
    while todo:
        name = re.split(r"[<>=!~; \[]", todo.pop(), maxsplit=1)[0]
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _link_distributions(target: str):
    """Links in ``target`` to the top-level files and folders (packages, modules, metadata) of
    the distributions of :data:`BASE` and their requirements."""
    os.makedirs(target)
    for dist in _closure(BASE):
        assert not dist.metadata["Name"].lower().startswith("fairseq")
        tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = os.path.join(str(dist.locate_file("")), top)
            dst = os.path.join(target, top)
            if os.path.exists(src) and not os.path.exists(dst) and not top.endswith(".pth"):
                os.symlink(src, dst)


def _install_line() -> str:
    """The pip command of the README's PyTorch section (its first shell block)."""
    block = next(b for b in blocks("README.md")
                 if b.section.startswith(PYTORCH_SECTION) and b.lang in ("bash", "sh"))
    lines = [line.split("#")[0].strip() for line in block.text.splitlines()]
    return next(line for line in lines if line.startswith("pip install"))


@pytest.mark.slow
def test_modules_install_and_run_without_fairseq(tmp_path):
    env_dir, base = tmp_path / "venv", tmp_path / "base"
    venv.EnvBuilder(with_pip=False).create(str(env_dir))
    python = str(env_dir / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _link_distributions(str(base))
    with open(os.path.join(site, "torch_only.pth"), "w") as f:
        f.write(str(base) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([python, "-c", "import fairseq"], capture_output=True, text=True,
                           env=env, cwd=str(tmp_path))
    assert probe.returncode != 0, "the fresh environment must not see fairseq"

    # the README's line as written, run by this environment's pip from a copy of the checkout
    # (an editable install writes its metadata into the source folder: never into the
    # repository), offline (no index; setuptools from this interpreter instead of an isolated
    # build's download)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, name), checkout / name)
    shutil.copytree(os.path.join(REPO, "fairseq_attnzoo"), checkout / "fairseq_attnzoo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    words = shlex.split(_install_line())
    assert words[:2] == ["pip", "install"] and "fairseq" not in " ".join(words), words
    r = subprocess.run([python, "-m", *words, "--no-index", "--no-build-isolation"],
                       capture_output=True, text=True, env=env, cwd=str(checkout), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr

    examples = [b for b in blocks("README.md") if is_pytorch_example(b)]
    assert examples
    for b in examples:
        r = subprocess.run([python, "-c", b.text], capture_output=True, text=True, env=env,
                           cwd=str(tmp_path), timeout=300)
        assert r.returncode == 0, f"{b.where}:\n{r.stderr[-3000:]}"
    where = subprocess.run([python, "-c", "import fairseq_attnzoo; print(fairseq_attnzoo.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert where.stdout.startswith(str(checkout)), where.stdout + where.stderr  # editable

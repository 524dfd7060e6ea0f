import os

# tests/ and the repository root are on sys.path through pytest.ini's `pythonpath`
os.environ.setdefault("OMP_NUM_THREADS", "1")
# fused Triton kernels (modules/pkm_triton.py) run in Triton's interpreter on CPU tensors; this
# must be set before Triton is imported. ATTNZOO_TEST_DEVICE=cuda runs the compiled kernels.
if os.environ.get("ATTNZOO_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:  # (the kernel tests say so: they need Triton)
        pass
    else:  # the interpreter without its repeated work (tests/interpreter_testlib.py)
        from interpreter_testlib import numpy_xor_sum, patch_once_a_launch

        patch_once_a_launch()
        numpy_xor_sum()

import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
try:  # in-process fairseq commands compose their configs quicker (tests/hydra_testlib.py)
    import hydra  # noqa: F401
except ImportError:  # (no fairseq: its tests say so)
    pass
else:
    from hydra_testlib import quicker_compose

    quicker_compose()

# ---- hermetic tests: each in its own folder, nothing written outside it --------------------------
#
# Every test runs in a folder of its own: its working directory (a relative --save-dir, fairseq's
# default ./checkpoints, a crash.pt) and its TMPDIR (tempfile, and every subprocess it starts) are
# inside it, so nothing an earlier test or run left behind is read, and nothing is left for a later
# one. Fixtures of a wider scope run in a folder of the session. The check: the repository, the
# folder pytest was started in and the TMPDIR it was started with (when TMPDIR is set: `.ci/run`
# gives each run a fresh one; the machine's shared /tmp is written by other programs too) are the
# same after each test as before it (a test that wrote there fails at teardown, with the paths),
# and after the run as before it (the run fails: a module or session fixture). Files git tracks
# count only when created or removed (an edit is someone working in the checkout).

from preptest_util import ROOT  # noqa: E402

_START_CWD = os.path.realpath(os.getcwd())
_START_TMP = os.path.realpath(tempfile.gettempdir()) if os.environ.get("TMPDIR") else None
#: names never compared: what Python, pytest and git write by themselves (the checkout's own
#: virtual environment, `make install`'s, and its editable install's metadata)
_NOT_WATCHED = (".git", ".venv", "__pycache__", ".pytest_cache")


def _watched(name: str) -> bool:
    return not (name in _NOT_WATCHED or name.startswith("pytest-of-")
                or name.endswith(".egg-info"))


def _tree(root: str, deep: bool, shallow: frozenset = frozenset()) -> dict:
    """``{path: (size, mtime_ns)}`` of what ``root`` holds (all of it when ``deep``, else its
    top level; a folder as ``(0, 0)``; of a folder in ``shallow``, only what it holds itself),
    but what Python, pytest and git write themselves."""
    import stat

    out = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if _watched(d)]
        for name in dirs + [f for f in files if _watched(f)]:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:  # gone meanwhile
                continue
            out[path] = (0, 0) if stat.S_ISDIR(st.st_mode) else (st.st_size, st.st_mtime_ns)
        if not deep:
            break
        if top in shallow:
            dirs[:] = []
    return out


def _ignored_folders() -> frozenset:
    """The folders of the checkout git ignores (``data/``, ``work/`` after ``make demo``: ten
    thousand files), as they are when the run starts: each test sees what they hold themselves,
    the end of the run all of it (a walk of them after every test cost seconds)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--ignored",
                              "--exclude-standard", "--directory", "-z"], capture_output=True,
                             timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(os.path.join(str(ROOT), p.rstrip("/")) for p in out.split("\0")
                     if p.endswith("/"))


_SHALLOW = _ignored_folders()


def _outside(whole: bool = False) -> dict:
    """What a test may not change: the repository (every file, but the contents of the folders
    git ignores below their top level unless ``whole``), the folder pytest started in and the
    TMPDIR it started with (their top level)."""
    out = _tree(str(ROOT), deep=True, shallow=frozenset() if whole else _SHALLOW)
    if not _START_CWD.startswith(str(ROOT)):
        out.update(_tree(_START_CWD, deep=False))
    if _START_TMP is not None:
        out.update(_tree(_START_TMP, deep=False))
    return out


def _tracked() -> set:
    """The files git tracks in the repository (absolute paths; empty outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             timeout=30).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return set()
    return {os.path.join(str(ROOT), p) for p in out.split("\0") if p}


#: a tracked file whose content changes during the run is someone editing the checkout, not a
#: test's leftover: only new and removed files are flagged there (untracked ones: any change)
_TRACKED = _tracked()


def _written(before: dict, after: dict) -> list:
    return sorted([f"{p} (new)" for p in after.keys() - before.keys()]
                  + [f"{p} (changed)" for p in after.keys() & before.keys()
                     if after[p] != before[p] and p not in _TRACKED]
                  + [f"{p} (removed)" for p in before.keys() - after.keys()])


#: the longest TMPDIR multiprocessing can use: it binds AF_UNIX sockets at
#: TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (a DataLoader worker passing tensors), 107 bytes at most
#: (a longer one failed the worker and hung the run that waited for it)
MAX_TMPDIR = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def _own_folder(mp, folder):
    """Work in ``folder``: ``folder/cwd`` the working directory, ``folder/tmp`` the TMPDIR."""
    (folder / "cwd").mkdir()
    (folder / "tmp").mkdir()
    _refuse_too_long(str(folder / "tmp"))
    mp.chdir(folder / "cwd")
    mp.setenv("TMPDIR", str(folder / "tmp"))
    mp.setattr(tempfile, "tempdir", str(folder / "tmp"))


@pytest.fixture(scope="session", autouse=True)
def session_folder(tmp_path_factory):
    """Module and session fixtures run in a folder of the session (tests: :func:`own_folder`)."""
    with pytest.MonkeyPatch.context() as mp:
        _own_folder(mp, tmp_path_factory.mktemp("session"))
        yield


@pytest.fixture(autouse=True)
def own_folder(request, tmp_path_factory, monkeypatch):
    """Each test's working directory and TMPDIR: a fresh empty folder of its own; the test fails
    if it wrote outside it (the repository, pytest's starting folder, the starting TMPDIR)."""
    folder = tmp_path_factory.mktemp("t")  # short: see MAX_TMPDIR
    before = _outside()
    _own_folder(monkeypatch, folder)
    yield folder
    written = _written(before, _outside())
    if written:
        pytest.fail(f"{request.node.nodeid} wrote outside its own folder {folder} "
                    f"(under xdist: or a test running beside it): {', '.join(written[:10])}",
                    pytrace=False)


_AT_START: dict = {}


#: the deepest TMPDIR _own_folder makes below the run's base folder (an xdist worker's session
#: folder; a test's own ``tNNN`` is shorter)
DEEPEST = "/popen-gw99/session99/tmp"


def _where_the_run_started(config) -> bool:
    """The xdist controller, or the only process (an xdist worker's config has ``workerinput``;
    unlike the PYTEST_XDIST_WORKER variable, a pytest that a test starts does not inherit it)."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _where_the_run_started(session.config):
        _check_tmpdir_length(session.config)
        _AT_START.update(_outside(whole=True))


def _check_tmpdir_length(config):
    """Where the run starts, before any worker: a TMPDIR too long for _own_folder stops the run
    in one line (a worker's pytest.exit reaches xdist's controller as an INTERNALERROR naming the
    test it was running, and the line is lost)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        _refuse_too_long(str(factory.getbasetemp()) + DEEPEST)


def _refuse_too_long(tmpdir: str):
    """Stop the run in one line when ``tmpdir`` (a test's TMPDIR) is too long for
    multiprocessing's sockets."""
    if len(tmpdir) > MAX_TMPDIR:
        pytest.exit(f"the tests' temporary folders ({tmpdir}: {len(tmpdir)} characters) are too "
                    f"long for multiprocessing's sockets (at most {MAX_TMPDIR}): set TMPDIR to a "
                    f"shorter folder", returncode=4)


def pytest_sessionfinish(session, exitstatus):
    """The whole run (module and session fixtures too) left the watched folders as it found
    them, the folders git ignores included; checked once, where the run started (the xdist
    controller, or the only process)."""
    if not _where_the_run_started(session.config) or not _AT_START:
        return
    written = _written(_AT_START, _outside(whole=True))
    if written:
        session.config.get_terminal_writer().line(
            "the test run wrote outside its temporary folders: " + ", ".join(written[:20]),
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` under pytest >= 9: xdist (3.8) names a grouped test ``ID@GROUP`` by
    setting ``item._nodeid``, which pytest 9 no longer reads (the id is ``item._id``), so every
    test became its own group and a group's module fixtures (test_ddp's runs) were built on both
    workers. Name it so here, where xdist did not (older pytest: nothing to do)."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            try:
                from _pytest.nodeid import NodeId
            except ImportError:  # a pytest without it names nodes as older ones did
                return
            item._id = NodeId.parse(item.nodeid + suffix)

# ---- one tiny world per test run: the toy corpora and one checkpoint per wiring ------------------
#
# Built once per `pytest` run, not once per worker: under pytest-xdist every worker's temporary
# folder sits in the run's folder, and the first worker to ask builds into a folder there under a
# file lock while the other waits and then reads it (what pytest-xdist's documentation suggests
# for session fixtures). Everything built is a function of its name (fixed seeds), so it does not
# matter which worker built it.

def _run_folder(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory, name, make):
    """The folder ``name`` of this run, filled by ``make(folder)`` the first time it is asked for."""
    import shutil

    from filelock import FileLock

    root = _run_folder(tmp_path_factory) / "once"
    root.mkdir(exist_ok=True)
    folder = root / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed before
            folder.mkdir()
            make(str(folder))
            (folder / ".done").touch()
    return str(folder)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """``tiny_data("mt", **sizes)``: binarised toy translation data (src->tgt, joined dictionary;
    sizes: ``make_parallel_text``'s); ``tiny_data("lm", **sizes)``: monolingual data
    (``make_mono_text``'s). Each kind and size is built once per run; returns its ``bin`` folder."""
    from zoo_testlib import make_mono_text, make_parallel_text, preprocess

    def build(kind, **sizes):
        def make(root):
            if kind == "mt":
                make_parallel_text(root, **sizes)
                preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                            f"{root}/train", "--validpref", f"{root}/valid", "--testpref",
                            f"{root}/test", "--destdir", f"{root}/bin", "--joined-dictionary",
                            "--workers", "1"])
            else:
                make_mono_text(root, **sizes)
                preprocess(["--only-source", "--trainpref", f"{root}/train.txt", "--validpref",
                            f"{root}/valid.txt", "--testpref", f"{root}/test.txt", "--destdir",
                            f"{root}/bin", "--workers", "1"])

        assert kind in ("mt", "lm"), kind
        name = "-".join([kind] + [f"{k}{v}" for k, v in sorted(sizes.items())])
        return os.path.join(_once(tmp_path_factory, f"data-{name}", make), "bin")

    return build


@pytest.fixture(scope="session")
def mt_data(tiny_data):
    """Tiny binarised translation data (src->tgt), joined dictionary."""
    return tiny_data("mt")


@pytest.fixture(scope="session")
def lm_data(tiny_data):
    """Tiny binarised monolingual data for language models."""
    return tiny_data("lm")


@pytest.fixture(scope="session")
def console_shims(tmp_path_factory):
    """``console_shims(*programs)``: a folder of executables named after these console scripts
    (``fairseq-train``, ...) that run them through tests/console_server.py -- each command its
    own process, forked from one that did the script's imports -- for the commands a shell or
    torchrun starts (put the folder first on PATH, or call them by path)."""
    from console_server import SERVERS

    folder = str(tmp_path_factory.mktemp("shims"))
    return lambda *programs: SERVERS.shims(folder, programs)


@pytest.fixture(scope="session")
def python_through_servers(tmp_path_factory):
    """``python_through_servers(*modules)``: the path of a ``python`` whose ``-m MODULE`` of
    ``modules`` goes through that module's console server started in the repository
    (tests/console_server.py, ``python_shim``): the same command in a process of its own,
    without paying fairseq's imports each time; anything else it hands to this interpreter."""
    from console_server import SERVERS

    def python(*modules):
        folder = SERVERS.python_shim(str(tmp_path_factory.mktemp("pybin")), list(modules),
                                     cwd=str(ROOT))
        return os.path.join(folder, "python")

    return python


@pytest.fixture
def preprocess_through_server(python_through_servers, monkeypatch):
    """For this test ``sys.executable`` runs ``-m fairseq_cli.preprocess`` (what the data scripts
    run: scripts/data/preplib.py) through its console server (``python_through_servers``)."""
    monkeypatch.setattr(sys, "executable", python_through_servers("fairseq_cli.preprocess"))


@pytest.fixture
def data_for(mt_data, lm_data):
    from zoo_testlib import is_lm

    return lambda arch: lm_data if is_lm(arch) else mt_data


@pytest.fixture(scope="session")
def trained(tmp_path_factory, mt_data, lm_data):
    """``trained(arch)``: the sweep's tiny fairseq-train run of ``arch`` (3 updates, its tiny
    sizes and task flags, ``zoo_testlib.sweep_train_flags``), once per run: a
    ``zoo_testlib.TrainedRun`` with its folder, ``checkpoint_last.pt`` and log lines. Read it, never
    write into it (to resume, copy the folder: ``run.copy_to(path)``)."""
    from zoo_testlib import TrainedRun, is_lm, train_once

    def get(arch):
        data = lm_data if is_lm(arch) else mt_data
        return TrainedRun(_once(tmp_path_factory, f"trained-{arch}",
                                lambda folder: train_once(arch, data, folder)), data)

    return get

import os

# tests/ and the repository root are on sys.path through pytest.ini's `pythonpath`
os.environ.setdefault("OMP_NUM_THREADS", "1")
# fused Triton kernels (modules/pkm_triton.py) run in Triton's interpreter on CPU tensors; this
# must be set before Triton is imported. ATTNZOO_TEST_DEVICE=cuda runs the compiled kernels.
if os.environ.get("ATTNZOO_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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

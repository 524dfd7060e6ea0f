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


@pytest.fixture(scope="session")
def mt_data(tmp_path_factory):
    """Tiny binarised translation data (src->tgt), joined dictionary."""
    from zoo_testlib import make_parallel_text, preprocess

    root = str(tmp_path_factory.mktemp("mt"))
    make_parallel_text(root)
    preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref", f"{root}/train",
                "--validpref", f"{root}/valid", "--testpref", f"{root}/test",
                "--destdir", f"{root}/bin", "--joined-dictionary", "--workers", "1"])
    return f"{root}/bin"


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """Tiny binarised monolingual data for language models."""
    from zoo_testlib import make_mono_text, preprocess

    root = str(tmp_path_factory.mktemp("lm"))
    make_mono_text(root)
    preprocess(["--only-source", "--trainpref", f"{root}/train.txt", "--validpref",
                f"{root}/valid.txt", "--testpref", f"{root}/test.txt", "--destdir",
                f"{root}/bin", "--workers", "1"])
    return f"{root}/bin"


@pytest.fixture
def data_for(mt_data, lm_data):
    from zoo_testlib import is_lm

    return lambda arch: lm_data if is_lm(arch) else mt_data

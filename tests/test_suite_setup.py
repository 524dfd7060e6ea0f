"""The suite's own setup (tests/conftest.py), as a newcomer meets it: a TMPDIR too long for the
tests' folders stops ``make test``'s command in one line, before any test runs."""

import os
import subprocess
import sys

from conftest import MAX_TMPDIR
from preptest_util import REPO


def test_a_too_long_tmpdir_stops_the_run_in_one_line(tmp_path):
    """Under xdist the check ran only in the workers: their pytest.exit reached the controller as
    an INTERNALERROR naming whichever test a worker had started (seen with a TMPDIR made by
    ``mktemp -d`` inside another one), without the line saying why."""
    deep = tmp_path / ("d" * max(1, MAX_TMPDIR - 10 - len(str(tmp_path))))  # (pytest's own
    # folders below it pass the limit)
    deep.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (not a worker
    # of this run's xdist: a run of its own)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                          "tests/test_imports.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(env, TMPDIR=str(deep)))
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-3000:]
    assert "INTERNALERROR" not in out, out[-3000:]
    assert "too long for multiprocessing's sockets" in out and "set TMPDIR to a shorter" in out

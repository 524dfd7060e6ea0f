"""scripts/demo.py without training: argument errors, the row scheduler and the row cache."""
import subprocess
import sys
import threading
import time
import types

import pytest
from preptest_util import SCRIPTS, load_script

demo = load_script("demo")


def run_demo(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "demo.py"), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--archs", "transformer nosuch"], "unknown demo arch(s) ['nosuch']"),
    (["--archs", "collab_convert64 transformer"],
     "collab_convert64 starts from the checkpoint of transformer: put transformer before it"),
    (["--archs", "transformer", "--lm-archs", "nosuch_lm"], "unknown demo arch(s) ['nosuch_lm']"),
])
def test_bad_arch_lists_fail_in_one_line(args, message):
    r = run_demo(*args, "--data", "/nonexistent")
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr


class FakeRow:
    """Stands in for demo.Row: records when it ran and how many rows ran at the same time."""

    def __init__(self, name, parent, log, cache=None):
        self.name, self.parent, self.log, self.cache = name, parent, log, cache
        self.dir = f"/out/{name}"
        self.prepared_with = "unset"

    def prepare(self, parent):
        self.prepared_with = parent.name if parent else None

    def cached(self):
        return self.cache

    def run(self, threads):
        with self.log.lock:
            self.log.active += 1
            self.log.max_active = max(self.log.max_active, self.log.active)
            self.log.started.append(self.name)
        time.sleep(0.05)
        with self.log.lock:
            self.log.active -= 1
            self.log.finished.append(self.name)
        return {"arch": self.name, "threads": threads}


def new_log():
    return types.SimpleNamespace(lock=threading.Lock(), active=0, max_active=0, started=[],
                                 finished=[])


def test_scheduler_runs_two_at_a_time_and_children_after_parents():
    log = new_log()
    rows = [FakeRow("base", None, log), FakeRow("a", None, log), FakeRow("b", None, log),
            FakeRow("derived", "base", log), FakeRow("derived2", "derived", log)]
    done, reused = demo.run_rows(rows, jobs=2, threads=1, rerun=False)
    assert set(done) == {r.name for r in rows} and reused == []
    assert log.max_active == 2
    for child, parent in [("derived", "base"), ("derived2", "derived")]:
        assert log.finished.index(parent) < log.started.index(child)
    assert rows[3].prepared_with == "base" and rows[4].prepared_with == "derived"
    assert all(d["threads"] == 1 for d in done.values())


def test_scheduler_reuses_cached_rows_unless_rerun():
    log = new_log()
    rows = [FakeRow("base", None, log, cache={"arch": "base", "bleu": 1.0}),
            FakeRow("derived", "base", log)]
    done, reused = demo.run_rows(rows, jobs=1, threads=2, rerun=False)
    assert reused == ["base"] and done["base"] == {"arch": "base", "bleu": 1.0}
    assert log.started == ["derived"]
    log = new_log()
    rows = [FakeRow("base", None, log, cache={"arch": "base"}), FakeRow("derived", "base", log)]
    done, reused = demo.run_rows(rows, jobs=1, threads=2, rerun=True)
    assert reused == [] and log.started == ["base", "derived"]


def test_row_key_changes_with_commands_and_parent(tmp_path):
    a = types.SimpleNamespace(out=str(tmp_path), data="/data", max_update=10, lm_max_update=5,
                              seed=1, beam=5)
    base = demo.Row("transformer", demo.DEMO["transformer"], a)
    base.prepare(None)
    child = demo.Row("collab_convert64", demo.DEMO["collab_convert64"], a)
    child.prepare(base)
    key = child.key
    assert "--key-dim" in child.cmds[0] and base.ckpt in child.cmds[0]
    a.max_update = 11  # the parent is retrained -> the derived row must be redone too
    base.prepare(None)
    child.prepare(base)
    assert child.key != key
    assert child.cached() is None  # nothing on disk

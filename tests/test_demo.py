"""scripts/demo/ without training: argument errors, the row scheduler, the row cache, the rows
derived from the registry and the parameter counts; the picture report (scripts/demo/report.py)
from a tiny fake demo run."""
import json
import os
import threading
import time
import types

import pytest
from console_server import SERVERS
from preptest_util import ROOT

from fairseq_attnzoo.cli import collab_reparametrize
from fairseq_attnzoo.cli.archs import zoo_archs
from scripts.demo import config, demo


def run_demo(*args):
    """``python -m scripts.demo.demo ARGS`` from the repository root, forked from its console
    server (tests/console_server.py): (exit code, stdout, stderr)."""
    return SERVERS.run("-m scripts.demo.demo", args, env=os.environ, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--archs", "transformer nosuch"], "unknown demo arch(s) ['nosuch']"),
    (["--archs", "collab_convert64 transformer"],
     "collab_convert64 starts from the checkpoint of transformer: put transformer before it"),
    (["--archs", "transformer", "--lm-archs", "nosuch_lm"], "unknown demo arch(s) ['nosuch_lm']"),
])
def test_bad_arch_lists_fail_in_one_line(args, message):
    code, _, err = run_demo(*args, "--data", "/nonexistent")
    assert code != 0
    assert message in err and "Traceback" not in err


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
    rows = config.mt_rows()
    base = demo.Row("transformer", rows["transformer"], a)
    base.prepare(None)
    child = demo.Row("collab_convert64", rows["collab_convert64"], a)
    child.prepare(base)
    key = child.key
    assert "--key-dim" in child.cmds[0] and base.ckpt in child.cmds[0]
    a.max_update = 11  # the parent is retrained -> the derived row must be redone too
    base.prepare(None)
    child.prepare(base)
    assert child.key != key
    assert child.cached() is None  # nothing on disk


def _fake_run(monkeypatch, tmp_path, *args):
    """``demo.main`` with the rows' training replaced by a finished result and the report by a
    recorder: {"stdout", "report": the folder the report was written to}, files under tmp_path."""
    (tmp_path / "data").mkdir(parents=True)
    (tmp_path / "data" / "dict.de.txt").write_text("")
    result = {"arch": "transformer", "params": 10, "memory_params": 0, "wps": 1.0, "train_s": 2,
              "bleu": 3.0, "chrf": 4.0}
    monkeypatch.setattr(demo, "run_rows", lambda rows, jobs, threads, rerun: (
        {"transformer": result}, []))
    from scripts.demo import report

    written = {}

    def write_report(rows, docs, data, command):
        written["report"] = docs
        return os.path.join(docs, "README.md")

    monkeypatch.setattr(report, "write_report", write_report)
    out = tmp_path / "work"
    demo.main(["--archs", "transformer", "--lm-archs", "none", "--data", str(tmp_path / "data"),
               "--out", str(out), *args])
    return written


def test_a_run_writes_its_results_under_out_and_publishes_only_when_asked(monkeypatch, tmp_path,
                                                                          capsys):
    """``make demo`` rewrote the tracked docs/demo_results.md (and docs/demo/) with this machine's
    speeds: a run writes under --out; --publish writes the tracked pages."""
    published = (tmp_path / "docs" / "demo_results.md", tmp_path / "docs" / "demo")
    monkeypatch.setattr(demo, "PUBLISHED", tuple(str(p) for p in published))
    monkeypatch.setattr(demo, "SPREAD", str(tmp_path / "docs" / "demo.md"))
    assert demo.PUBLISHED != (os.path.join(ROOT, "docs/demo_results.md"),
                              os.path.join(ROOT, "docs/demo"))
    written = _fake_run(monkeypatch, tmp_path)
    out = tmp_path / "work"
    assert "| transformer |" in (out / "demo_results.md").read_text()
    assert written["report"] == str(out / "report") and not published[0].exists()
    written = _fake_run(monkeypatch, tmp_path / "again", "--publish")
    assert "| transformer |" in published[0].read_text()
    # the table says how much its numbers move, and links the measurements (issue 64)
    assert "[demo.md](demo.md#how-much-the-rows-move)" in published[0].read_text()
    assert "[demo.md](../docs/demo.md#how-much-the-rows-move)" in (
        out / "demo_results.md").read_text()
    assert written["report"] == str(published[1])
    assert not (tmp_path / "again" / "work" / "demo_results.md").exists()


# ---- the picture report, from a tiny fake demo run (the sweep's tiny checkpoints) --------------

def _row(out, name, run):
    """A demo row's folder from a tiny fairseq-train run (conftest's ``trained``): its
    checkpoints and its json log, where the demo writes them."""
    run.copy_to(out / name / "checkpoints")
    (out / name / "train.log").write_text("\n".join(run.logs) + "\n")
    return str(out / name / "checkpoints" / "checkpoint_last.pt")


@pytest.mark.slow
def test_report_from_a_tiny_fake_demo_run(mt_data, trained, tmp_path):
    import re

    conv = collab_reparametrize
    out, docs = tmp_path / "work", tmp_path / "docs"
    vanilla = _row(out, "transformer", trained("attnzoo_transformer"))
    _row(out, "transformer_synth_random_dense", trained("transformer_synth_random_dense"))
    _row(out, "transformer_pkm", trained("transformer_pkm"))
    # transformer_aop: no picture, so no checkpoint is read
    _row(out, "adaptive_span_lm_small", trained("adaptive_span_lm"))
    (out / "collab_convert64").mkdir()
    conv.main([vanilla, str(out / "collab_convert64" / "converted.pt"), "--key-dim", "16",
               "--quiet"])
    names = ["transformer", "transformer_synth_random_dense", "transformer_pkm",
             "collab_convert64", "transformer_aop", "adaptive_span_lm_small"]
    results = [{"arch": n, "bleu": 1.5, "chrf": 20.25} for n in names[:-1]]
    results.append({"arch": "adaptive_span_lm_small", "bpc": 5.125})
    (out / "results.json").write_text(json.dumps(results))
    # the command line, in a process of its own (the plotters' imports must not clash with
    # fairseq's --user-dir import of the checkpoints), forked from its console server
    code, stdout, stderr = SERVERS.run("-m scripts.demo.report", ["--out", str(out), "--docs",
                                                                  str(docs), "--data", mt_data],
                                      env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    assert code == 0, stderr[-3000:]
    assert f"report written to {docs / 'README.md'}" in stdout
    text = (docs / "README.md").read_text()
    assert config.make_command(names[:-1], names[-1:]) in text
    for n in names:
        assert f"## {n}\n" in text
    assert "BLEU 1.50, chrF 20.25" in text and "valid bpc 5.125" in text
    pngs = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", text)
    assert sorted(pngs) == sorted([
        "transformer_synth_random_dense_attention.png", "transformer_synth_random_dense_mixture.png",
        "transformer_pkm_usage.png", "collab_convert64_spectrum.png",
        "adaptive_span_lm_small_spans.png"])
    for png in pngs:
        assert (docs / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"encoder.layers.1.ffn: usage \d+\.\d% of 64 slots, KL \d", text)
    assert re.search(r"Components for 90% of the energy, mean over layers: [\d.]+ before, "
                     r"[\d.]+ after", text)
    assert "Final weights: encoder.layers.0.self_attn: random 0." in text
    assert "The baseline" in text.split("## transformer\n")[1].split("##")[0]
    assert "no plotter" in text.split("## transformer_aop")[1]


def test_rows_come_from_the_registry_with_each_methods_flags():
    rows = config.mt_rows()
    assert set(zoo_archs(task="translation")) | {"transformer"} <= set(rows)
    assert set(config.lm_rows()) == set(zoo_archs(task="attnzoo_stream_lm"))
    assert "--synth-max-len 256" in rows["transformer_synth_dense_vanilla"]["flags"]
    assert "--pkm-knn 16" in rows["transformer_pkm"]["flags"]
    assert "--aop-slots 384" in rows["transformer_aop_h16"]["flags"]
    assert rows["attnzoo_transformer"]["flags"] == ""
    assert "--no-layer-spans" in config.lm_rows()["all_attention_lm"]["flags"]


def test_params_count_the_memory_tables_too():
    """fairseq logs the expert-tagged PKM value tables on a line of their own: the demo's params
    are the sum, and the memory part is reported separately."""
    lines = ["[fairseq_cli.train] num. shared model params: 1,179,904 (num. trained: 1,179,904)",
             "[fairseq_cli.train] num. expert model params: 4194304 (num. trained: 4194304)",
             '[train] {"epoch": 1, "train_wps": "2500.5"}']
    assert demo.parse_train(lines) == (5_374_208, 4_194_304, 2500.5)
    assert demo.parse_train(lines[:1]) == (1_179_904, 0, None)
    table = demo.format_table([{"arch": "transformer_pkm", "params": 5_374_208,
                                "memory_params": 4_194_304, "wps": 2500.5, "train_s": 10,
                                "bleu": 1.0, "chrf": 2.0}])
    assert "5,374,208" in table and "4,194,304" in table and "of which memory" in table

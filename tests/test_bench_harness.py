"""The benchmark harness (scripts/bench): every row kind dry-run on the CPU at toy size, the warm /
cold split and the peak-memory path on a fairseq log, the sanity floor, and the generated tables
(``--check`` against the records). The figures themselves come from a GPU (docs/performance.md)."""

import json
import os
import subprocess
import sys

import pytest

from console_server import SERVERS
from zoo_testlib import REPO

STAGES = f"{REPO}/scripts/bench/stages.sh"


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def mt163(tiny_data):
    """Toy translation data of 163 training sentences: not a multiple of fairseq's batch multiple
    (8), so stock fairseq 0.12 drops the last batch of every epoch and the plugin keeps it."""
    return tiny_data("mt", n_train=163)


#: what a train or decode child imports before its work (not the plugin: a child loads it as
#: --user-dir does, test_a_child_imports_the_plugin_only_as_user_dir_does)
CHILD_IMPORTS = ("fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.eval_lm")


@pytest.fixture(autouse=True)
def children_forked(monkeypatch):
    """The harness's children (``python -m scripts.bench.harness --_train ...``, its command line,
    environment and folder as the harness builds them) run through tests/console_server.py: each
    its own process, forked from one that did the child's imports, instead of paying them each."""
    run = subprocess.run

    def forked(cmd, cwd=None, env=None, capture_output=False, text=False, **kwargs):
        if cmd[:3] != [sys.executable, "-m", "scripts.bench.harness"]:
            return run(cmd, cwd=cwd, env=env, capture_output=capture_output, text=text,
                       **kwargs)
        assert capture_output and text and not kwargs, kwargs  # (what harness.child asks)
        code, out, err = SERVERS.run("-m scripts.bench.harness", cmd[3:], env=env or os.environ,
                                     cwd=cwd or os.getcwd(), timeout=600, preload=CHILD_IMPORTS)
        return subprocess.CompletedProcess(cmd, code, out, err)

    monkeypatch.setattr(subprocess, "run", forked)


def _dry(*argv, data_mt, data_lm, out):
    from scripts.bench.harness import main

    main([*argv, "--size", "tiny", "--device", "cpu", "--precision", "bf16", "--repeats", "1",
          "--epochs", "1", "--log-interval", "1", "--data-mt", data_mt, "--data-lm", data_lm,
          "--records", str(out)])
    return _records(out)


def test_a_child_imports_the_plugin_only_as_user_dir_does():
    """A train or decode child runs ``scripts.bench.harness`` and loads the plugin through fairseq's
    ``--user-dir``, which skips a module already imported (and with it the compat table: stock
    --bf16 then asks for a TPU); so importing the harness imports no plugin module (the cases,
    which do, are the parent's alone)."""
    code = ("import sys, scripts.bench.harness; "
            "print(sorted(m for m in sys.modules if m.startswith('fairseq_attnzoo')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_train_rows_in_bf16_both_sides_through_the_same_fairseq(mt163, lm_data, tmp_path, capsys):
    """End to end on the CPU at toy size in bf16 (stock --bf16 asks for a TPU; the plugin, enabled
    in every child as --user-dir enables it, trains it on the CPU): a train row whose baseline and
    arch train the same 163 sentences an epoch (the batch-tail fix on both sides: before, only
    the arch's child applied it), and the A/A control ``--arch transformer``, profiled: 2 warm
    updates of each side, in the record; a profile window the run does not fill is one line (it
    crashed the child with -11: the profiler was never stopped)."""
    out = tmp_path / "r.jsonl"
    _dry("--arch", "transformer_aop", data_mt=mt163, data_lm=lm_data, out=out)
    train, a_a = _dry("--arch", "transformer", "--profile", "2", data_mt=mt163, data_lm=lm_data,
                      out=out)
    assert {k: p["updates"] for k, p in a_a["row"]["profile"].items()} == {
        "baseline": 2, "candidate": 2}
    with pytest.raises(SystemExit, match=r"train failed \(1\)(.|\n)*--profile 50: training ended "
                       "before 50 warm updates were profiled; lower --profile"):
        _dry("--arch", "transformer", "--profile", "50", data_mt=mt163, data_lm=lm_data,
             out=tmp_path / "none.jsonl")
    row = train["row"]
    assert train["case"] == "own/transformer_aop" and row["precision"] == "bf16"
    assert row["sentences"] == row["baseline sentences"] == 163
    assert row["tokens/s"] > 0 and row["baseline tokens/s"] > 0 and row["warm updates"] > 0
    assert row["first pass tokens/s"] > 0 and row["peak GiB"] is None
    assert row["floor"] == "no floor known" and row["baseline drift %"] is None
    assert "floor on this device: none known" in capsys.readouterr().out
    assert a_a["case"] == "own/transformer" and a_a["row"]["sentences"] == 163
    assert a_a["row"]["speed ratio"] > 0
    for r in (train, a_a):
        assert r["gpus"] is None and r["cudnn"] is None and isinstance(r["kernel env"], dict)


def test_kernel_rows_dry_run_with_cold_warm_and_no_cpu_peak(tmp_path, capsys):
    """A kernel row: its first call (cold), the median of the alternating repeats (warm), the
    ratio to its baseline, the roofline share from the device rows of the same run, and a peak
    memory that is "not available" (None) off CUDA, never 0. A peer that is not installed is a
    row that says so. A shape that names its own dtype (the memory layer's parts) runs and is
    recorded in it."""
    from scripts.bench.harness import main

    out = tmp_path / "r.jsonl"
    main(["device", "aop/sublayer-vs-ffn", "pkm/layer-vs-ffn", "pkm/value-read", "pkm/layer-parts",
          "--size", "tiny", "--device", "cpu", "--repeats", "2", "--records", str(out),
          "--only", "MiB", "n 64", "width 1, groups 1", "dense torch", "peer LayerNorm",
          "kernel torch, pass", "dtype fp16, part search backward"])
    rows = {r["case"] + ": " + r["row"]["shape"]: r for r in _records(out)}
    part = [r for k, r in rows.items() if k.startswith("pkm/layer-parts")]
    assert [(r["dtype"], r["row"]["ratio"] > 0) for r in part] == [("fp16", True)]
    aop = next(r for k, r in rows.items() if k.startswith("aop/"))
    assert aop["level"] == "kernel" and aop["device"].startswith("cpu") and aop["command"]
    assert aop["dtype"] == "fp32"  # (the CPU's default --dtype)
    row = aop["row"]
    assert row["cold ms"] > 0 and row["ms"] > 0 and row["ratio"] == pytest.approx(
        row["ms"] / row["baseline ms"])
    assert row["peak MiB"] is None and row["baseline peak MiB"] is None
    read = [r["row"] for k, r in rows.items() if k.startswith("pkm/value-read")]
    assert read and all(r["GB/s"] > 0 and r["% roofline"] > 0 for r in read)
    peer = [r["row"] for k, r in rows.items() if "peer" in k]
    assert peer and all(r.get("skipped", "").startswith("not installed") or r["ms"] > 0
                        for r in peer)
    from scripts.bench.tables import render

    table = render("aop/*", _records(out))
    assert "| n/a | n/a |" in table and "python -m scripts.bench device" in table


def test_aop_rows_time_each_sdpa_backend_and_skip_one_that_cannot_run_in_a_line(tmp_path, capsys):
    """aop/sublayer-vs-ffn's sweep: a backend that runs here is timed against the FFN; one that
    cannot (on a CPU: the memory-efficient kernel) is a printed row that names it and why."""
    from scripts.bench.harness import main

    out = tmp_path / "r.jsonl"
    main(["aop/sublayer-vs-ffn", "--size", "tiny", "--device", "cpu", "--repeats", "1",
          "--records", str(out), "--only", "attention math, groups 2", "attention efficient"])
    rows = {r["row"]["shape"].split(", ")[2]: r["row"] for r in _records(out)}
    assert set(rows) == {"attention math", "attention efficient"}
    assert rows["attention math"]["ratio"] > 0
    skipped = rows["attention efficient"]["skipped"]
    assert skipped.startswith("RuntimeError: AOP's SDPA backend efficient cannot run float32 on")
    assert json.dumps(rows["attention efficient"]) in capsys.readouterr().out


def _fake_log(epochs, per_epoch, interval, wps, wpb=100):
    """fairseq's json log of a run: ``train_inner`` records every ``interval`` updates."""
    lines, n = [], 0
    for epoch in range(1, epochs + 1):
        for _ in range(per_epoch):
            n += 1
            if n % interval == 0:
                rec = {"epoch": epoch, "num_updates": n, "wps": wps(epoch, n), "wpb": wpb}
                lines.append(f"2026-11-25 | INFO | train_inner | {json.dumps(rec)}")
    return "\n".join(lines)


def test_train_timing_is_warm_shapes_only_with_the_training_peak(monkeypatch):
    """Speed only from epoch 2 on (epoch 1 sees every batch shape for the first time; the first
    interval of epoch 2 holds epoch 1's tail), the first pass as columns of its own; the peak is
    the largest per-update CUDA peak of the timed updates, not a reading after training (fairseq
    resets the peak every update: the child prints each one)."""
    from scripts.bench import harness

    # (fairseq logs its first interval at wps 0: its first update has no rate)
    log = _fake_log(3, 10, 2, lambda epoch, n: 0 if n == 2 else 500 if epoch == 1 else 1000 + n)
    peaks = [9 * 2**30] * 10 + [2**30] * 20
    peaks[24] = 3 * 2**30  # update 25, in epoch 3
    monkeypatch.setattr(harness, "fairseq_train", lambda *a, **k: log + "\n" + harness.PEAKS_TAG
                        + " " + json.dumps(peaks) + "\n")
    a = type("A", (), dict(epochs=2, updates=0, log_interval=2, profile=0, precision="fp16",
                           device="cuda", size="paper", gpus=1))
    r = harness.timed_run(harness.Side(""), [], "data", a, "epoch", 1)
    # epoch 2's intervals end at updates 12..20 (12 dropped), epoch 3's at 22..30: 9 of 2
    assert r["tokens/s"] == 1000 + 22 and r["warm updates"] == 18
    assert r["first pass tokens/s"] == pytest.approx(500)
    assert r["first pass extra s"] == pytest.approx(8 * 100 / 500 - 8 * 100 / (1000 + 22),
                                                    rel=0.05)
    assert r["peak GiB"] == 3  # not epoch 1's 9, not the last update's 1
    monkeypatch.setattr(harness, "fairseq_train", lambda *a, **k: log)  # the CPU: no peaks
    assert harness.timed_run(harness.Side(""), [], "data", a, "epoch", 1)["peak GiB"] is None
    monkeypatch.setattr(harness, "fairseq_train", lambda *a, **k: _fake_log(1, 10, 2,
                                                                            lambda e, n: 1))
    with pytest.raises(SystemExit, match="too few to time warm shapes"):
        harness.timed_run(harness.Side(""), [], "data", a, "epoch", 1)


def test_a_baseline_below_its_floor_marks_the_table_suspect_and_is_profiled(monkeypatch, capsys):
    """The baseline runs first and is printed beside the stock model's expected range on that
    device class (with its source); below it, the record and the generated table say suspect, and
    one more baseline run profiles its warm updates (the record keeps the profile). Alternating
    repeats give the ratio and the baseline's drift; a drift over 5 % marks the row noisy."""
    from scripts.bench import harness
    from scripts.bench.cases import own_arch
    from scripts.bench.tables import render

    speeds = iter([40_000, 0, 60_000, 70_000, 44_000])  # baseline, profiled, arch, arch, baseline
    order = []

    def fake_run(side, common, data, a, warm, seed, profile=0):
        order.append(("transformer_aop" if "transformer_aop" in str(side.flags)
                      else "transformer") + (f" profiled {profile}" if profile else ""))
        return {"tokens/s": float(next(speeds)), "first pass tokens/s": 1.0,
                "first pass extra s": 2.0, "peak GiB": 4.0, "warm updates": 9, "sentences": 163,
                "profile": {"updates": profile, "wall ms per update": 90.0, "busy %": 15.0,
                            "top": [["aten::mm", 200, 3.0, 19.0]]} if profile else None}

    monkeypatch.setattr(harness, "timed_run", fake_run)
    a = type("A", (), dict(size="paper", precision="bf16", repeats=2, data_mt="d", seed=1,
                           profile=0, profile_below_floor=20, gpus=1, device="cuda"))
    records = []
    harness.run_train(own_arch("transformer_aop", ""), a, "NVIDIA H100 80GB HBM3",
                      lambda c, row: records.append(row))
    assert order == ["transformer", "transformer profiled 20", "transformer_aop",
                     "transformer_aop", "transformer"]
    out = capsys.readouterr().out
    assert "baseline: 40,000 tokens/s warm; floor on this device: 100,000" in out
    assert "fairseq#940" in out and "BELOW: suspect" in out
    row = records[0]
    assert row["suspect"] and row["speed ratio"] == pytest.approx(65_000 / 42_000)
    assert row["baseline drift %"] == pytest.approx(10.0) and row["memory ratio"] == 1.0
    assert row["noisy"] and row["profile"]["baseline"]["busy %"] == 15.0
    record = {"case": "own/transformer_aop", "level": "train", "device": "H100", "size": "paper",
              "dtype": "bf16", "run": "r", "commit": "c", "torch": "t", "cuda": "13",
              "command": "python -m scripts.bench --arch transformer_aop", "row": row}
    table = render("own/*", [record])
    assert "**Suspect**" in table and "**Noisy**" in table
    assert "profile of the baseline" in table and "GPU busy 15 %" in table


def test_a_kernel_environment_is_its_own_table_never_a_replacement():
    """A run under a kernel-selecting variable (cuDNN attention off) is recorded with it and shown
    beside the default run, not in its place; a build-only variable changes nothing."""
    from scripts.bench.harness import kernel_env
    from scripts.bench.tables import render

    assert kernel_env({"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1", "HOME": "/root",
                       "TORCH_CUDA_ARCH_LIST": "9.0a"}) == {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
    base = {"case": "aop/sublayer-vs-ffn", "level": "kernel", "device": "H100", "size": "paper",
            "dtype": "bf16", "run": "r", "commit": "c", "torch": "t", "cuda": "13",
            "command": "python -m scripts.bench aop/sublayer-vs-ffn",
            "kernel env": {"TORCH_CUDA_ARCH_LIST": "9.0a"}, "row": {"shape": "s", "ms": 1.0}}
    off = dict(base, **{"kernel env": {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}},
               row={"shape": "s", "ms": 2.0})
    table = render("aop/*", [base, off])
    assert "| s | 1.000 |" in table and "| s | 2.000 |" in table
    assert table.count("environment `TORCH_CUDNN_SDPA_DEPRIORITIZED=1`") == 1


def test_own_arch_with_flags_is_a_row_of_its_own():
    """``--arch transformer --flags ...`` (e.g. the host-bound stage's 4x batch) is a labelled row,
    so it sits beside the plain A/A row instead of replacing it in the table."""
    from scripts.bench.cases import own_arch
    from scripts.bench.tables import identity

    plain, batch = own_arch("transformer", ""), own_arch("transformer", "--max-tokens=32768")
    assert list(plain.candidate) == [""]
    assert list(batch.candidate) == ["transformer --max-tokens=32768"]
    assert batch.candidate["transformer --max-tokens=32768"].flags["paper"].endswith(
        "--arch transformer --max-tokens=32768")
    record = {"case": "own/transformer", "device": "H100", "size": "paper", "dtype": "bf16"}
    assert identity(dict(record, row={"precision": "bf16"})) != identity(
        dict(record, row={"run": "transformer --max-tokens=32768", "precision": "bf16"}))


def test_user_errors_are_one_line():
    """fp16 on the CPU and a plugin-off side in bf16 (stock --bf16 asks for a TPU) are refused
    in one line each, naming what to pass instead."""
    from scripts.bench import harness

    with pytest.raises(SystemExit, match="fp16 does not train on the CPU.*--precision bf16"):
        harness.main(["device", "--device", "cpu", "--precision", "fp16",
                      "--records", ""])
    a = type("A", (), dict(size="paper", precision="bf16", epochs=1, log_interval=1, device="cpu",
                           gpus=1))
    with pytest.raises(SystemExit, match="plugin-off side cannot train in bf16.*fp16 or fp32"):
        harness.timed_run(harness.Side("--arch transformer", plugin=False), [], "d", a, "epoch", 1)


@pytest.mark.slow
def test_quality_and_decode_rows_dry_run(mt163, lm_data, tmp_path):
    """A quality row in bf16 (valid loss at equal updates) and decode rows (fairseq-generate of
    an arch's checkpoint against the transformer's, warm, with the precision it ran: the decoding
    tools have no bf16 path, the CPU decodes fp32)."""
    out = tmp_path / "r.jsonl"
    _dry("pkm/memory-lm", "--only", "dense (attnzoo", data_mt=mt163, data_lm=lm_data, out=out)
    quality, decode = _dry("translation/decode", "--only", "synth_random", "beam 1",
                           data_mt=mt163, data_lm=lm_data, out=out)
    assert quality["row"]["run"] == "dense (attnzoo_lm)" and quality["row"]["precision"] == "bf16"
    assert quality["row"]["updates"] == 4 and 0 < quality["row"]["valid loss"] < 20
    assert decode["case"] == "translation/decode" and decode["level"] == "decode"
    d = decode["row"]
    assert d["run"] == "transformer_synth_random, beam 1" and d["precision"] == "fp32"
    assert d["tokens/s"] > 0 and d["sentences/s"] > 0 and d["baseline tokens/s"] > 0


@pytest.mark.slow
def test_fsdp_rows_dry_run_pytorch_ddp_and_say_fully_sharded_needs_cuda(lm_data, tmp_path):
    """Stage fsdp's rows on the CPU (fairscale's FSDP runs on CUDA only): the pytorch_ddp side
    trains, with the one-process group both sides initialise, and the fully_sharded side is a
    record that says it needs CUDA (docs/pkm.md, "Which --ddp-backend")."""
    from scripts.bench.harness import main

    out = tmp_path / "r.jsonl"
    main(["pkm/fsdp-lm", "--size", "tiny", "--device", "cpu", "--precision", "fp32",
          "--data-lm", lm_data, "--records", str(out)])
    rows = {r["row"]["run"]: r["row"] for r in _records(out)}
    assert rows["transformer_lm_pkm, fully_sharded"]["skipped"] == "needs CUDA", rows
    assert 0 < rows["transformer_lm_pkm, pytorch_ddp"]["valid loss"] < 20, rows


def test_the_docs_tables_are_the_records(tmp_path):
    """``python -m scripts.bench.tables --check`` passes on the docs as committed, and fails on a
    table that no longer says what the records say."""
    from scripts.bench import tables

    assert tables.main(["--check"]) == 0
    doc = tmp_path / "performance.md"
    text = open(tables.DOCS[0]).read()
    assert "<!-- bench: pkm/memory-lm -->" in text
    doc.write_text(text.replace("<!-- bench: pkm/memory-lm -->\n",
                                "<!-- bench: pkm/memory-lm -->\n| a figure copied by hand |\n"))
    assert tables.main(["--check", str(doc)]) == 1
    assert tables.main([str(doc)]) == 0 and doc.read_text() == text


def test_every_case_has_a_tiny_size_every_stage_parses_and_the_harness_stays_small(capsys):
    """Every row kind dry-runs at ``--size tiny``; every call of every stage of the offline
    driver names cases that exist and parses, and its count of fairseq processes (what a GPU
    visit's time is planned by) is printed; the Python harness stays within its line budget."""
    import glob
    import os
    import re
    import shlex

    from scripts.bench.cases import CASES
    from scripts.bench.harness import Kernel, main

    text = open(STAGES).read()
    stages = dict(re.findall(r'\[([\w-]+)\]="([^"]+)"', text))
    assert len(stages) >= 10 and set(stages) == set(re.search(
        r"ORDER=\(([^)]*)\)", text).group(1).split())
    for name, calls in stages.items():
        for call in calls.split(";"):
            assert main([*shlex.split(call), "--count"]) == 0, (name, call)
    counts = capsys.readouterr().out
    assert "baseline/mt-transformer: 4 fairseq processes" in counts
    assert "own/transformer: 2 fairseq processes" in counts  # (the A/A control)
    assert "translation/train: 4 fairseq processes" in counts  # (the baseline, synth x3)

    assert {c.level for c in CASES} == {"kernel", "train", "decode", "quality"}
    for c in CASES:
        if isinstance(c, Kernel):
            assert c.shapes["tiny"], c.name
    files = glob.glob(os.path.join(REPO, "scripts", "bench", "*.py"))
    assert sum(len(open(f).readlines()) for f in files) <= 1668


def _stages(*args, unset=(), **env):
    """``bash scripts/bench/stages.sh ARGS`` with this environment but ``unset``, plus ``env``."""
    import os
    import subprocess

    return subprocess.run(["bash", STAGES, *args], capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if k not in unset}, **env})


def _stand_in(bin_dir, name, body):
    """A program ``name`` in ``bin_dir`` (made if need be): a shell script of ``body``."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)


def test_a_dry_run_has_no_visit_budget_unless_named(tmp_path):
    """``DRY=1`` checks a plan on the CPU, where a train stage's toy runs take minutes each (the
    five of mt-bf16-rest: about 12 on two cores): a visit's 480 s must not cut it off with no
    records; ``STAGE_SECONDS`` still bounds it. The limit is read off a stand-in ``timeout``."""
    _stand_in(tmp_path / "bin", "timeout", 'echo "limit $1"')
    # the venv's python, which imports fairseq (a symlink would lose the venv's site-packages)
    _stand_in(tmp_path / "bin", "python", f'exec {sys.executable} "$@"')

    def limits(**env):
        run = _stages("run", str(tmp_path / "records.jsonl"), "kernels", unset=["STAGE_SECONDS"],
                      DRY="1", VENV=str(tmp_path), **env)
        assert run.returncode == 0, run.stderr
        return [int(line.split()[1]) for line in run.stdout.splitlines()
                if line.startswith("limit ")]

    assert min(limits()) > 3600
    assert max(limits(STAGE_SECONDS="5")) <= 5


def test_stages_without_an_install_say_so_in_one_line(tmp_path):
    """Where the node's python cannot import torch and fairseq (nothing installed into ``SITE``),
    ``stages.sh`` says so once and exits 2, instead of a traceback from every harness call. The
    python is a stand-in that imports nothing."""
    _stand_in(tmp_path / "bin", "python3", "exit 1")
    for args in (["plan"], ["run", str(tmp_path / "records.jsonl"), "kernels"]):
        run = _stages(*args, unset=["DRY"], SITE=str(tmp_path))
        assert run.returncode == 2 and run.stdout == "", args
        assert run.stderr.count("\n") == 1 and "install_offline.sh" in run.stderr, run.stderr
        assert not (tmp_path / "records.jsonl").exists()

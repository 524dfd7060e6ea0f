"""The benchmark harness (scripts/bench): every row kind dry-run on the CPU at toy size, the warm /
cold split and the peak-memory path on a fairseq log, the sanity floor, and the generated tables
(``--check`` against the records). The figures themselves come from a GPU (docs/performance.md)."""

import json

import pytest

from zoo_testlib import REPO


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kernel_rows_dry_run_with_cold_warm_and_no_cpu_peak(tmp_path, capsys):
    """A kernel row: its first call (cold), the median of the alternating repeats (warm), the
    ratio to its baseline, the roofline share from the device rows of the same run, and a peak
    memory that is "not available" (None) off CUDA, never 0. A peer that is not installed is a
    row that says so."""
    from scripts.bench.harness import main

    out = tmp_path / "r.jsonl"
    main(["device", "aop/sublayer-vs-ffn", "pkm/layer-vs-ffn", "pkm/value-read", "--size", "tiny",
          "--device", "cpu", "--repeats", "2", "--records", str(out),
          "--only", "MiB", "n 64", "groups 1", "dense torch", "peer LayerNorm", "kernel torch, pass"])
    rows = {r["case"] + ": " + r["row"]["shape"]: r for r in _records(out)}
    aop = next(r for k, r in rows.items() if k.startswith("aop/"))
    assert aop["level"] == "kernel" and aop["device"].startswith("cpu") and aop["command"]
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
                           device="cuda"))
    r = harness.timed_run([], "data", a, "epoch", 1)
    # epoch 2's intervals end at updates 12..20 (12 dropped), epoch 3's at 22..30: 9 of 2
    assert r["tokens/s"] == 1000 + 22 and r["warm updates"] == 18
    assert r["first pass tokens/s"] == pytest.approx(500)
    assert r["first pass extra s"] == pytest.approx(8 * 100 / 500 - 8 * 100 / (1000 + 22),
                                                    rel=0.05)
    assert r["peak GiB"] == 3  # not epoch 1's 9, not the last update's 1
    monkeypatch.setattr(harness, "fairseq_train", lambda *a, **k: log)  # the CPU: no peaks
    assert harness.timed_run([], "data", a, "epoch", 1)["peak GiB"] is None
    monkeypatch.setattr(harness, "fairseq_train", lambda *a, **k: _fake_log(1, 10, 2,
                                                                            lambda e, n: 1))
    with pytest.raises(SystemExit, match="too few to time warm shapes"):
        harness.timed_run([], "data", a, "epoch", 1)


def test_a_baseline_below_its_floor_marks_the_table_suspect(monkeypatch, capsys):
    """The baseline runs first and is printed beside the stock model's expected range on that
    device class (with its source); below it, the record and the generated table say suspect.
    Alternating repeats give the ratio and the baseline's drift."""
    from scripts.bench import harness
    from scripts.bench.cases import CASES
    from scripts.bench.tables import render

    speeds = iter([40_000, 60_000, 70_000, 44_000])  # baseline, arch, arch, baseline
    order = []

    def fake_run(flags, data, a, warm, seed):
        order.append("transformer_aop" if "transformer_aop" in flags else "transformer")
        return {"tokens/s": float(next(speeds)), "first pass tokens/s": 1.0,
                "first pass extra s": 2.0, "peak GiB": 4.0, "warm updates": 9, "profile": None}

    monkeypatch.setattr(harness, "timed_run", fake_run)
    case = next(c for c in CASES if c.name == "mt-transformer_aop")
    a = type("A", (), dict(size="paper", precision="bf16", repeats=2, data_mt="d", seed=1))
    records = []
    harness.run_train(case, a, "NVIDIA H100 80GB HBM3", lambda c, row: records.append(row))
    assert order == ["transformer", "transformer_aop", "transformer_aop", "transformer"]
    out = capsys.readouterr().out
    assert "baseline: 40,000 tokens/s warm; floor on this device: 100,000" in out
    assert "fairseq#940" in out and "BELOW: suspect" in out
    row = records[0]
    assert row["suspect"] and row["speed ratio"] == pytest.approx(65_000 / 42_000)
    assert row["baseline drift %"] == pytest.approx(10.0) and row["memory ratio"] == 1.0
    record = {"case": "aop/mt-transformer_aop", "level": "train", "device": "H100", "size":
              "paper", "dtype": "bf16", "run": "r", "commit": "c", "torch": "t", "cuda": "13",
              "command": "python -m scripts.bench aop", "row": row}
    assert "**Suspect**" in render("aop/*", [record])


@pytest.mark.slow
def test_train_and_quality_rows_dry_run(mt_data, lm_data, tmp_path, capsys):
    """End to end on the CPU at toy size: a train row (baseline and arch alternating, real
    fairseq-train children, the warm / cold split, peak "n/a") and a quality row (valid loss at
    equal updates, one record per run and seed)."""
    from scripts.bench.harness import main

    out = tmp_path / "r.jsonl"
    main(["aop/mt-transformer_aop", "pkm/memory-lm", "--size", "tiny", "--device", "cpu",
          "--repeats", "1", "--epochs", "1", "--log-interval", "1", "--data-mt", mt_data,
          "--data-lm", lm_data, "--only", "dense (attnzoo", "--records", str(out)])
    train, quality = _records(out)
    row = train["row"]
    assert train["case"] == "aop/mt-transformer_aop" and row["precision"] == "fp32"
    assert row["tokens/s"] > 0 and row["baseline tokens/s"] > 0 and row["warm updates"] > 0
    assert row["first pass tokens/s"] > 0 and row["peak GiB"] is None and row["floor"] is None
    assert "floor on this device: none known" in capsys.readouterr().out
    assert quality["row"]["run"] == "dense (attnzoo_lm)" and quality["row"]["updates"] == 4
    assert 0 < quality["row"]["valid loss"] < 20 and quality["row"]["params"] > 0


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


def test_every_case_has_a_tiny_size_and_the_harness_stays_small():
    """Every row kind dry-runs at ``--size tiny``; every stage of the offline driver names cases
    that exist; scripts/bench stays within its line budget."""
    import glob
    import os
    import subprocess

    from scripts.bench.cases import CASES
    from scripts.bench.harness import Kernel, select

    plan = subprocess.run(["bash", os.path.join(REPO, "scripts", "bench", "stages.sh"), "plan"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(plan) >= 10
    for line in plan:
        assert select(line.split(": ", 1)[1].split()), line

    assert {c.level for c in CASES} == {"kernel", "train", "quality"}
    for c in CASES:
        if isinstance(c, Kernel):
            assert c.shapes["tiny"], c.name
    files = glob.glob(os.path.join(REPO, "scripts", "bench", "*.*"))
    assert sum(len(open(f).readlines()) for f in files) <= 1500


def test_host_syncs_are_counted_as_they_would_be_on_cuda():
    """The ``host syncs`` column: what would make the host wait for a GPU, counted on the CPU: a
    device value read back, an output sized by the data, boolean-mask indexing. Reading a tensor
    that would stay on the host there (a shape, ``torch.tensor(...)``) is no sync."""
    import torch

    from scripts.bench.syncs import HostTensors

    syncs = []

    def count(func, sync):
        if sync:
            syncs.append(func.overloadpacket.__name__)

    x = torch.randn(5, 3)
    with HostTensors().counting(count):
        bool(x.sum() > 0)
        x[x > 0]
        (x > 0).nonzero()
        torch.bincount(torch.tensor([1, 2]).to(x.device) * (x[0, 0] > 0).long())
        x.repeat_interleave(2, dim=0)
        shape = torch._shape_as_tensor(x)
        int(shape[0]) + int(torch.tensor(3)) + int(torch.tensor(3) * 2)
        x.view(int(shape[0]), -1).argmax().item()
    assert syncs == ["_local_scalar_dense", "index", "nonzero", "bincount", "_local_scalar_dense"]

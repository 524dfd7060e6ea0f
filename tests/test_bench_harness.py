"""The paper-size GPU benchmark's harness (scripts/bench/bench_paper_size.py), dry-run on the CPU:
the timed rows and the torch.profiler tables are written (the GPU figures come from a GPU session;
docs/gpu.md)."""

import math
import types

import pytest

from zoo_testlib import REPO


def test_profile_table_ranks_ops_by_self_time_per_step():
    from scripts.bench.bench_paper_size import profile_table

    ev = types.SimpleNamespace
    events = [ev(key="aten::topk", count=3, self_cpu_time_total=1000.0),
              ev(key="aten::mm", count=6, self_cpu_time_total=3000.0),
              ev(key="forward", count=3, self_cpu_time_total=9000.0, is_user_annotation=True),
              ev(key="ProfilerStep#7", count=1, self_cpu_time_total=9000.0)]
    lines = profile_table(events, steps=3, cuda=False).splitlines()
    assert lines[0] == "total self CPU time of the ops per step: 1.33 ms"
    assert lines[4:] == ["| `aten::mm` | 2 | 1.000 | 75.0 % |",
                         "| `aten::topk` | 1 | 0.333 | 25.0 % |"]


def test_cuda_profile_table_counts_each_kernel_once_and_no_ranges():
    """On the GPU fairseq's record_function ranges ("forward", "train_step-N") carry the device
    time of every kernel inside them, and each kernel also appears as its own event: the table
    ranks the operators only (the first GPU profile listed the ranges on top, at 3x the step)."""
    from scripts.bench.bench_paper_size import profile_table

    ev = types.SimpleNamespace
    events = [ev(key="aten::mm", count=4, self_device_time_total=2000.0, device_type="DeviceType.CPU"),
              ev(key="sm90_xmma_gemm_bf16", count=4, self_device_time_total=2000.0,
                 device_type="DeviceType.CUDA"),
              ev(key="aten::topk", count=2, self_device_time_total=500.0, device_type="DeviceType.CPU"),
              ev(key="train_step-6", count=1, self_device_time_total=2500.0, is_user_annotation=True,
                 device_type="DeviceType.CUDA"),
              ev(key="ProfilerStep*", count=1, self_device_time_total=7000.0, device_type="DeviceType.CPU")]
    lines = profile_table(events, steps=2, cuda=True, wall_ms=40.0).splitlines()
    assert lines[0] == ("total self CUDA time of the ops per step: 1.25 ms; wall time per step: "
                        "40.00 ms")
    assert lines[4:] == ["| `aten::mm` | 2 | 1.000 | 80.0 % |",
                         "| `aten::topk` | 1 | 0.250 | 20.0 % |"]


@pytest.mark.slow
def test_tiny_dry_run_writes_rows_and_profiles(lm_data, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "paper_size.md"
    cmd = [sys.executable, "-m", "scripts.bench.bench_paper_size", "--size", "tiny", "--device",
           "cpu", "--groups", "lm", "--archs", "transformer_lm_pkm", "--precisions", "fp32",
           "--updates", "6", "--repeats", "1", "--profile", "--profile-wait", "2",
           "--profile-steps", "2", "--data-lm", lm_data, "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| lm | fp32 | "))
    assert "failed" not in row and "transformer_lm_pkm" in row, row
    for arch in ("transformer_lm", "transformer_lm_pkm"):
        assert f"#### Profile: lm, fp32, {arch} (2 updates after 2)" in text
    assert text.count("| `aten::") >= 10  # the ops of both profiles
    assert "aten::topk" in text.split("transformer_lm_pkm (2 updates")[1]  # the memory's search


def test_host_syncs_are_counted_as_they_would_be_on_cuda():
    """``--count-ops`` runs on the CPU but counts what would make the host wait for a GPU: a
    device value read back, an output sized by the data, boolean-mask indexing. Reading a tensor
    that would stay on the host there (a shape, ``torch.tensor(...)``) is no sync."""
    import torch

    from scripts.bench.bench_paper_size import HostTensors

    syncs = []

    def count(func, sync):
        if sync:
            syncs.append(func.overloadpacket.__name__)

    x = torch.randn(5, 3)
    with HostTensors().counting(count):
        assert not syncs
        bool(x.sum() > 0)  # device -> host: a sync
        x[x > 0]  # boolean-mask indexing: a nonzero inside
        (x > 0).nonzero()
        torch.bincount(torch.tensor([1, 2]).to(x.device) * (x[0, 0] > 0).long())
        x.repeat_interleave(2, dim=0)  # the size is known: no sync
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1], device=x.device), dim=0,
                            output_size=6)
        shape = torch._shape_as_tensor(x)  # fairseq's positional embedding
        int(shape[0]) + int(torch.tensor(3)) + int(torch.tensor(3) * 2)
        x.view(int(shape[0]), -1).argmax().item()  # a device value again
    assert syncs == ["_local_scalar_dense", "index", "nonzero", "bincount", "_local_scalar_dense"]


def _lm_pkm_harness_run(lm_data, tmp_path, *mode):
    """``bench_paper_size`` in a child process at toy size on the CPU, the LM group with
    ``transformer_lm_pkm`` in fp32, one update waited for, in ``mode``; returns the report path."""
    import subprocess
    import sys

    out = tmp_path / "report.md"
    cmd = [sys.executable, "-m", "scripts.bench.bench_paper_size", "--size", "tiny", "--device",
           "cpu", "--groups", "lm", "--archs", "transformer_lm_pkm", "--precisions", "fp32",
           "--profile-wait", "1", "--data-lm", lm_data, "--out", str(out), *mode]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_count_ops_counts_what_each_update_dispatches(lm_data, tmp_path):
    """``--count-ops``: a row per model with the aten ops one update dispatches (forward, backward,
    optimizer), its views and host reads; the memory layer dispatches more than the plain LM."""
    out = _lm_pkm_harness_run(lm_data, tmp_path, "--count-ops", "--profile-steps", "1")
    rows = {line.split(" | ")[2]: line.split(" | ")[3:7] for line in out.read_text().splitlines()
            if line.startswith("| lm | fp32 | ")}
    assert set(rows) == {"transformer_lm", "transformer_lm_pkm"}, rows
    ops = {arch: [float(v.replace(",", "")) for v in row] for arch, row in rows.items()}
    for total, views, launches, reads in ops.values():
        assert total > 300 and 0 < views < total and 0 < launches < total - views and reads >= 1
    assert ops["transformer_lm_pkm"][0] > ops["transformer_lm"][0]
    # where they differ, by sublayer: the memory in place of one layer's fc1-ReLU-fc2
    sublayers = {line.split(" | ")[1]: line.rstrip(" |").split(" | ")[2:] for line in
                 out.read_text().splitlines() if line.startswith("| transformer_lm_pkm | ")}
    fwd, bwd, base_fwd, base_bwd, diff = sublayers["decoder.ffn"][:5]
    assert float(fwd) > 10 and float(bwd) > 10 and float(base_fwd) == float(base_bwd) == 0
    assert float(sublayers["decoder.fc1"][0]) < float(sublayers["decoder.fc1"][2])
    assert float(sublayers["all"][4].replace(",", "")) > 0


@pytest.mark.slow
def test_a_runbook_call_runs_dry_on_the_cpu(mt_data, tmp_path):
    """``DRY=1 bash scripts/bench/gpu_checks.sh paper OUT mt``: a GPU runbook call's flags and
    stages run here at toy size (fp32 standing in for fp16), so a loan does not find a broken
    call; a stage that prints no timed rows (a profile-only run) still succeeds, so that the
    next command of the same call runs."""
    import os
    import subprocess

    script = os.path.join(REPO, "scripts", "bench", "gpu_checks.sh")
    env = {**os.environ, "DRY": "1", "PRECISIONS": "fp16", "BASELINE": "bracket",
           "UPDATES": "4", "PROFILE": "", "ARCHS": "transformer_aop", "TIMEOUT": "300",
           "BENCH_FLAGS": f"--data-mt {mt_data} --valid-steps 2 "
                          "--variant transformer_aop:--aop-token-bucket=16"}
    run = subprocess.run(["bash", script, "paper", str(tmp_path), "mt"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "paper rc 0" in run.stdout, run.stdout + run.stderr
    rows = [line.split(" | ")[:3] for line in (tmp_path / "paper_size.md").read_text().splitlines()
            if line.startswith("| mt | ")]
    assert rows == [["| mt", "fp32", "transformer_aop"],
                    ["| mt", "fp32", "transformer_aop:--aop-token-bucket=16"]]
    env.update(PROFILE="--profile-only", BENCH_FLAGS=f"--data-mt {mt_data} --profile-wait 1 "
               "--profile-steps 1")
    out = tmp_path / "profiles"  # (a report of its own: no timed rows in it)
    run = subprocess.run(["bash", script, "paper", str(out), "mt"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "#### Profile: mt, fp32, transformer_aop" in (
        out / "paper_size.md").read_text(), run.stdout + run.stderr


def test_step_phases_give_each_update_the_host_time_of_its_phases(monkeypatch):
    """``--host-time``: the time between two phase changes is the earlier phase's, summed per
    update; each update starts and ends in "rest" (the optimizer and the trainer)."""
    from scripts.bench import bench_paper_size as bps

    clock = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 100.0, 100.5, 101.5])
    monkeypatch.setattr(bps.time, "perf_counter", lambda: next(clock))
    phases = bps.StepPhases()
    phases.start()  # 0: the trainer
    phases.enter("forward")  # 1
    phases.enter("backward")  # 3 (fairseq's task runs the backward inside its train_step)
    phases.enter("forward")  # 6
    phases.enter("rest")  # 10
    phases.stop()  # 15
    assert phases.updates == [{"rest": 1.0 + 5.0, "forward": 2.0 + 4.0, "backward": 3.0}]
    phases.start()  # 100
    phases.enter("forward")  # 100.5
    phases.stop()  # 101.5
    assert phases.updates[1] == {"rest": 0.5, "forward": 1.0}


def test_a_failed_host_time_run_is_reported_with_its_error_as_it_is():
    """A run's error text (a traceback's last lines, often holding a dict or a set) goes into its
    row verbatim: it used to be formatted again with the precision, where a brace in it raised."""
    from scripts.bench.bench_paper_size import host_time_row

    error = "KeyError: {'update': 1}"
    row = host_time_row("mt", "bf16", "transformer_pkm", {"error": error}, {"update": 2.0})
    assert row == f"| mt | bf16 | transformer_pkm | failed: {error} |"


@pytest.mark.slow
def test_host_time_rows_time_each_arch_against_the_baseline_before_and_after(lm_data, tmp_path):
    """``--host-time``: the baseline, each arch, the baseline again (the drift), each row the
    median host milliseconds of an update and its phases, and the baseline's time over the
    arch's."""
    text = _lm_pkm_harness_run(lm_data, tmp_path, "--host-time", "--profile-steps", "3"
                               ).read_text()
    rows = [line.split(" | ")[2:] for line in text.splitlines() if line.startswith("| lm | fp32 |")]
    assert [row[0] for row in rows] == ["transformer_lm", "transformer_lm_pkm"]
    for arch, total, fwd, bwd, rest, base, ratio in rows:
        total, fwd, bwd, rest, base = map(float, (total, fwd, bwd, rest, base))
        assert min(fwd, bwd, rest) > 0 and max(fwd, bwd, rest) <= total  # (each update's)
        assert float(ratio.rstrip(" |")) == pytest.approx(base / total, rel=0.01)
    assert rows[0][6] == "1.000 |" and "an update before the rows above" in text


def test_ops_are_attributed_to_their_sublayer_in_forward_and_backward():
    """``--count-ops`` splits each phase's ops by the sublayer they run for, summed over layers:
    a forward op by the innermost module running, a backward op by the module whose forward made
    the autograd node (nodes that a module inside claimed stay that module's)."""
    import torch
    import torch.nn as nn
    from collections import Counter
    from torch.utils._python_dispatch import TorchDispatchMode

    from scripts.bench.bench_paper_size import ModuleAttribution, sublayer_of

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x.tanh())))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 4)
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            x = self.embed(x) * 2
            for layer in self.layers:
                x = layer(x)
            return x

    ops = Counter()
    attribution = ModuleAttribution()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
                ops[phase, sublayer_of(attribution.current()),
                    func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model = Model()
    x = torch.randn(5, 3)
    with attribution, Ops():
        model(x).sum().backward()
    assert sublayer_of("TransformerModel.encoder.layers.3.self_attn.q_proj") == "encoder.self_attn"
    assert sublayer_of("TransformerModel.decoder.layers.0") == "decoder.layer"
    assert sublayer_of("TransformerModel.decoder.embed_tokens") == "decoder.embed_tokens"
    assert sublayer_of("Model") == "Model"
    forward = {(m, op): n for (phase, m, op), n in ops.items() if phase == "forward"}
    backward = {(m, op): n for (phase, m, op), n in ops.items() if phase == "backward"}
    assert forward == {("embed", "addmm"): 1, ("Model", "mul"): 1, ("layer", "tanh"): 2,
                       ("fc1", "addmm"): 2, ("layer", "relu"): 2, ("fc2", "addmm"): 2,
                       ("layer", "add"): 2,
                       # outside the model: the loss, and the backward's seed
                       ("trainer", "sum"): 1, ("trainer", "ones_like"): 1}, forward
    # every gradient op is its module's: the products' to the linears, tanh's and ReLU's to the
    # layer, the embedding's scaling to the model (nothing left to an unclaimed node's name)
    assert {m for m, _ in backward} == {"Model", "embed", "fc1", "fc2", "layer"}, backward
    assert backward["layer", "tanh_backward"] == 2 and backward["layer", "threshold_backward"] == 2
    assert backward["fc1", "mm"] == 4 and backward["fc2", "mm"] == 4


def test_kernel_benchmark_dry_run_writes_every_stage(tmp_path):
    """scripts/bench/bench_kernels.py at toy shapes on the CPU: every stage's table is written,
    with a Triton row beside each PyTorch row where Triton is installed (interpreted here)."""
    from fairseq_attnzoo.modules import pkm_triton
    from scripts.bench import bench_kernels

    out = tmp_path / "kernels.md"
    bench_kernels.main(["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--repeats", "1",
                        "--out", str(out)])
    text = out.read_text()
    for title in ("copy bandwidth", "pkm_read", "pkm_tune d 32", "pkm_layer", "aop", "span",
                  "synth_gather", "synth_tables", "sdpa_shapes"):
        assert f"\n{title}\n" in text
    if pkm_triton.HAS_TRITON:  # each launch once, the module's default among them, marked
        tune = [line.split(" | ")[:6] for line in text.splitlines() if line.startswith("| 32 | read")
                or line.startswith("| 32 | backward")]
        # 9 launches each; the read's and the reads backward's defaults are among them
        assert len(tune) == len({tuple(row) for row in tune}) == 9 + 10 + 9
        assert [row[:5] for row in tune if row[5] == "yes"] == [
            ["| 32", "read", "32", "8", "4"], ["| 32", "backward rows", "32", "256", "4"]]
        assert ["| 32", "backward reads", "32", "8", "4", ""] in tune
    kernels = ["torch"] + (["triton"] if pkm_triton.HAS_TRITON else [])
    for values in ("dense", "sparse"):
        for kernel in kernels:
            assert text.count(f"| 32 | {values} | {kernel} | ") == 2  # read table, layer table
    aop = [line.split(" | ") for line in text.splitlines() if line.startswith("| AOP h ")]
    assert [(row[0][2:], row[1]) for row in aop] == [  # equal weights to the FFN's
        (case, groups) for case in ("AOP h 8, n_p 224", "AOP h 16, n_p 96") for groups in "12"]
    assert all(row[4] == row[5] for row in aop)
    span = [line.split(" | ")[:3] for line in text.splitlines() if line.startswith("| 64 | ")
            or line.startswith("| 128 | ")]
    assert span == [[f"| {w}", name, str(w)] for w in (64, 128)  # every path at the same window
                    for name in ("ours sdpa", "ours explicit", "fairseq example")]
    gathers = [line.split(" | ")[0] for line in text.splitlines() if "left pad <=" in line]
    assert gathers == ["| index_select (ours)", "| advanced indexing (before)"]
    tables = [line.split(" | ")[:3] for line in text.splitlines()
              if line.startswith(("| random |", "| factorized_random |"))]
    assert tables == [[f"| {mode}", f"{32 // t} x {t}", padding]
                      for mode in ("random", "factorized_random") for t in (8, 16)
                      for padding in ("none", "left")]
    # each case in its caller's layout, each backend the CPU has, at shapes of its own, timed
    shapes = [line.split(" | ") for line in text.splitlines()
              if line.startswith(("| self-attention, ", "| attention over 1536",
                                  "| decoder self-attention, "))]
    assert [row[1:3] for row in shapes] == [
        ["12 x 5 .. 9 x 7", "torch's choice"], ["10 x 6 .. 8 x 8", "math"],  # fairseq's
        ["7 x 9 .. 5 x 11", "torch's choice"], ["6 x 10 .. 5 x 12", "math"],  # the zoo's
        ["1 x 80 .. 1 x 88", "torch's choice"], ["1 x 88 .. 1 x 96", "math"],  # AOP's
        ["3 x 17 .. 3 x 19", "torch's choice"], ["3 x 18 .. 3 x 20", "math"]]  # the decoder's
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in shapes)


def test_bracket_baseline_runs_the_baseline_twice_per_group(tmp_path, monkeypatch):
    """``--baseline bracket``: one baseline run before a group's archs and one after (drift note),
    the archs' rows against the first; ``pair`` runs the baseline beside every arch."""
    from scripts.bench import bench_paper_size as bps

    runs = []

    def fake_run(group, arch, data, args, env=None, seed=None):
        runs.append(arch)
        speed = {"transformer_lm": 100.0 + 10 * runs.count(arch)}.get(arch, 50.0)
        return {"tokens/s": speed, "peak GiB": 1.0, "valid loss": 2.0, "wall s": 1.0}

    monkeypatch.setattr(bps, "one_run", fake_run)
    common = ["--size", "tiny", "--device", "cpu", "--groups", "lm", "--precisions", "fp32",
              "--repeats", "1", "--data-lm", str(tmp_path)]
    bps.main(common + ["--baseline", "bracket", "--out", str(tmp_path / "bracket.md")])
    assert runs == ["transformer_lm", "transformer_lm_pkm", "transformer_lm_memplus",
                    "transformer_lm"]
    text = (tmp_path / "bracket.md").read_text()
    assert "| lm | fp32 | transformer_lm_pkm | 50 | 110 | 0.455 |" in text
    assert "baseline tokens/s 110 before the rows above, 120 after them: drift +9.1 %" in text
    runs.clear()
    bps.main(common + ["--out", str(tmp_path / "pair.md")])
    assert runs.count("transformer_lm") == 2 and len(runs) == 4


def test_a_variant_is_one_more_row_of_its_arch_with_its_flags(tmp_path, monkeypatch):
    """``--variant ARCH:--flag=value``: ARCH once more with those flags (e.g. a kernel switch
    measured end to end against the default), its own row; the flags reach that run only."""
    from scripts.bench import bench_paper_size as bps

    runs = []

    def fake_run(group, arch, data, args, env=None, seed=None):
        runs.append(bps.train_command(group, arch, data, args, str(tmp_path)))
        return {"tokens/s": 50.0, "peak GiB": 1.0, "valid loss": 2.0, "wall s": 1.0}

    monkeypatch.setattr(bps, "one_run", fake_run)
    variant = "transformer_synth_random:--synth-table-kernel=table"
    bps.main(["--size", "tiny", "--device", "cpu", "--groups", "mt", "--precisions", "fp32",
              "--repeats", "1", "--data-mt", str(tmp_path), "--baseline", "bracket",
              "--archs", "transformer_synth_random", "--variant", variant,
              "--out", str(tmp_path / "v.md")])
    archs = [cmd[cmd.index("--arch") + 1] for cmd in runs]
    assert archs == ["transformer", "transformer_synth_random", "transformer_synth_random",
                     "transformer"]
    assert [("--synth-table-kernel=table" in cmd) for cmd in runs] == [False, False, True, False]
    assert f"| mt | fp32 | {variant} | 50 |" in (tmp_path / "v.md").read_text()
    with pytest.raises(SystemExit):
        bps.main(["--variant", "transformer_bogus:--x=1", "--out", str(tmp_path / "e.md")])


def test_seeds_alternate_over_repeats_and_bf16_losses_are_judged_against_fp16_noise(
        tmp_path, monkeypatch):
    """``--seeds 1 2``: repeat i runs the baseline and the arch with the i-th seed in turn, and a
    last table compares each arch's bf16 valid loss with its fp16 loss over the seeds: the noise
    is the larger spread of the two precisions, the verdict whether the means differ by no more.
    Without two seeds of each there is no noise to judge by, and the table says so."""
    from scripts.bench import bench_paper_size as bps

    seeds = []
    loss = {("transformer", "fp16"): {1: 5.0, 2: 5.2}, ("transformer", "bf16"): {1: 5.1, 2: 5.3},
            ("transformer_aop", "fp16"): {1: 6.0, 2: 6.1},
            ("transformer_aop", "bf16"): {1: 6.4, 2: 6.5}}

    def fake_run(group, arch, data, args, env=None, seed=None):
        seeds.append((arch, seed))
        return {"tokens/s": 50.0, "peak GiB": 1.0, "wall s": 1.0, "seed": seed,
                "valid loss": loss[arch, args._precision][seed]}

    monkeypatch.setattr(bps, "one_run", fake_run)
    common = ["--size", "tiny", "--device", "cpu", "--groups", "mt", "--precisions", "fp16",
              "bf16", "--archs", "transformer_aop", "--data-mt", str(tmp_path)]
    bps.main(common + ["--repeats", "2", "--seeds", "1", "2", "--out", str(tmp_path / "a.md")])
    assert seeds == [("transformer", 1), ("transformer_aop", 1), ("transformer_aop", 2),
                     ("transformer", 2)] * 2
    rows = {tuple(line.split(" | ")[1:3]): line.split(" | ")
            for line in (tmp_path / "a.md").read_text().splitlines()
            if line.startswith("| mt | transformer")}
    assert rows["transformer", "bf16"][3:] == [  # 0.1 apart, spread 0.2: within
        "5.100 (seed 1), 5.300 (seed 2)", "5.200", "5.000 (seed 1), 5.200 (seed 2)", "5.100",
        "+0.100", "0.200", "yes |"]
    assert rows["transformer_aop", "bf16"][7:] == ["+0.400", "0.100", "no |"]
    assert ("transformer", "fp16") not in rows  # fp16 is what the others are judged against
    # --baseline bracket: the closing baseline run takes the next seed, so it is judged too
    seeds.clear()
    bps.main(common + ["--repeats", "2", "--seeds", "1", "2", "--baseline", "bracket",
                       "--out", str(tmp_path / "c.md")])
    assert seeds == [("transformer", 1), ("transformer_aop", 1), ("transformer_aop", 2),
                     ("transformer", 2)] * 2
    assert "| mt | transformer | bf16 | 5.100 (seed 1), 5.300 (seed 2) |" in (
        tmp_path / "c.md").read_text()
    # the reference is fp16 wherever it was run (the target), else the first precision (the CPU)
    assert bps.reference_precision(["bf16", "fp16"]) == "fp16"
    assert bps.reference_precision(["fp32", "bf16"]) == "fp32"
    bps.main(common + ["--repeats", "1", "--out", str(tmp_path / "b.md")])
    assert "| mt | transformer_aop | bf16 | 6.400 (seed 1) | 6.400 | 6.000 (seed 1) | 6.000 | " \
        "+0.400 |  | needs 2 seeds of each (--seeds) |" in (tmp_path / "b.md").read_text()


def test_peak_cuda_memory_is_the_largest_a_run_reports():
    """Each training child prints its peak CUDA memory last (``PEAK_TAG``); a run trained in
    segments (the adaptive-span comparison resumes its runs) prints one per segment, and its peak
    is the largest. The comparison's fairseq commands print it too (the example's and ours), so
    its table has the target's "peak memory <= the example's" column; the CPU prints none."""
    from scripts.bench.bench_adaptive_span_vs_fairseq import fairseq_cli
    from scripts.bench.benchlib import PEAK_TAG, peak_cuda_gib

    text = f"log\n{PEAK_TAG} {2 ** 30}\nmore log\n{PEAK_TAG} {3 * 2 ** 29}\n"
    assert peak_cuda_gib(text) == 1.5
    assert math.isnan(peak_cuda_gib("a CPU run's log\n"))
    for plugin_patches in (False, True):
        code = fairseq_cli("train", plugin_patches)[-1]
        assert f"print('{PEAK_TAG}', torch.cuda.max_memory_allocated()" in code
        assert code.index("cli_main()") < code.index(PEAK_TAG)


def test_train_logs_are_read_in_every_logging_format():
    """fairseq's example started through ``python -c`` logs ``INFO:train_inner:{...}`` (the root
    logger unconfigured), fairseq's CLI ``... | INFO | train_inner | {...}``: the adaptive-span
    comparison reads both (it read only the second, and failed on the example's run)."""
    from scripts.bench.bench_adaptive_span_vs_fairseq import inner_logs

    text = "\n".join([
        'INFO:train_inner:{"epoch": 1, "loss": "7.5", "wps": "100", "wpb": "64"}',
        '2026-11-24 20:52:42 | INFO | train_inner | {"epoch": 1, "loss": "7.4", "wps": "90"}',
        'INFO:train:{"epoch": 1, "train_loss": "7.0"}',
        'INFO:train_inner:{"broken',
    ])
    assert [r["loss"] for r in inner_logs(text)] == ["7.5", "7.4"]


def _layout(cmd):
    """What a model built from a harness command looks like apart from its methods: per side,
    pre- or post-norm, the final and the embedding layer norms, the embedding scale."""
    from fairseq import options, tasks

    argv = cmd[cmd.index("--run-train") + 1:]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    model = tasks.setup_task(args).build_model(args)
    sides = [getattr(model, "encoder", None), model.decoder]
    return [(s.layers[0].normalize_before, s.layer_norm is not None,
             s.layernorm_embedding is not None, s.embed_scale) for s in sides if s is not None]


@pytest.mark.parametrize("group", ["mt", "lm"])
def test_the_baseline_has_the_layout_of_the_archs_it_is_compared_with(group, mt_data, lm_data,
                                                                      tmp_path):
    """A ratio against the stock baseline measures the method only if everything else is the
    same model: fairseq's bare ``transformer_lm`` arch is post-norm without a final layer norm,
    the zoo LMs (fairseq's ``base_lm_architecture``) pre-norm with one."""
    from scripts.bench import bench_paper_size as bps

    args = types.SimpleNamespace(size="tiny", updates=1, seed=1, valid_steps=1,
                                 _precision="fp32", device="cpu", extra="")
    data = mt_data if group == "mt" else lm_data
    archs = bps.MT_ARCHS if group == "mt" else bps.LM_ARCHS
    layout = {arch: _layout(bps.train_command(group, arch, data, args, str(tmp_path)))
              for arch in [bps.BASELINE[group]] + archs}
    base = layout.pop(bps.BASELINE[group])
    assert {arch: base for arch in layout} == layout

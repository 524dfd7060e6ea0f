"""--pkm-shard-values: value tables split by columns over the processes (gloo on the CPU, the code
path of multi-GPU training) against one process with --update-freq making the same global batch:
the loss of every update and every parameter after 3 updates agree; checkpoints hold whole tables
and their optimizer state and load at any world size; mistakes get one line; what each rank holds
and sends (tests/shard_measure.py)."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from test_ddp import _run
from zoo_testlib import USER_DIR, build, eval_flags, run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

#: updates of every run; each saves at updates 2 and 4 (--save-interval-updates) and trains on
#: after each save: the saves are collectives that gather whole tables to rank 0, and the ranks
#: must keep their own columns (model and optimizer state) through them
UPDATES = 5
SAVE = "--save-interval-updates 2"
MID = "checkpoint_1_2.pt"  # the checkpoint of update 2 (mid-epoch, mid-run)
ARCHS = ["transformer_lm_pkm", "transformer_lm_memplus", "transformer_pkm"]
SPARSE = "--optimizer pkm_adam --pkm-sparse true --pkm-values-lr 0.01"
#: resumes from a mid-run checkpoint at another world size (--update-freq keeps the batches of an
#: update): the one-process "dense" run's (1 process x 2 batches) on 2 processes; the 2-process
#: "uf2" run's (2 processes x 2 batches) on 4 processes, and on one (its single-mode twin).
#: Rank 0 reads the file and broadcasts it (the compat row fairseq_resume_broadcast); the data
#: continue where the run saved (the compat row fairseq_resume_other_world_size)
RESUMES = {"resume": ("single2-dense", "--clip-norm 0.05"), "resume-4": ("ddp2-uf2", "")}
#: (setup, --ddp-backend, flags of both modes, flags of the multi-process run only, processes,
#: --update-freq of each process). Every setup: Adam's eps at 1e-4, because a parameter whose
#: gradient is zero but for rounding (the key biases of attention, a bias in front of a batch
#: norm) moves by ±lr under Adam's g/(√v + 1e-8) whatever that rounding is: 1e-4 keeps those
#: steps at rounding size and leaves the others (gradients ~1e-2) Adam's. Dense values with plain
#: Adam, clipped (the norm of a split table must be the one-process norm); sparse values with
#: pkm_adam and its own value clip; PyTorch DDP; the resumes above; 2 processes accumulating 2
#: batches each; 4 processes, one column slice each; 4 processes in 2 groups of 2 (two copies of
#: every column slice).
SETUPS = [("dense", "legacy_ddp", "--clip-norm 0.05", "", 2, 1),
          ("sparse", "legacy_ddp", SPARSE + " --pkm-values-clip-norm 0.01", "", 2, 1),
          ("dense-pytorch_ddp", "pytorch_ddp", "", "", 2, 1),
          ("resume", "legacy_ddp", "", "", 2, 1),
          ("uf2", "legacy_ddp", "", "", 2, 2),
          ("dense-4", "legacy_ddp", "", "", 4, 1),
          ("sparse-4-group2", "legacy_ddp", SPARSE, "--pkm-shard-group-size 2", 4, 1),
          ("resume-4", "legacy_ddp", "", "", 4, 1)]
#: multi-process runs that must stop at build time, in one line: (setup, flags, message)
MISTAKES = [("odd-width", "--pkm-value-dim 33",
             "the PKM value dim 33 is not divisible by the shard group size 2"),
            ("bad-group", "--pkm-shard-group-size 3",
             "--pkm-shard-group-size 3 does not divide the number of processes (2)")]


def _flags(name, both, root):
    """The flags of both modes of a setup: its own, a resume's --restore-file, the saves."""
    flags = f"--adam-eps 1e-4 {SAVE} {both}"
    if name in RESUMES:
        source, more = RESUMES[name]
        flags += f" {more} --restore-file {root}/{source}-{{arch}}/{MID}"
    return flags


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory, mt_data, lm_data):
    """One launch per (mode, processes): every setup of that size, every arch."""
    root = tmp_path_factory.mktemp("shard")
    runs = {"root": root}
    for world in sorted({s[4] for s in SETUPS}):
        for mode in ("single", "ddp"):
            setups = [[name, backend, _flags(name, both, root)
                       + (" --pkm-shard-values " + more if mode == "ddp" else ""), uf]
                      for name, backend, both, more, w, uf in SETUPS if w == world]
            if mode == "ddp" and world == 2:
                setups += [[name, "legacy_ddp", "--pkm-shard-values " + flags, 1]
                           for name, flags, _ in MISTAKES]
            out = _run(mode, str(root / f"{mode}{world}.json"), mt_data, lm_data, ARCHS,
                       ["--updates", str(UPDATES), "--setups", json.dumps(setups)], world)
            runs.update({(mode, name): arch_runs for name, arch_runs in out.items()})
    return runs


def _checkpoint(run) -> dict:
    return torch.load(os.path.join(os.path.dirname(run["params"]), "checkpoint_last.pt"),
                      map_location="cpu", weights_only=False)


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str):
    """Within 1e-5 relative (1e-6 absolute for entries near 0)."""
    excess = ((a.float() - b.float()).abs() - 1e-5 * a.float().abs()).max().item()
    assert excess <= 1e-6, f"{what} differs by {excess:.2e} beyond 1e-5 relative"


def _logged(run):
    """Each update's loss, batch and gradient norm as fairseq logs them (3 decimals)."""
    return [(r["num_updates"], r["loss"], r["bsz"], r["wpb"], r["gnorm"])
            for r in run["train_inner"]]


@pytest.mark.parametrize("setup", [s[0] for s in SETUPS])
@pytest.mark.parametrize("arch", ARCHS)
def test_shard_values_after_save_match_one_process(arch, setup, shard_runs):
    """Every update, through and after the saves at updates 2 and 4, equals one process; so do
    the parameters and the tables' optimizer state after the last."""
    single, ddp = shard_runs[("single", setup)][arch], shard_runs[("ddp", setup)][arch]
    assert "error" not in single, single.get("error")
    assert "error" not in ddp, ddp.get("error")
    logged = [_logged(run) for run in (single, ddp)]
    first = 3 if setup in RESUMES else 1
    assert [int(u) for u, *_ in logged[0]] == list(range(first, UPDATES + 1)), logged[0]
    assert logged[0] == logged[1], logged
    saved = os.path.join(os.path.dirname(ddp["params"]), MID)
    assert setup in RESUMES or os.path.exists(saved), "no save before the last update"
    a = torch.load(single["params"], weights_only=False)
    b = torch.load(ddp["params"], weights_only=False)
    assert a.keys() == b.keys()
    tables = [k for k in a if k.endswith("values.weight")]
    assert tables and all(a[k].shape == b[k].shape for k in tables), "saved whole"
    # BatchNorm running statistics are per-process state
    per_process = ("running_mean", "running_var", "num_batches_tracked")
    for k in a:
        if a[k].numel() and not k.endswith(per_process):
            _assert_close(a[k], b[k], f"{arch} {setup}: {k} after {UPDATES} updates")
    # the optimizer state of the tables was gathered into the checkpoint, whole
    sa, sb = _checkpoint(single)["last_optimizer_state"], _checkpoint(ddp)["last_optimizer_state"]
    assert sa["state"].keys() == sb["state"].keys()
    full = 0
    for i in sa["state"]:
        for name, value in sa["state"][i].items():
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[0] == a[tables[0]].shape[0]:
                assert sb["state"][i][name].shape == value.shape
                _assert_close(value, sb["state"][i][name], f"{arch} {setup}: optimizer {name}")
                full += 1
    assert full >= 2  # Adam's two moments of the table


@pytest.mark.parametrize("setup", list(RESUMES))
@pytest.mark.parametrize("arch", ARCHS)
def test_shard_values_after_save_resume_at_another_world_size(arch, setup, shard_runs):
    """The checkpoint of update 2 of a run that went on training, resumed on another number of
    processes (and, for the 2-process run's, on one): updates 3 to 5 are the original run's."""
    source, _ = RESUMES[setup]
    mode, name = ("single" if source.startswith("single") else "ddp"), source.split("-", 1)[1]
    original = _logged(shard_runs[(mode, name)][arch])[2:]
    for resumed_mode in ("single", "ddp"):
        resumed = shard_runs[(resumed_mode, setup)][arch]
        assert "error" not in resumed, resumed.get("error")
        assert _logged(resumed) == original, (resumed_mode, _logged(resumed), original)


def test_shard_values_tables_are_split_and_out_of_ddp(shard_runs):
    """The pytorch_ddp run's reducer left exactly the split tables alone."""
    for arch in ARCHS:
        ignored = shard_runs[("ddp", "dense-pytorch_ddp")][arch]["ddp_ignored"]
        assert ignored and all(n.endswith("ffn.values.weight") for n in ignored), ignored
        assert len(ignored) == (1 if arch == "transformer_lm_memplus" else
                                2 if arch == "transformer_pkm" else 1)


@pytest.mark.parametrize("name,flags,message", MISTAKES)
def test_shard_values_mistakes_are_one_line(name, flags, message, shard_runs):
    for arch in ARCHS:
        error = shard_runs[("ddp", name)][arch]["error"]
        first = error.splitlines()[0]
        assert message in first, error[-2000:]
        assert first.startswith("ValueError") and first.count(":") >= 1


def test_shard_values_one_process_runs_unsharded(lm_data, caplog):
    with caplog.at_level(logging.WARNING):
        _, _, model, _ = build("transformer_lm_memplus", lm_data, ["--pkm-shard-values"])
    said = [r.getMessage() for r in caplog.records if "--pkm-shard-values" in r.getMessage()]
    assert len(said) == 1 and "with one process" in said[0] and "not split" in said[0], said
    tables = [m for m in model.modules() if type(m).__name__ == "ValueTable"]
    assert len(tables) == 1  # the shared pool, whole


@pytest.mark.parametrize("flags,named", [("--bf16", "--bf16"),
                                         ("--ddp-backend fully_sharded", "fully_sharded")])
def test_shard_values_refuses_what_bypasses_its_hooks(flags, named, lm_data):
    with pytest.raises(ValueError) as e:
        build("transformer_lm_pkm", lm_data, ["--pkm-shard-values"] + flags.split())
    assert "--pkm-shard-values does not work with" in str(e.value) and named in str(e.value)
    assert "\n" not in str(e.value)


def test_shard_values_checkpoint_of_4_processes_in_one(shard_runs, lm_data, mt_data):
    """A 4-process split run's checkpoint with one-process fairseq-eval-lm and fairseq-generate:
    translations come out; the perplexity of the one-process run's checkpoint where the model has
    no batch norm (Memory+; the query batch norm's running statistics are per process, rank 0's
    from a quarter of the batches)."""
    for arch in ARCHS:
        paths = [os.path.join(os.path.dirname(shard_runs[(mode, "dense-4")][arch]["params"]),
                              "checkpoint_last.pt") for mode in ("single", "ddp")]
        if arch == "transformer_pkm":
            lines = run_cli("generate", [mt_data, "--user-dir", USER_DIR, "--path", paths[1],
                                         "--beam", "2", "--max-len-b", "8", "--cpu",
                                         "--gen-subset", "valid", "--max-tokens", "4096"])
            assert any(line.startswith("H-") for line in lines), lines[-5:]
            continue
        # a checkpoint of 4 processes in groups of 2 (its stored config names the group size)
        paths.append(os.path.join(os.path.dirname(
            shard_runs[("ddp", "sparse-4-group2")][arch]["params"]), "checkpoint_last.pt"))
        losses = []
        for path in paths:
            lines = run_cli("eval_lm", [lm_data, "--user-dir", USER_DIR, "--path", path, "--cpu",
                                        "--max-tokens", "4096", "--gen-subset", "valid"]
                            + eval_flags(arch))
            said = [line for line in lines if "Loss (base 2)" in line]
            assert said, lines[-5:]
            losses.append(float(said[-1].split("Loss (base 2): ")[1].split(",")[0]))
        assert abs(losses[0] - losses[1]) <= (1e-3 if arch == "transformer_lm_memplus" else
                                              0.1), losses
        assert 0 < losses[2] < 10, losses


def test_shard_values_memory_and_bytes_per_rank(tmp_path):
    """65,536 slots × d 256 against 256 tokens a rank (the table dominates; docs/pkm.md quotes
    the default 262,144 slots): per rank, the split run holds 1/2 of the value parameters and
    optimizer state, and sends a small fraction of the bytes replicated DDP with dense values
    sends per update (tests/shard_measure.py counts them)."""
    out = tmp_path / "measure.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "shard_measure.py"), "--out", str(out), "--repeats", "1",
           "--n-keys", "256", "--tokens", "256"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads(out.read_text())
    rep, split = m["replicated"], m["sharded"]
    assert split["value_params"] * 2 == rep["value_params"] == 65536 * 256
    assert split["value_optimizer_state"] * 2 == rep["value_optimizer_state"]
    assert rep["bytes_sent"] > 10 * split["bytes_sent"] > 0, m

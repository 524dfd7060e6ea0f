"""2-process CPU training (gloo, torchrun; the same code path as multi-GPU DDP) for every distinct
wiring (``zoo_testlib.wiring``; test_sweep builds every preset name against its wiring's):
the first update's loss and the updated parameters equal 1 process with --update-freq 2. With
sparse product-key memory values (pkm_adam's row exchange instead of the dense all-reduce), the
value tables after every one of several updates equal 1 process with --update-freq 2 and are
identical on both ranks."""

import json
import os
import subprocess

import pytest
import torch

from console_server import SERVERS, TORCHRUN
from test_stock_differential import LM_FAMILIES
from zoo_testlib import wirings, zoo_archs

ARCHS = list(wirings(zoo_archs()))
HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "ddp_runner.py")
pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]


SPARSE_ARCHS = ["transformer_lm_pkm", "transformer_lm_memplus"]
SPARSE_UPDATES = 3


def _run(mode, out, mt_data, lm_data, archs=ARCHS, extra=(), world=2):
    """tests/ddp_runner.py in ``mode``: one process, or ``world`` under torchrun; each process
    forked from its console server (tests/console_server.py: the runner's imports done once)."""
    argv = ["--mode", mode, "--archs", ",".join(archs), "--mt-data", mt_data, "--lm-data",
            lm_data, "--out", out, "--world", str(world)] + list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if mode == "ddp":
        shim = SERVERS.shim(os.path.join(os.path.dirname(out), "bin"), RUNNER)
        code, _, err = SERVERS.run(TORCHRUN, ["--standalone", "--nproc_per_node", str(world),
                                              "--no-python", shim, *argv],
                                   env=env, cwd=os.getcwd(), timeout=1500)
    else:
        code, _, err = SERVERS.run(RUNNER, argv, env=env, cwd=os.getcwd(), timeout=1500)
    assert code == 0 and os.path.exists(out), err[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mt_data, lm_data):
    root = tmp_path_factory.mktemp("ddp")
    return {mode: _run(mode, str(root / f"{mode}.json"), mt_data, lm_data)["run"]
            for mode in ("single", "ddp")}


@pytest.mark.parametrize("arch", ARCHS)
def test_ddp_matches_single_process(arch, runs):
    single, ddp = runs["single"][arch], runs["ddp"][arch]
    assert "error" not in single, single.get("error")
    assert "error" not in ddp, ddp.get("error")
    # fairseq logs losses rounded to 3 decimals
    assert abs(single["loss"] - ddp["loss"]) <= 1e-3, (single["loss"], ddp["loss"])
    a = torch.load(single["params"], weights_only=False)
    b = torch.load(ddp["params"], weights_only=False)
    assert a.keys() == b.keys()
    # BatchNorm running statistics are per-process state: one process with --update-freq 2 makes
    # two forward passes, each rank one; everything else must agree
    per_process = ("running_mean", "running_var", "num_batches_tracked")
    keys = [k for k in a if a[k].numel() and not k.endswith(per_process)]
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in keys)
    assert worst <= 1e-5, f"{arch}: parameters after one update differ by {worst:.2e}"


@pytest.fixture(scope="module")
def sparse_runs(tmp_path_factory, mt_data, lm_data):
    """Every setup of a mode in one launch (1 process, or one 2-process torchrun)."""
    root = tmp_path_factory.mktemp("ddp_sparse")
    runs = {}
    for mode in ("single", "ddp"):
        setups = [[name, backend, f"--pkm-exchange {exchange}", update_freq]
                  for name, m, backend, exchange, update_freq in SPARSE_SETUPS if m == mode]
        runs.update(_run(mode, str(root / f"{mode}.json"), mt_data, lm_data, SPARSE_ARCHS,
                         ["--sparse-values", "--updates", str(SPARSE_UPDATES), "--setups",
                          json.dumps(setups)]))
    return runs


#: pkm_adam's value-optimiser options (XLM's constant lr, the memory code's value weight decay, a
#: separate value clip small enough to act): the exchanged gradient must give the same step
VALUE_OPTIONS = ("--pkm-values-lr-schedule constant --pkm-values-weight-decay 0.1 "
                 "--pkm-values-clip-norm 0.01")

# (name, mode, --ddp-backend, --pkm-exchange [+ flags], --update-freq per process): both
# exchanges, both DDP wrappers, gradient accumulation (2 processes x 2 == 1 process x 4), and the
# value-optimiser options
SPARSE_SETUPS = [("single", "single", "legacy_ddp", "auto", 1),
                 ("single-opts", "single", "legacy_ddp", "auto " + VALUE_OPTIONS, 1),
                 ("legacy_ddp-gather-opts", "ddp", "legacy_ddp", "gather " + VALUE_OPTIONS, 1),
                 ("legacy_ddp-gather", "ddp", "legacy_ddp", "gather", 1),
                 ("pytorch_ddp-all_reduce", "ddp", "pytorch_ddp", "all_reduce", 1),
                 ("single-uf4", "single", "legacy_ddp", "auto", 2),
                 ("pytorch_ddp-auto-uf2", "ddp", "pytorch_ddp", "auto", 2)]


@pytest.mark.parametrize("setup", [s[0] for s in SPARSE_SETUPS if s[1] == "ddp"])
@pytest.mark.parametrize("arch", SPARSE_ARCHS)
def test_sparse_values_match_single_process_after_every_update(arch, setup, sparse_runs):
    """pytorch_ddp runs on CPU with fairseq's GPU-only device_ids dropped (see ddp_runner.py)."""
    reference = ("single-uf4" if setup.endswith("-uf2")
                 else "single-opts" if setup.endswith("-opts") else "single")
    single, ddp = sparse_runs[reference][arch], sparse_runs[setup][arch]
    assert "error" not in single, single.get("error")
    assert "error" not in ddp, ddp.get("error")
    ref = torch.load(single["values"].format(0), weights_only=False)
    ranks = [torch.load(ddp["values"].format(r), weights_only=False) for r in (0, 1)]
    assert len(ref) == len(ranks[0]) == len(ranks[1]) == SPARSE_UPDATES
    # every update counts the same sentences, tokens and loss (the last update of the -uf2 run
    # mixes a real batch and a padding batch on rank 1: compat fairseq_ddp_partial_update)
    logged = [[(r["loss"], r["bsz"], r["wpb"]) for r in run["train_inner"]] for run in (single, ddp)]
    assert logged[0] == logged[1], logged
    start = None
    for update, (a, b0, b1) in enumerate(zip(ref, *ranks), 1):
        assert all(a["sparse"]) and all(b0["sparse"]) and all(b1["sparse"]), \
            f"{arch}: value gradients were not sparse"
        for t_ref, t0, t1 in zip(a["tables"], b0["tables"], b1["tables"]):
            assert torch.equal(t0, t1), f"{arch}: ranks disagree after update {update}"
            worst = (t_ref - t0).abs().max().item()
            assert worst <= 1e-6, f"{arch}: update {update}: tables differ by {worst:.2e}"
        start = start if start is not None else a["tables"]
    moved = sum(int((t != s).any(-1).sum()) for t, s in zip(ref[-1]["tables"], start))
    assert moved > 0
    if setup.startswith("pytorch_ddp"):  # PyTorch DDP's reducer skipped exactly the table
        assert ddp["ddp_ignored"] and all(n.endswith("ffn.values.weight")
                                          for n in ddp["ddp_ignored"]), ddp["ddp_ignored"]
        assert len(ddp["ddp_ignored"]) == len(ref[0]["tables"])
    # the exchange is logged per update (MB this rank received), next to fairseq's own stats
    assert all(float(r["pkm_xchg_mb"]) > 0 for r in ddp["train_inner"])
    assert all("pkm_xchg_mb" not in r for r in single["train_inner"])


#: a stock fairseq LM, tiny (the differential tests' transformer_lm), on the CPU
STOCK_LM = LM_FAMILIES["transformer_lm"] + [
    "--task", "language_modeling", "--tokens-per-sample", "16", "--max-tokens", "256",
    "--optimizer", "adam", "--lr", "1e-3", "--num-workers", "0", "--seed", "1", "--cpu",
    "--disable-validation", "--log-format", "simple", "--log-interval", "1"]


def test_stock_lm_resumes_on_two_processes_from_rank_0s_copy(lm_data, console_shims, tmp_path):
    """A one-process checkpoint of stock transformer_lm resumed on 2 processes: fairseq loads it
    on rank 0 and broadcasts it. With the plugin loaded it trains on (the compat row
    fairseq_resume_broadcast); with that row off, rank 1 dies unpickling the broadcast with
    torch's weights-only loader, as stock fairseq does under torch >= 2.6."""
    from zoo_testlib import USER_DIR

    train = [os.path.join(console_shims("fairseq-train"), "fairseq-train"), lm_data,
             "--user-dir", USER_DIR] + STOCK_LM
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(train + ["--max-update", "2", "--save-dir", str(tmp_path / "one")],
                           env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    ranks = tmp_path / "rank.sh"  # (fairseq takes a process's rank from its flags)
    ranks.write_text('#!/bin/bash\nexec "$@" --distributed-rank "$RANK" --device-id "$LOCAL_RANK"\n')
    for off in ("", "fairseq_resume_broadcast"):
        argv = ["--standalone", "--nproc_per_node", "2", "--no-python", "bash", str(ranks)] + \
            train + ["--distributed-backend", "gloo", "--distributed-init-method", "env://",
                     "--distributed-no-spawn", "--distributed-world-size", "2", "--ddp-backend",
                     "legacy_ddp", "--max-update", "4", "--save-dir", str(tmp_path / f"two{off}"),
                     "--restore-file", str(tmp_path / "one" / "checkpoint_last.pt")]
        code, log, _ = SERVERS.run(TORCHRUN, argv, env=dict(env, ATTNZOO_COMPAT_DISABLE=off),
                                   cwd=tmp_path, merge=True, timeout=300)
        if off:
            assert code != 0 and "Weights only load failed" in log, log[-3000:]
        else:
            assert code == 0, log[-3000:]
            assert "Loaded checkpoint" in log and "num_updates 4" in log, log[-3000:]

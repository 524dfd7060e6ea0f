"""docs/pkm.md's command for several machines, run as written on this one: two torchrun agents
(two "nodes", c10d rendezvous on 127.0.0.1) of 2 processes each, gloo, sharded values in bf16
(split over each node's 2 processes: two copies of every column slice), against one process with
--update-freq 4 on the same batches. The documented block is taken from the docs and run by bash;
only the environment differs: HOST, PORT and GPUS (the block's variables), and a `fairseq-train`
first on PATH that appends toy sizes and the CPU's flags (`--cpu --distributed-backend gloo`: later
flags win), as the documented-commands test does (tests/test_docs_commands.py)."""

import os
import shlex
import socket
import subprocess
import sys
import time

import pytest
import torch

from docs_testlib import blocks
from preptest_util import REPO
from scripts.bench.harness import fairseq_log
from test_shard_values import _assert_close, _assert_same_updates
from zoo_testlib import tiny_flags

pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

SECTION = "Across processes"
ARCH, UPDATES = "transformer_lm_memplus", 4


def documented_block() -> str:
    """The docs' command for several machines (docs/pkm.md, the "torchrun --nnodes" block)."""
    found = [b for b in blocks("docs/pkm.md") if SECTION in b.section and "--nnodes" in b.text]
    assert len(found) == 1, [b.where for b in found]
    return found[0].text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toy_fairseq_train(folder, lm_data, real) -> str:
    """A `fairseq-train` that runs ``real`` (the real one or its console-server shim) with the
    documented flags, then toy sizes, the CPU's flags and this test's logging ($UPDATE_FREQ: the
    one-process run's batches)."""
    toy = tiny_flags(ARCH, lm_data)[1:] + [
        "--cpu", "--distributed-backend", "gloo", "--max-tokens", "200",
        "--max-update", str(UPDATES), "--save-interval-updates", "2", "--adam-eps", "1e-4",
        "--no-epoch-checkpoints", "--dropout", "0", "--seed", "1", "--num-workers", "0",
        "--disable-validation", "--log-format", "json", "--log-interval", "1"]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "fairseq-train")
    with open(path, "w") as f:
        f.write(f'#!/bin/bash\nexec {shlex.quote(real)} "$@" {shlex.join(toy)} '
                '--update-freq "${UPDATE_FREQ:-1}"\n')
    os.chmod(path, 0o755)
    return folder


def _node(root, name, lm_data):
    """A working folder laid out as the docs assume (data/wiki-gensim/bin)."""
    cwd = os.path.join(root, name)
    os.makedirs(os.path.join(cwd, "data", "wiki-gensim"))
    os.symlink(lm_data, os.path.join(cwd, "data", "wiki-gensim", "bin"))
    return cwd


def test_shard_values_nnodes_documented_command_bf16_matches_one_process(lm_data, console_shims,
                                                                        tmp_path):
    block = documented_block()
    bin_dir = _toy_fairseq_train(str(tmp_path / "bin"), lm_data,
                                 os.path.join(console_shims("fairseq-train"), "fairseq-train"))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:"
               f"{os.environ.get('PATH', '')}", PYTHONPATH=REPO, OMP_NUM_THREADS="1",
               HOST="127.0.0.1", PORT=str(_free_port()), GPUS="2", UPDATE_FREQ="1")
    t0 = time.time()
    nodes = [subprocess.Popen(["bash", "-e", "-c", block], cwd=_node(tmp_path, f"node{i}", lm_data),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        out = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in out)
    split = [r for o in out for r in fairseq_log(o, "train_inner")]
    # the same command on one process: its train.sh with one rank, 4 batches an update
    one = _node(tmp_path, "one", lm_data)
    subprocess.run(["bash", "-e", "-c", block.split("torchrun")[0]], cwd=one, env=env, check=True)
    solo = subprocess.run(["./train.sh"], cwd=one, capture_output=True, text=True, timeout=600,
                          env=dict(env, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
                                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(_free_port()), UPDATE_FREQ="4"))
    assert solo.returncode == 0, solo.stdout[-2000:] + solo.stderr[-3000:]
    single = fairseq_log(solo.stdout + solo.stderr, "train_inner")
    print(f"2 nodes x 2 processes and one process: {time.time() - t0:.0f} s")
    rows = [[(r["num_updates"], r["loss"], r["bsz"], r["wpb"], r["gnorm"], None) for r in logs]
            for logs in (single, split)]
    assert len(rows[0]) == UPDATES, rows
    _assert_same_updates(*rows, "bf16", "2 nodes x 2 processes")
    saved = [os.path.join(tmp_path, n, "checkpoints", "memplus", "checkpoint_last.pt")
             for n in ("one", "node0", "node1")]
    a, b = (torch.load(p, map_location="cpu", weights_only=False)["model"]
            for p in (saved[0], next(p for p in saved[1:] if os.path.exists(p))))
    assert a.keys() == b.keys() and any(k.endswith("values.weight") for k in a)
    for k in a:
        _assert_close(a[k], b[k], f"{k} after {UPDATES} updates", "bf16")

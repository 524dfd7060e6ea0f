"""Train every given arch for ONE update (or ``--updates N``) and record the loss and the updated
parameters.

    python tests/ddp_runner.py --mode single ...                     # 1 process, --update-freq 2
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_runner.py --mode ddp ...

Both see the same two batches in each update (fairseq shards batches round-robin across ranks), so
the loss and the parameters after the update must agree. ``--sparse-values`` trains with
``--optimizer pkm_adam --pkm-sparse true`` and records, on every rank, the product-key memory value
tables after every optimizer step. ``--setups`` trains the archs once per setup (DDP wrapper,
flags, gradient accumulation), one after another in the same process(es). Used by test_ddp.py.
"""

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hydra_testlib import quicker_compose  # noqa: E402
from zoo_testlib import is_lm, json_logs, run_cli, tiny_flags, train_flags  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["single", "ddp"], required=True)
    p.add_argument("--archs", required=True)
    p.add_argument("--mt-data", required=True)
    p.add_argument("--lm-data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--sparse-values", action="store_true")
    p.add_argument("--world", type=int, default=2,
                   help="processes of the ddp mode that a single-process run stands for")
    p.add_argument("--setups", default='[["run", "legacy_ddp", "", 1]]',
                   help="JSON list of [name, --ddp-backend, more fairseq-train flags "
                        "(space-separated; {arch} = the arch's name), --update-freq of each of "
                        "the --world processes(, archs: a subset of --archs or null, {'inf': "
                        "[RANK, UPDATE]}: an inf in the value tables' gradient of that rank "
                        "-- every table of one process -- at that update's gradient "
                        "all-reduce)]: each trains every arch (or its own), in this one process")
    a = p.parse_args()
    quicker_compose()  # (tests/hydra_testlib.py: one config a run)
    setups = json.loads(a.setups)
    if any(setup[1] in ("pytorch_ddp", "c10d") for setup in setups):
        _pytorch_ddp_on_cpu()
    torch.set_num_threads(1)
    _fail_fast()
    rank = int(os.environ.get("RANK", 0))
    results = {setup[0]: {} for setup in setups}
    steps = _record_value_tables() if a.sparse_values else None
    run = os.path.splitext(os.path.basename(a.out))[0]
    optimizer = (["--optimizer", "pkm_adam", "--pkm-sparse", "true", "--pkm-values-lr", "0.01"]
                 if a.sparse_values else ["--optimizer", "adam"])
    if any("--amp" in setup[2].split() for setup in setups):
        _amp_scaler_on_cpu()
    if not torch.cuda.is_available():
        # fairseq's loss-scale overflow branch sets the norm to torch.tensor(0.0).cuda(): on a
        # machine without CUDA the tensor stays where it is
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    inf = _inject_inf()
    for name, backend, more, update_freq, *rest in setups:
        archs, opts = (rest + [None, None])[:2]
        for arch in (archs or a.archs.split(",")):
            inf.update(at=(opts or {}).get("inf"), calls=0)
            data = a.lm_data if is_lm(arch) else a.mt_data
            save = os.path.join(os.path.dirname(a.out), f"{run}-{name}-{arch}")  # one per run
            flags = tiny_flags(arch, data) + optimizer + [
                "--lr", "0.01", "--max-tokens", "200", "--max-update", str(a.updates),
                "--dropout", "0", "--save-dir", save, "--no-epoch-checkpoints", "--log-format",
                "json", "--log-interval", "1", "--seed", "1", "--num-workers", "0",
                "--disable-validation",
            ] + train_flags(arch) + more.replace("{arch}", arch).split()
            if a.mode == "single":  # the same batches per update as 2 processes
                flags += ["--update-freq", str(a.world * update_freq)]
            else:
                flags += ["--update-freq", str(update_freq)] if update_freq > 1 else []
                flags += ["--distributed-world-size", os.environ["WORLD_SIZE"],
                          "--distributed-rank", str(rank), "--device-id",
                          os.environ["LOCAL_RANK"], "--distributed-init-method", "env://",
                          "--distributed-no-spawn", "--distributed-backend", "gloo",
                          "--ddp-backend", backend]
            results[name][arch] = _train(flags, save, rank, steps)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


def _train(flags, save, rank, steps):
    """One fairseq-train run; what rank 0 records of it (every rank writes its value tables)."""
    try:
        DDP_IGNORED.clear()
        if steps is not None:
            steps.clear()
        logs = run_cli("train", flags)
        inner = json_logs(logs, "train_inner")
        if steps is not None:
            torch.save(steps, os.path.join(save, f"values-rank{rank}.pt"))
        if rank != 0:
            return None
        state = torch.load(os.path.join(save, "checkpoint_last.pt"), map_location="cpu",
                           weights_only=False)["model"]
        torch.save(state, os.path.join(save, "params.pt"))
        return {"loss": float(inner[0]["loss"]) if inner else None,
                "params": os.path.join(save, "params.pt"),
                "values": os.path.join(save, "values-rank{}.pt"),
                "train_inner": inner, "ddp_ignored": list(DDP_IGNORED)}
    except BaseException as e:  # record and go on with the other runs
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}


def _fail_fast():
    """A run that fails on one rank only leaves the others waiting in a collective: end that wait
    after 5 minutes (gloo's default 30 would outlast the test's own timeout) with an error."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(minutes=5)


def _amp_scaler_on_cpu():
    """fairseq's --amp builds ``torch.cuda.amp.GradScaler``, which on a machine without CUDA
    disables itself (loss scale 1, no inf check); give it torch's CPU GradScaler, so that the
    loss is scaled, the gradients unscaled and checked for inf/NaN and a step skipped as on a
    GPU (autocast stays CUDA's: the arithmetic is float32)."""
    from fairseq.optim import amp_optimizer

    class Torch:  # the module as amp_optimizer sees it, but for the scaler
        def __getattr__(self, name):
            return getattr(torch, name)

        class cuda:  # noqa: N801
            class amp:  # noqa: N801
                @staticmethod
                def GradScaler(**kwargs):  # noqa: N802
                    return torch.amp.GradScaler("cpu", **kwargs)

    amp_optimizer.torch = Torch()


def _inject_inf():
    """Wrap the split tables' gradient hook (called once an update after the all-reduce, in both
    modes): at the update ``state["at"] = [RANK, UPDATE]`` names, put an inf into the first
    entry of every value table's gradient on that rank (one process: every table, which holds
    every rank's columns). Returns the state to set per setup."""
    from fairseq_attnzoo.models import pkm_shard
    from fairseq_attnzoo.modules.pkm import VALUES_GROUP

    state = {"at": None, "calls": 0}
    finish = pkm_shard.finish_gradients

    def finishing_with_inf(params):
        params = list(params)
        finish(params)
        state["calls"] += 1
        rank, update = state["at"] or (None, None)
        one = os.environ.get("WORLD_SIZE") is None
        if update == state["calls"] and (one or int(os.environ["RANK"]) == rank):
            for p in params:
                if getattr(p, "param_group", None) == VALUES_GROUP and p.grad is not None:
                    (p.grad._values() if p.grad.is_sparse else p.grad).view(-1)[0] = float("inf")

    pkm_shard.finish_gradients = finishing_with_inf
    return state


def _pytorch_ddp_on_cpu():
    """fairseq gives PyTorch DDP ``device_ids=[device_id]``, which DDP refuses for CPU modules
    (GPU-only argument); drop it so --ddp-backend pytorch_ddp runs here, otherwise unchanged."""
    from fairseq.models import distributed_fairseq_model as dfm

    ddp = dfm.DistributedDataParallel

    def cpu_ddp(module, device_ids=None, output_device=None, **kwargs):
        wrapped = ddp(module, **kwargs)
        DDP_IGNORED[:] = sorted(wrapped.parameters_to_ignore)  # what the reducer leaves alone
        return wrapped

    dfm.DistributedDataParallel = cpu_ddp


DDP_IGNORED = []


def _record_value_tables():
    """Wrap pkm_adam's step: after each step, append (value tables, whether their gradients were
    sparse) to the returned list."""
    from fairseq_attnzoo.modules.pkm import VALUES_GROUP
    from fairseq_attnzoo.optim.pkm_optimizer import PKMAdam

    steps = []
    step = PKMAdam.step

    def recording_step(self, *args, **kwargs):
        params = [p for g in self.param_groups if g.get(VALUES_GROUP) for p in g["params"]]
        sparse = [p.grad is not None and p.grad.is_sparse for p in params]
        out = step(self, *args, **kwargs)
        steps.append({"tables": [p.detach().clone() for p in params], "sparse": sparse})
        return out

    PKMAdam.step = recording_step
    return steps


if __name__ == "__main__":
    main()

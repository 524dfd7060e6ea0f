"""Train every given arch for ONE update (or ``--updates N``) and record the loss and the updated
parameters.

    python tests/ddp_runner.py --mode single ...                     # 1 process, --update-freq 2
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_runner.py --mode ddp ...

Both see the same two batches in each update (fairseq shards batches round-robin across ranks), so
the loss and the parameters after the update must agree. ``--sparse-values`` trains with
``--optimizer pkm_adam --pkm-sparse true`` and records, on every rank, the product-key memory value
tables after every optimizer step. Used by test_ddp.py.
"""

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

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
    p.add_argument("--ddp-backend", default="legacy_ddp")
    p.add_argument("--update-freq", type=int, default=1, help="of each of the 2 processes")
    p.add_argument("--flags", default="", help="more fairseq-train flags (space-separated)")
    a = p.parse_args()
    if a.ddp_backend in ("pytorch_ddp", "c10d"):
        _pytorch_ddp_on_cpu()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    results = {}
    steps = _record_value_tables() if a.sparse_values else None
    for arch in a.archs.split(","):
        data = a.lm_data if is_lm(arch) else a.mt_data
        run = os.path.splitext(os.path.basename(a.out))[0]  # one save dir per run and arch
        save = os.path.join(os.path.dirname(a.out), f"{run}-{arch}")
        optimizer = (["--optimizer", "pkm_adam", "--pkm-sparse", "true", "--pkm-values-lr", "0.01"]
                     if a.sparse_values else ["--optimizer", "adam"])
        flags = tiny_flags(arch, data) + optimizer + [
            "--lr", "0.01", "--max-tokens", "200", "--max-update", str(a.updates),
            "--dropout", "0", "--save-dir", save, "--no-epoch-checkpoints", "--log-format", "json",
            "--log-interval", "1", "--seed", "1", "--num-workers", "0", "--disable-validation",
        ] + train_flags(arch) + a.flags.split()
        if a.mode == "single":  # the same batches per update as 2 processes
            flags += ["--update-freq", str(2 * a.update_freq)]
        else:
            flags += ["--update-freq", str(a.update_freq)] if a.update_freq > 1 else []
            flags += ["--distributed-world-size", os.environ["WORLD_SIZE"], "--distributed-rank",
                      str(rank), "--device-id", os.environ["LOCAL_RANK"],
                      "--distributed-init-method", "env://", "--distributed-no-spawn",
                      "--distributed-backend", "gloo", "--ddp-backend", a.ddp_backend]
        try:
            if steps is not None:
                steps.clear()
            logs = run_cli("train", flags)
            inner = json_logs(logs, "train_inner")
            if steps is not None:  # every rank writes its own tables
                torch.save(steps, os.path.join(save, f"values-rank{rank}.pt"))
            if rank == 0:
                state = torch.load(os.path.join(save, "checkpoint_last.pt"), map_location="cpu",
                                   weights_only=False)["model"]
                torch.save(state, os.path.join(save, "params.pt"))
                results[arch] = {"loss": float(inner[0]["loss"]) if inner else None,
                                 "params": os.path.join(save, "params.pt"),
                                 "values": os.path.join(save, "values-rank{}.pt"),
                                 "train_inner": inner, "ddp_ignored": list(DDP_IGNORED)}
        except BaseException as e:  # record and go on with the other archs
            results[arch] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


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

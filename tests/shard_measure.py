"""What each rank holds and sends per update, in float32 and in bfloat16: a product-key memory
whose value table dominates (262,144 slots × d 256 by default), replicated under PyTorch DDP with
dense values against split by columns (--pkm-shard-values' module,
:mod:`fairseq_attnzoo.modules.pkm_shard`).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/shard_measure.py --out M.json

bfloat16 as fairseq's --bf16 trains: the memory in bfloat16, fp32 master copies of its parameters
(fairseq's FP16Optimizer), Adam over the masters. Bytes are what this rank sends to the other
ranks, counted where they leave: DDP's buckets through a communication hook (an all-reduce
counted as a ring all-reduce, 2(W-1)/W of the bucket), the split read's collectives through a
dispatch mode over torch's functional collectives (all-gather: the input to each of the G-1
others; all-to-all: the rows for other ranks; reduce-scatter: (G-1)/G of the input). Memory, of
the value table on this rank: its parameter, its fp32 master copy (bf16 only: in fp32 the
parameter is the master) and Adam's state, in bytes. Seconds: one update (forward, backward,
gradient exchange, Adam step), median of ``--repeats`` after one warm-up; on the CPU under gloo
only their ratio means anything. Rank 0 writes the JSON: {dtype: {replicated, sharded}}.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fairseq_attnzoo.modules.pkm import ProductKeyMemory  # noqa: E402
from fairseq_attnzoo.modules.pkm_shard import (ShardedValueTable, ShardLayout,  # noqa: E402
                                               finish_gradients)


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes the functional collectives under it send to other ranks."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.sent = world, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("_c10d_functional::"):
            t = args[0]
            size = t.numel() * t.element_size()
            if "all_gather" in name:
                self.sent += size * (self.world - 1)
            elif "all_to_all" in name:
                row = size // max(1, t.size(0))  # args[2]: rows of t for each rank
                self.sent += size - args[2][dist.get_rank()] * row
            elif "reduce_scatter" in name:
                self.sent += size * (self.world - 1) // self.world
        return func(*args, **(kwargs or {}))


def counting_hook(counter: dict, world: int):
    def hook(state, bucket):
        buf = bucket.buffer()
        counter["sent"] += 2 * (world - 1) * buf.numel() * buf.element_size() // world
        return (dist.all_reduce(buf.div_(world), async_op=True).get_future()
                .then(lambda fut: fut.value()[0]))

    return hook


def build(a):
    torch.manual_seed(0)  # the same memory on every rank
    return ProductKeyMemory(a.dim, a.dim, n_keys=a.n_keys, heads=4, knn=32, k_dim=a.k_dim,
                            query_batchnorm=False)


def measure(a, sharded: bool, dtype: torch.dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    memory = build(a).to(dtype)
    if sharded:
        memory.values = ShardedValueTable(memory.values,
                                          ShardLayout(dist.group.WORLD, world, rank, world))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            memory, ["values.weight"])
    model = DistributedDataParallel(memory)
    ddp_bytes = {"sent": 0}
    model.register_comm_hook(None, counting_hook(ddp_bytes, world))
    params = list(memory.parameters())
    # fp32 masters of a bf16 model, as fairseq's FP16Optimizer keeps them (fp32: the parameters)
    masters = params if dtype == torch.float32 else [
        torch.nn.Parameter(p.detach().float()) for p in params]
    optimizer = torch.optim.Adam(masters, lr=1e-3)
    torch.manual_seed(1 + rank)  # this rank's tokens
    x = torch.randn(a.tokens, 1, a.dim).to(dtype)
    seconds, sent = [], []
    for step in range(a.repeats + 1):
        ddp_bytes["sent"] = 0
        counter = CollectiveBytes(world)
        dist.barrier()
        start = time.perf_counter()
        with counter:
            loss = model(x).float().pow(2).mean()
            loss.backward()
        finish_gradients(params)
        if masters is not params:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
        optimizer.step()
        if masters is not params:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        optimizer.zero_grad(set_to_none=True)
        memory.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        sent.append(ddp_bytes["sent"] + counter.sent)
    table = memory.values.weight
    master = next(m for p, m in zip(params, masters) if p is table)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"value_params": table.numel(), "value_param_bytes": nbytes(table),
            "value_master_bytes": 0 if master is table else nbytes(master),
            "value_optimizer_state": sum(v.numel() for v in optimizer.state[master].values()
                                         if torch.is_tensor(v) and v.dim() == 2),
            "value_optimizer_state_bytes": sum(nbytes(v) for v in optimizer.state[master].values()
                                               if torch.is_tensor(v) and v.dim() == 2),
            "bytes_sent": sent[-1], "seconds": statistics.median(seconds[1:])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n-keys", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--k-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank and update")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {"world": dist.get_world_size(), "slots": a.n_keys ** 2, "dim": a.dim,
              "tokens_per_rank": a.tokens, "torch": torch.__version__}
    for kind, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        result[kind] = {name: measure(a, sharded, dtype)
                        for name, sharded in (("replicated", False), ("sharded", True))}
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""scripts/costmodel.py: the op-by-op cost model traced on the meta device, the layers'
byte budgets and the generated tables of docs/pkm.md and docs/aop.md."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from scripts import costmodel


class _Bag(nn.Module):
    """A weighted embedding bag [N, m] over a [rows, d] table, then a Linear."""

    def __init__(self, rows=1000, d=16, n=8, m=4):
        super().__init__()
        self.table = nn.Parameter(torch.empty(rows, d))
        self.lin = nn.Linear(d, d, bias=False)
        self.idx = torch.zeros(n, m, dtype=torch.int32)
        self.w = torch.empty(n, m)

    def forward(self, x):
        return self.lin(F.embedding_bag(self.idx, self.table, mode="sum",
                                        per_sample_weights=self.w) + x.view(8, 16))


def test_ops_are_costed_as_they_need_their_bytes():
    """A gather reads one table row per index, not the table; a view moves nothing; a matmul's
    FLOPs are torch.utils.flop_counter's; the floor is the slower of bytes and FLOPs."""
    ops = costmodel.trace(lambda: (_Bag(), (torch.empty(2, 4, 16, requires_grad=True),)))
    fwd = {op.name: op for op in ops if op.phase == "forward"}
    assert "view" not in fwd and "_unsafe_view" not in fwd
    bag = fwd["_embedding_bag"]
    rows_read = 8 * 4 * 16 * 4  # 32 reads of a 16-float row (the table has 1000 rows)
    assert bag.read == rows_read + 32 * 4 + 8 * 4 + 32 * 4  # + indices, offsets, weights
    mm = fwd["mm"]
    assert mm.flops == 2 * 8 * 16 * 16 and mm.read == (8 * 16 + 16 * 16) * 4
    assert mm.floor_s() == max(mm.bytes / 3.35e12, mm.flops / 66.9e12)
    back = [op for op in ops if op.phase == "backward"]
    assert {op.site for op in back} >= {"MmBackward0", "EmbeddingBagBackward0"}


def test_the_memory_layer_moves_at_most_its_budget():
    """The PKM layer at the paper shape (bf16, 16,384 tokens, 512² slots, 4 heads, knn 32),
    forward and backward, moves at most its stated budget: a change that materialises one more
    [H, N, n_keys] float32 block, or int64 ids again, fails (they made 14.31 GB)."""
    layer = costmodel.LAYERS["pkm"]
    assert costmodel.total_bytes(layer) <= layer.budget


def test_the_generated_cost_tables_are_up_to_date():
    """``python -m scripts.costmodel --check`` passes on the docs as committed and fails
    on a stale table."""
    assert costmodel.main(["--check"]) == 0
    text = open(costmodel.DOCS[0]).read()
    assert "<!-- costmodel: pkm -->" in text
    row = "| forward | QueryNetwork.query: `q = self.query_proj(x)` | addmm |"
    assert row in text  # (a row the table holds: the stale copy below differs from the docs)
    stale = text.replace(row, "| forward | x | addmm |")
    assert stale != text and costmodel.update(stale, []) != stale

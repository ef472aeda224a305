"""Bucket plans: every byte once, in order, within the budget; tied tensors sent once."""

import torch

from rlkube_runtime.memory import unique_named_tensors
from rlkube_runtime.weight_sync import plan_buckets


def test_buckets_fill_in_order_and_a_big_tensor_goes_alone_when_rows_cannot_split():
    shapes = [("a", (10,)), ("b", (20,)), ("big", (100, 4)), ("c", (5,))]
    buckets = plan_buckets(shapes, itemsize=2, bucket_bytes=64, split_rows=False)
    # a (20 B) + b (40 B) fit 64 B; big (800 B) alone; c (10 B) after it.
    assert [[p.name for p in b] for b in buckets] == [["a", "b"], ["big"], ["c"]]
    assert [p.rows for b in buckets for p in b] == [None] * 4


def test_split_rows_keeps_every_request_within_the_budget_and_covers_each_row_once():
    shapes = [("emb", (100, 4)), ("norm", (4,)), ("w", (7, 3))]
    buckets = plan_buckets(shapes, itemsize=4, bucket_bytes=100, split_rows=True)
    assert all(sum(p.nbytes for p in b) <= 100 for b in buckets)
    # 16 B per row of emb -> 6 rows (96 B) per piece: [0,6), [6,12), ..., [96,100).
    emb = [p.rows for b in buckets for p in b if p.name == "emb"]
    assert emb[0] == (0, 6) and emb[-1] == (96, 100)
    covered = [r for start, end in emb for r in range(start, end)]
    assert covered == list(range(100))
    assert sum(p.nbytes for b in buckets for p in b) == (400 + 4 + 21) * 4
    assert [p.name for b in buckets for p in b][-2:] == ["norm", "w"]


def test_tied_embedding_and_head_are_sent_once():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.norm = torch.nn.LayerNorm(4)
    assert [n for n, _ in unique_named_tensors(model)] == ["embed.weight", "norm.weight", "norm.bias"]

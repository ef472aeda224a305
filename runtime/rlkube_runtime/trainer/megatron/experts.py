"""Expert parallelism on a megatron trainer rank: what differs when each rank holds only
experts/EP of a mixture-of-experts model's experts.

- Every MoE layer's forward is a collective over the ranks that exchange tokens (megatron's
  tensor-and-expert group): they must run the same number of micro-batches, and on the CPU,
  where tokens travel by all-gather (the all-to-all dispatcher needs CUDA streams), micro-batches
  of one shape. `even_micro_batches` pads with zero-weight fillers and padded rows; padding
  tokens are routed like any other but change no other token's output (no capacity limit).
- An expert's gradient already sums every exchanging rank's tokens: it is not all-reduced over
  data-parallel ranks (megatron marks such parameters `allreduce=False`), and its square counts
  once per expert-parallel rank in the gradient norm.
- Exporting the model gathers each local expert from every expert-parallel rank and names it by
  its global index (rank r's local expert l is global r x experts/EP + l).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import convert


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Whether expert-parallel ranks hold different copies of `param` (an expert's weight)."""
    return not getattr(param, "allreduce", True)


def even_micro_batches(micro: list[dict[str, Any]], filler: Callable[[], dict[str, Any]], group, *,
                       same_shape: bool) -> list[dict[str, Any]]:
    """`micro` with zero-weight `filler()` micro-batches appended until every rank of `group` has
    as many, and (`same_shape`) each one's rows and length padded to the largest of its position
    on any rank. A filler reports no samples (its index is empty)."""
    count = torch.tensor([len(micro)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    micro = micro + [{**filler(), "index": []} for _ in range(int(count) - len(micro))]
    if not same_shape or not micro:
        return micro
    shapes = torch.tensor([list(mb["input_ids"].shape) for mb in micro], dtype=torch.int64)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    return [pad_micro_batch(mb, int(rows), int(length)) for mb, (rows, length) in zip(micro, shapes.tolist())]


def pad_micro_batch(mb: dict[str, Any], rows: int, length: int) -> dict[str, Any]:
    """`mb` with its input rows right-padded to [rows, length] (token 0, causal mask over the
    whole length); the response positions and targets stay where they were."""
    ids = mb["input_ids"]
    if tuple(ids.shape) == (rows, length):
        return mb
    padded = torch.nn.functional.pad(ids, (0, length - ids.shape[1], 0, rows - ids.shape[0]))
    device = ids.device
    return {
        **mb,
        "input_ids": padded,
        "position_ids": torch.arange(length, device=device).expand_as(padded),
        "attention_mask": torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None],
    }


def gather_expert(name: str, tensor: torch.Tensor, *, experts_per_rank: int, group) -> dict[str, torch.Tensor]:
    """Local expert `name` of every expert-parallel rank of `group`, by global expert name."""
    size = dist.get_world_size(group)
    if size == 1:
        return {name: tensor}
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return {convert.shift_expert(name, r * experts_per_rank): part for r, part in enumerate(parts)}

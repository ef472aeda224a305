"""A megatron micro-batch: the tensors the GPTModel and the loss read, built from a TrainBatch."""

from __future__ import annotations

from typing import Any

import torch

from ..batch import TrainBatch
from ..packing import pad_rows


def model_inputs(mb: TrainBatch, index: list[int], *, pad_to: int, device: torch.device, weight: float) -> dict[str, Any]:
    """One micro-batch as model inputs: right-padded rows (length rounded up to a multiple of
    `pad_to`, the tensor-parallel size with sequence parallelism), the causal mask, and where
    each sample's response logits and targets are. `index`: the samples' indices in the batch."""
    rows = pad_rows(mb.tokens)
    rows_idx, cols_idx = rows.response_index(mb.response_lengths)
    length = rows.input_ids.shape[1]
    padded = -(-length // pad_to) * pad_to
    ids = torch.nn.functional.pad(rows.input_ids, (0, padded - length))
    return {
        "input_ids": ids.to(device),
        "position_ids": torch.arange(padded).expand_as(ids).to(device),
        "attention_mask": torch.triu(torch.ones(padded, padded, dtype=torch.bool), 1)[None, None].to(device),
        "rows": rows_idx.to(device),
        "cols": cols_idx.to(device),
        "targets": rows.input_ids[rows_idx, cols_idx + 1].to(device),
        "response_lengths": list(mb.response_lengths),
        "index": index,
        "batch": mb,
        "weight": weight,
    }

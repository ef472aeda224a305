"""The flat layout of a batch: per-sample 1-D tensors concatenated, with per-token segment ids.

A batch of B samples with response lengths L_0..L_{B-1} becomes one tensor of N = sum(L_i) tokens;
`segment_ids[t]` is the index of the sample that token t belongs to. Per-sample statistics are then
one `index_add` instead of a Python loop over samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pack(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Concatenate per-sample tensors.

    Args:
        tensors: B tensors of shape [L_i].

    Returns:
        (flat [N], lengths [B] int64), N = sum(L_i).
    """
    if len(tensors) == 0:
        raise ValueError("pack needs at least one sample tensor, got an empty list")
    lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.long, device=tensors[0].device)
    return torch.cat([t.reshape(-1) for t in tensors]), lengths


def segment_ids_from_lengths(lengths: Tensor | Sequence[int]) -> Tensor:
    """Per-token sample index: lengths [B] -> segment_ids [N] (int64), e.g. [2, 3] -> [0, 0, 1, 1, 1]."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum of `values` [N] per segment -> [num_segments]; differentiable; empty segments give 0."""
    return values.new_zeros(num_segments).index_add(0, segment_ids, values)


def unpack(flat: Tensor, lengths: Tensor | Sequence[int]) -> list[Tensor]:
    """Inverse of `pack`: flat [N] -> B tensors of shape [L_i] (views)."""
    sizes = lengths.tolist() if isinstance(lengths, Tensor) else list(lengths)
    return list(flat.split(sizes))


def pad(tensors: Sequence[Tensor], value: float = 0.0) -> Tensor:
    """Right-pad B tensors [L_i] into one [B, max L_i] tensor filled with `value` past each end."""
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=value)


def unpad(padded: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """Inverse of `pad`: [B, T] -> B tensors [L_i]."""
    return [padded[i, :n] for i, n in enumerate(lengths)]

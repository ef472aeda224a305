"""Micro-batches as padded rows: samples of similar length side by side, right-padded.

A micro-batch of samples with lengths L_1..L_k is one [k, max L] batch, each sample in its own
row from position 0, padding after its last token. With causal attention a real token never
sees a pad (pads come after it), so no mask is needed: attention runs as plain causal
`scaled_dot_product_attention` (PyTorch's flash kernels) and the model computes for every sample
exactly what it would compute for that sample alone (checked to < 1e-5 in fp32 by the tests).
Samples are grouped longest first, so rows of a micro-batch have similar lengths and little
padding; how samples are grouped changes speed, never the loss.

This module only decides groupings and builds the row tensors; it knows nothing of models.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


# Without a budget in the spec, a micro-batch holds up to this many tokens, padding included:
# enough rows to keep the matrix units busy, few enough that the [tokens, vocab] logits stay modest.
DEFAULT_MAX_TOKENS_PER_GPU = 8192


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    dynamic_batch_size: bool,
    max_tokens_per_gpu: int | None = None,
    micro_batch_size: int = 1,
    default_max_tokens: int = DEFAULT_MAX_TOKENS_PER_GPU,
) -> list[list[int]]:
    """Group sample indices into micro-batches.

    Dynamic: `length_sorted_bins` with at most `max_tokens_per_gpu` padded tokens each (None:
    `default_max_tokens`, or the longest sample when that is longer; a sample longer than
    the limit goes alone, with a warning). Fixed: consecutive groups of `micro_batch_size`. Every
    index appears exactly once; indices inside a group are ascending.
    """
    if dynamic_batch_size:
        if max_tokens_per_gpu is None:
            max_tokens_per_gpu = max(default_max_tokens, *lengths) if lengths else default_max_tokens
        if max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu must be a positive token count, got {max_tokens_per_gpu!r}")
        return length_sorted_bins(lengths, max_tokens_per_gpu)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, len(lengths)))) for s in range(0, len(lengths), micro_batch_size)]


def length_sorted_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of samples taken longest first, each as full as rows x longest row <= capacity.

    A bin's cost is its padded size (rows times its first, longest, sample), so sorting keeps the
    padding small: a bin only holds samples no longer than its first. Ties are broken by index,
    so the plan is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    width = 0
    for i in order:
        n = lengths[i]
        if n > capacity:
            log.warning(
                "sample %d has %d tokens, more than max_tokens_per_gpu=%d; it gets a micro-batch of its own",
                i,
                n,
                capacity,
            )
        if bins and (len(bins[-1]) + 1) * width <= capacity:
            bins[-1].append(i)
        else:
            bins.append([i])
            width = n
    return [sorted(b) for b in bins]


def partition_for_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split sample indices across data-parallel ranks, balancing tokens.

    Longest first, each to the rank with the fewest tokens so far (then fewest samples, then
    lowest rank). With at least `world_size` samples every rank gets one. Indices per rank are
    ascending. Any split gives the same step, because the loss is reduced with global counts.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


@dataclass(frozen=True)
class PaddedRows:
    """One micro-batch: input_ids [k, max L] int64 (right-padded with 0), and L_j per row."""

    input_ids: torch.Tensor
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return sum(self.seq_lens)

    def response_index(self, response_lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) [ΣR] of the positions whose logits predict each sample's response
        tokens, concatenated in row order.

        The logits at position t predict token t+1, so sample j's R_j response tokens (its last
        R_j tokens) are predicted by the R_j positions just before them: [L-R-1, L-1). The
        predicted tokens sit at the same rows, columns + 1.
        """
        if len(response_lengths) != len(self.seq_lens):
            raise ValueError(f"{len(response_lengths)} response lengths for {len(self.seq_lens)} rows")
        rows = [torch.full((r,), j, dtype=torch.long) for j, r in enumerate(response_lengths)]
        cols = [torch.arange(n - r - 1, n - 1) for n, r in zip(self.seq_lens, response_lengths)]
        device = self.input_ids.device
        return torch.cat(rows).to(device), torch.cat(cols).to(device)


def pad_rows(tokens: Sequence[torch.Tensor], *, device: torch.device | str | None = None) -> PaddedRows:
    """Stack 1-D token tensors as right-padded rows."""
    if not tokens:
        raise ValueError("cannot build an empty micro-batch")
    seq_lens = tuple(int(t.numel()) for t in tokens)
    input_ids = torch.zeros((len(tokens), max(seq_lens)), dtype=torch.long)
    for j, t in enumerate(tokens):
        input_ids[j, : seq_lens[j]] = t.reshape(-1)
    return PaddedRows(input_ids=input_ids.to(device), seq_lens=seq_lens)

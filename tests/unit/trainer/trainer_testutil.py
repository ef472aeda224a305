"""Helpers for the trainer tests (a module, not conftest.py, so test files can import it)."""

from __future__ import annotations

import torch
from rlkube_runtime.trainer.batch import TrainBatch


def random_batch(
    lengths: list[tuple[int, int]],
    *,
    advantages: list[float] | None = None,
    seed: int = 0,
    vocab: tuple[int, int] = (8, 90),
    masked_tail: bool = True,
) -> TrainBatch:
    """Samples of (total length, response length) with random tokens.

    Advantages default to random per token; each sample's last response token is masked out
    when `masked_tail` (and the response is longer than 1), so masks are not all ones.
    """
    g = torch.Generator().manual_seed(seed)
    tokens, masks, advs = [], [], []
    for i, (total, response) in enumerate(lengths):
        tokens.append(torch.randint(vocab[0], vocab[1], (total,), generator=g))
        mask = torch.ones(response)
        if masked_tail and response > 1:
            mask[-1] = 0.0
        masks.append(mask)
        if advantages is None:
            advs.append(torch.randn(response, generator=g))
        else:
            advs.append(torch.full((response,), float(advantages[i])))
    return TrainBatch(
        tokens=tokens, response_lengths=[r for _, r in lengths], loss_masks=masks, advantages=advs
    )

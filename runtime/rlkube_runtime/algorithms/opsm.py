"""Off-policy sequence masking (OPSM; slime `--use-opsm`, `compute_opsm_mask`): a sample whose
advantage is negative and whose generating policy has drifted from the current one by more than
`delta` (masked mean of behaviour - current log-probs over its tokens) gets no policy-gradient
loss. Pushing down a sequence the current policy would not produce any more mostly adds noise;
with a deep async buffer those are the stale, failed samples.

The behaviour policy is the engine's (its log-probs of the sampled tokens), as slime with
`--use-rollout-logprobs`: the trainer's own recomputation is the current policy at the first step
of a rollout, so it would measure no drift at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import as_float


class OpsmMask(NamedTuple):
    keep: Tensor  # [T] 0.0 on the tokens of masked samples, else 1.0 (detached)
    masked: Tensor  # [T] 1.0 - keep (its loss-weighted mean: the share of the loss masked)
    sequence_kl: Tensor  # [num_segments] masked mean of behaviour - current log-probs per sample


def opsm_mask(
    log_probs: Tensor, behaviour_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    segment_ids: Tensor, num_segments: int, *, delta: float,
) -> OpsmMask:
    """Flat [T] inputs of `num_segments` samples (`segment_ids`: each token's sample)."""
    if not delta >= 0:
        raise ValueError(f"opsm delta={delta!r} must be >= 0 (slime's default is 1e-4)")
    with torch.no_grad():
        mask_f = as_float(mask)
        drift = (as_float(behaviour_log_probs) - as_float(log_probs)) * mask_f
        total = torch.zeros(num_segments, dtype=drift.dtype, device=drift.device).index_add_(0, segment_ids, drift)
        count = torch.zeros(num_segments, dtype=drift.dtype, device=drift.device).index_add_(0, segment_ids, mask_f)
        sequence_kl = total / count.clamp_min(1)
        masked = ((as_float(advantages) < 0) & (sequence_kl[segment_ids] > delta)).to(drift.dtype)
    return OpsmMask(1.0 - masked, masked, sequence_kl)

"""Truncated importance sampling (TIS) between the trainer's and the rollout engine's log-probs.

The engine samples with its own kernels, so its per-token log-probs differ slightly from the
trainer's recomputation of the same (old) policy. TIS reweights each token's policy-gradient loss by
w = clamp(exp(old_log_probs - rollout_log_probs), clip_low, clip), detached (slime: `--use-tis`,
`--tis-clip` default 2.0, `--tis-clip-low` default 0; `vanilla_tis_function`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._common import as_float


class TisWeights(NamedTuple):
    """TIS outputs, all of the input's shape and detached."""

    weights: Tensor  # clamp(ratio, clip_low, clip): multiplies the per-token pg loss
    ratio: Tensor  # exp(old_log_probs - rollout_log_probs) before clamping (slime's "tis" metric)
    clipfrac: Tensor  # 1.0 where the clamp changed the ratio, else 0.0 (slime's "tis_clipfrac")


def tis_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, *, clip: float = 2.0, clip_low: float = 0.0
) -> TisWeights:
    """Truncated importance weights per token.

    Args:
        old_log_probs: [...] the trainer's log-probs of the sampled tokens under the rollout policy.
        rollout_log_probs: [...] the engine's log-probs of the same tokens.
        clip: upper bound of the weight (> 0).
        clip_low: lower bound of the weight (0 <= clip_low <= clip).

    Returns:
        TisWeights(weights, ratio, clipfrac), each [...] and detached.
    """
    if not clip > 0:
        raise ValueError(f"tis_clip={clip!r} must be > 0 (slime's default is 2.0)")
    if not 0 <= clip_low <= clip:
        raise ValueError(f"tis_clip_low={clip_low!r} must be in [0, tis_clip={clip!r}] (slime's default is 0)")
    with torch.no_grad():
        ratio = (as_float(old_log_probs) - as_float(rollout_log_probs)).exp()
        weights = ratio.clamp(min=clip_low, max=clip)
        clipfrac = (weights != ratio).to(ratio.dtype)
    return TisWeights(weights, ratio, clipfrac)

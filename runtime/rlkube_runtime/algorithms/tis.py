"""Truncated importance sampling (TIS) between the trainer's and the rollout engine's log-probs.

The engine samples with its own kernels, so its per-token log-probs differ slightly from the
trainer's recomputation of the same (old) policy. TIS reweights each token's policy-gradient loss by
w = clamp(exp(old_log_probs - rollout_log_probs), clip_low, clip), detached (slime: `--use-tis`,
`--tis-clip` default 2.0, `--tis-clip-low` default 0; `vanilla_tis_function`).

slime's mismatch helper (examples/train_infer_mismatch_helper/mis.py) adds two choices, kept here:
the ratio per token (`token`), per sample as the product over its tokens (`sequence`) or their
geometric mean (`geometric`), every token of a sample then sharing its sample's ratio; and what an
out-of-bounds ratio does: `truncate` clamps it to the bounds, `mask` drops the token's loss
(masked importance sampling, MIS). Per-sample log-ratios are bounded to +-20 before exp, as slime's.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ._common import as_float


class TisWeights(NamedTuple):
    """TIS outputs, all of the input's shape and detached."""

    weights: Tensor  # clamp(ratio, clip_low, clip): multiplies the per-token pg loss
    ratio: Tensor  # exp(old_log_probs - rollout_log_probs) before clamping (slime's "tis" metric)
    clipfrac: Tensor  # 1.0 where the bounds changed the weight (clamped or masked), else 0.0 ("tis_clipfrac")


TisLevel = Literal["token", "sequence", "geometric"]
TisMode = Literal["truncate", "mask"]
SEQUENCE_LOG_RATIO_BOUND = 20.0  # slime's SAFETY_BOUND: keeps exp() of a long sequence's sum finite


def tis_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, *, clip: float = 2.0, clip_low: float = 0.0,
    level: TisLevel = "token", mode: TisMode = "truncate",
    mask: Tensor | None = None, segment_ids: Tensor | None = None, num_segments: int | None = None,
) -> TisWeights:
    """Importance weights per token.

    Args:
        old_log_probs: [T] the trainer's log-probs of the sampled tokens under the rollout policy.
        rollout_log_probs: [T] the engine's log-probs of the same tokens.
        clip: upper bound of the weight (> 0).
        clip_low: lower bound of the weight (0 <= clip_low <= clip).
        level: token, sequence or geometric (see the module docstring); the last two need the
            flat layout: `mask` [T] (tokens that count), `segment_ids` [T] and `num_segments`.
        mode: truncate (clamp to [clip_low, clip]) or mask (weight 0 outside it).

    Returns:
        TisWeights(weights, ratio, clipfrac), each [T] and detached.
    """
    if not clip > 0:
        raise ValueError(f"tis_clip={clip!r} must be > 0 (slime's default is 2.0)")
    if not 0 <= clip_low <= clip:
        raise ValueError(f"tis_clip_low={clip_low!r} must be in [0, tis_clip={clip!r}] (slime's default is 0)")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"tis mode={mode!r} is not known; use truncate or mask")
    with torch.no_grad():
        log_ratio = as_float(old_log_probs) - as_float(rollout_log_probs)
        if level != "token":
            log_ratio = _per_sample(log_ratio, level, mask, segment_ids, num_segments)
        ratio = log_ratio.exp()
        if mode == "truncate":
            weights = ratio.clamp(min=clip_low, max=clip)
        else:
            weights = torch.where((ratio >= clip_low) & (ratio <= clip), ratio, torch.zeros_like(ratio))
        clipfrac = (weights != ratio).to(ratio.dtype)
    return TisWeights(weights, ratio, clipfrac)


def _per_sample(log_ratio: Tensor, level: str, mask, segment_ids, num_segments) -> Tensor:
    """Each token's log-ratio replaced by its sample's: the masked sum (sequence) or mean (geometric)."""
    if level not in ("sequence", "geometric"):
        raise ValueError(f"tis level={level!r} is not known; use token, sequence or geometric")
    if mask is None or segment_ids is None or num_segments is None:
        raise ValueError(f"tis level={level!r} needs mask, segment_ids and num_segments")
    mask_f = as_float(mask)
    zeros = torch.zeros(num_segments, dtype=log_ratio.dtype, device=log_ratio.device)
    total = zeros.index_add(0, segment_ids, log_ratio * mask_f)
    if level == "geometric":
        total = total / zeros.index_add(0, segment_ids, mask_f).clamp_min(1)
    return total.clamp(-SEQUENCE_LOG_RATIO_BOUND, SEQUENCE_LOG_RATIO_BOUND)[segment_ids]

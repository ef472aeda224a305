"""Masked means that stay exact when a global batch is split into micro-batches.

Two ways to average a per-token quantity x over a global batch of S samples (masks m):
  per-sample: (1/S) * sum_s [ sum_t m_st x_st / max(sum_t m_st, 1) ]     (slime's default)
  per-token:  sum_{s,t} m_st x_st / M,  M = number of masked tokens   (`--calculate-per-token-loss`)
Both are sums over tokens of x_t * w_t with a per-token weight w_t that only needs the sample's own
mask and the GLOBAL counts S and M. So each micro-batch returns sum_t x_t w_t over its own tokens,
and the contributions of all micro-batches (and data-parallel ranks) add up to the global mean,
whatever the packing, as long as every sample sits whole in one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .segments import segment_sum


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / max(sum(mask), 1), over all elements or along `dim`.

    Args:
        values: [...] any shape.
        mask: [...] same shape, 1 for elements that count.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) with the mean and variance over the masked elements.

    Matches slime's `distributed_masked_whiten` on one process: the variance is unbiased (Bessel's
    correction) when at least 2 elements are masked, eps = 1e-8 is added inside the square root,
    and every element (masked or not) is transformed. With shift_mean=False values are only scaled.

    Args:
        values: [N] (any shape works).
        mask: same shape, 1 for elements that count; at least one must be set.
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count.item() == 0:
        raise ValueError("masked_whiten needs at least one masked element; every loss_mask is all zero")
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / count
    if count.item() >= 2:
        var = var * count / (count - 1)
    inv_std = torch.rsqrt(var + eps)
    return (values - mean) * inv_std if shift_mean else values * inv_std


def global_counts(loss_masks: Sequence[Tensor]) -> tuple[int, int]:
    """(number of samples, number of masked tokens) of a global batch, for the reducers below.

    Args:
        loss_masks: one [L_i] mask per sample of the whole global batch (all micro-batches, all ranks).
    """
    num_tokens = int(sum(int(m.sum().item()) for m in loss_masks))
    return len(loss_masks), num_tokens


def _check_counts(global_num_samples: int, global_num_tokens: int | float) -> None:
    if isinstance(global_num_samples, bool) or not isinstance(global_num_samples, int) or global_num_samples < 1:
        raise ValueError(
            f"global_num_samples={global_num_samples!r} must be a positive int: "
            "the number of samples in the whole global batch"
        )
    if not global_num_tokens >= 0:
        raise ValueError(
            f"global_num_tokens={global_num_tokens!r} must be >= 0: the number of masked tokens in the global batch"
        )


def loss_token_weights(
    mask: Tensor,
    segment_ids: Tensor,
    *,
    num_segments: int,
    per_token_loss: bool,
    global_num_samples: int,
    global_num_tokens: int | float,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Per-token weights w such that sum_t x_t * w_t is this micro-batch's share of the global mean.

    Args:
        mask: [N] loss mask of the micro-batch's tokens (flat).
        segment_ids: [N] int64 sample index of each token, in [0, num_segments).
        num_segments: number of samples in the micro-batch.
        per_token_loss: True for the per-token mean, False for the per-sample mean.
        global_num_samples: samples in the global batch (per-sample mode).
        global_num_tokens: masked tokens in the global batch (per-token mode); 0 is treated as 1.
        dtype: dtype of the weights (use the values' dtype); None means float32.

    Returns:
        [N] weights; not differentiable.
    """
    _check_counts(global_num_samples, global_num_tokens)
    mask = mask.detach().to(dtype or torch.float32)
    if per_token_loss:
        return mask / max(float(global_num_tokens), 1.0)
    per_sample = segment_sum(mask, segment_ids, num_segments).clamp(min=1)
    return mask / (per_sample[segment_ids] * global_num_samples)


def reduce_per_sample(
    values: Tensor, mask: Tensor, segment_ids: Tensor, *, num_segments: int, global_num_samples: int
) -> Tensor:
    """This micro-batch's share of the global "mean over samples of each sample's masked token mean".

    Args:
        values: [N] per-token values (flat over the micro-batch's samples).
        mask: [N] loss mask.
        segment_ids: [N] sample index of each token.
        num_segments: samples in the micro-batch.
        global_num_samples: samples in the global batch.

    Returns:
        scalar; differentiable w.r.t. values.
    """
    weights = loss_token_weights(
        mask,
        segment_ids,
        num_segments=num_segments,
        per_token_loss=False,
        global_num_samples=global_num_samples,
        global_num_tokens=0,
        dtype=values.dtype,
    )
    return (values * weights).sum()


def reduce_per_token(values: Tensor, mask: Tensor, *, global_num_tokens: int | float) -> Tensor:
    """This micro-batch's share of the global "sum over masked tokens / number of masked tokens".

    Args:
        values: [N] per-token values.
        mask: [N] loss mask.
        global_num_tokens: masked tokens in the global batch (0 is treated as 1).

    Returns:
        scalar; differentiable w.r.t. values.
    """
    _check_counts(1, global_num_tokens)
    return (values * mask.to(values.dtype)).sum() / max(float(global_num_tokens), 1.0)


def reduce_loss(
    values: Tensor,
    mask: Tensor,
    segment_ids: Tensor,
    *,
    num_segments: int,
    per_token_loss: bool,
    global_num_samples: int,
    global_num_tokens: int | float,
) -> Tensor:
    """`reduce_per_token` if per_token_loss else `reduce_per_sample`; shapes as there; returns a scalar."""
    weights = loss_token_weights(
        mask,
        segment_ids,
        num_segments=num_segments,
        per_token_loss=per_token_loss,
        global_num_samples=global_num_samples,
        global_num_tokens=global_num_tokens,
        dtype=values.dtype,
    )
    return (values * weights).sum()

"""Per-token PPO-style policy losses and the clipped value loss (slime `compute_policy_loss`).

Everything works on the flat layout (see `segments`): N tokens of a micro-batch concatenated, with
`segment_ids` [N] giving each token's sample. The losses are per token; `reduction` turns them into
the configured mean.

ppo_kl is log pi_old - log pi (so ratio = exp(-ppo_kl)). Token-level estimators use it per token;
GSPO uses one value per sample, the masked mean of the token values, broadcast to the sample's tokens
(slime `compute_gspo_kl`; no detach, so the gradient flows through the sequence mean).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._common import as_float
from .segments import segment_sum

PpoKlFunction = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]


def token_ppo_kl(
    log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor, segment_ids: Tensor, num_segments: int
) -> Tensor:
    """old_log_probs - log_probs per token -> [N] (loss_mask, segment_ids, num_segments unused)."""
    return as_float(old_log_probs) - as_float(log_probs)


def sequence_ppo_kl(
    log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor, segment_ids: Tensor, num_segments: int
) -> Tensor:
    """GSPO: each sample's masked mean of (old_log_probs - log_probs), broadcast to its tokens.

    Args:
        log_probs: [N] current policy (differentiable).
        old_log_probs: [N] policy at rollout time.
        loss_mask: [N] 1 for tokens that count.
        segment_ids: [N] sample index of each token.
        num_segments: number of samples.

    Returns:
        [N]; token t of sample s holds sum_u m_su (old_su - new_su) / max(sum_u m_su, 1).
    """
    diff = as_float(old_log_probs) - as_float(log_probs)
    mask = loss_mask.to(diff.dtype)
    per_sample = segment_sum(diff * mask, segment_ids, num_segments) / segment_sum(
        mask, segment_ids, num_segments
    ).clamp(min=1)
    return per_sample[segment_ids]


# Which ratio each advantage estimator trains with (keys match `advantages.ADVANTAGE_ESTIMATORS`).
PPO_KL_FUNCTIONS: dict[str, PpoKlFunction] = {
    "grpo": token_ppo_kl,
    "gspo": sequence_ppo_kl,
    "reinforce_plus_plus": token_ppo_kl,
    "reinforce_plus_plus_baseline": token_ppo_kl,
    "ppo": token_ppo_kl,
}


def check_clip_params(eps_clip: float, eps_clip_high: float | None, eps_clip_c: float | None) -> float:
    """Validate the clip parameters; returns eps_clip_high (eps_clip when None)."""
    if not eps_clip >= 0:
        raise ValueError(f"eps_clip={eps_clip!r} must be >= 0 (typical: 0.2)")
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not eps_clip_high >= 0:
        raise ValueError(f"eps_clip_high={eps_clip_high!r} must be >= 0 (typical: 0.28, or None for eps_clip)")
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c={eps_clip_c!r} must be > 1 for dual-clip PPO (typical: 3.0), or None to disable")
    return eps_clip_high


def clipped_policy_loss(
    ppo_kl: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, with clip-higher and optional dual clip.

    ratio = exp(-ppo_kl)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    dual clip (eps_clip_c > 1): where A < 0, loss = min(loss, -A * eps_clip_c)
    clipfrac = 1 where the clipped term is strictly larger than the unclipped one (before dual clip).

    Args:
        ppo_kl: [N] log pi_old - log pi per token (token or sequence level), differentiable.
        advantages: [N] per-token advantages (treated as constants).
        eps_clip, eps_clip_high, eps_clip_c: see above; eps_clip_high None means eps_clip.

    Returns:
        (pg_losses [N], clipfrac [N] float 0/1, detached).
    """
    eps_clip_high = check_clip_params(eps_clip, eps_clip_high, eps_clip_c)
    advantages = advantages.detach().to(ppo_kl.dtype)
    ratio = (-ppo_kl).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(ppo_kl.dtype).detach()
    if eps_clip_c is not None:
        losses = torch.where(advantages < 0, torch.minimum(losses, -advantages * eps_clip_c), losses)
    return losses, clipfrac


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, value_clip: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss per token (slime `value_loss_function`; no 0.5 factor).

    v_clipped = old + clip(values - old, -value_clip, value_clip)
    loss = max((v_clipped - returns)^2, (values - returns)^2)

    Args:
        values: [N] current value predictions (differentiable).
        old_values: [N] predictions at rollout time.
        returns: [N] targets (advantages + old values from GAE).
        value_clip: > 0.

    Returns:
        (loss [N], clipfrac [N] float 0/1 where |values - old_values| > value_clip, detached).
    """
    if not value_clip > 0:
        raise ValueError(f"value_clip={value_clip!r} must be > 0 (typical: 0.2)")
    values = as_float(values)
    old_values = old_values.detach().to(values.dtype)
    returns = returns.detach().to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    clipfrac = ((values - old_values).abs() > value_clip).to(values.dtype).detach()
    return loss, clipfrac

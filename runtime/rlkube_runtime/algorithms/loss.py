"""The objectives the trainer calls once per micro-batch (slime `policy_loss_function`, `value_loss_function`).

Every term and metric is reduced with the same exact micro-batch-additive weights (`reduction`):
each value returned is this micro-batch's share of the global-batch mean, so summing a key over all
micro-batches (and data-parallel ranks) of an optimizer step gives the global value, and summing the
losses before `backward` gives the gradient of the global loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import as_float, check_same_layout, lookup
from .kl import KL_ESTIMATORS, compute_approx_kl
from .policy_loss import PPO_KL_FUNCTIONS, check_clip_params, clipped_policy_loss, clipped_value_loss
from .reduction import loss_token_weights
from .segments import segment_ids_from_lengths
from .opsm import opsm_mask
from .tis import tis_weights
from ..spec.algorithm import AlgorithmSpec, OpsmSpec, TisSpec
from ..spec.base import spec_default


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy objective's settings (everything `policy_objective` takes besides tensors and
    counts); defaults are spec.algorithm's. Checked where used, by the loss's own registries.

    estimator: a key of `PPO_KL_FUNCTIONS` (same names as the advantage estimators).
    eps_clip, eps_clip_high, eps_clip_c: clip range [1 - eps_clip, 1 + eps_clip_high] (None:
        eps_clip) and the dual-clip bound (> 1, or None).
    use_kl_loss, kl_loss_coef, kl_loss_type: KL(current || reference) term in the loss; with
        coefficient 0 it is reported but not added (and not differentiated).
    entropy_coef: weight of the entropy bonus.
    use_tis, tis_clip, tis_clip_low, tis_level, tis_mode: (truncated or masked) importance sampling
        against rollout_log_probs (`tis.py`).
    use_opsm, opsm_delta: off-policy sequence masking against rollout_log_probs (`opsm.py`).
    per_token_loss: mean over all masked tokens instead of mean over samples of token means.
    """

    estimator: str = spec_default(AlgorithmSpec, "advantage_estimator")
    eps_clip: float = spec_default(AlgorithmSpec, "eps_clip")
    eps_clip_high: float | None = spec_default(AlgorithmSpec, "eps_clip_high")
    eps_clip_c: float | None = spec_default(AlgorithmSpec, "eps_clip_c")
    use_kl_loss: bool = spec_default(AlgorithmSpec, "use_kl_loss")
    kl_loss_coef: float = spec_default(AlgorithmSpec, "kl_loss_coef")
    kl_loss_type: str = spec_default(AlgorithmSpec, "kl_loss_type")
    entropy_coef: float = spec_default(AlgorithmSpec, "entropy_coef")
    use_tis: bool = spec_default(TisSpec, "enabled")
    tis_clip: float = spec_default(TisSpec, "clip")
    tis_clip_low: float = spec_default(TisSpec, "clip_low")
    tis_level: str = spec_default(TisSpec, "level")
    tis_mode: str = spec_default(TisSpec, "mode")
    use_opsm: bool = spec_default(OpsmSpec, "enabled")
    opsm_delta: float = spec_default(OpsmSpec, "delta")
    per_token_loss: bool = spec_default(AlgorithmSpec, "per_token_loss")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def policy_objective(
    *,
    log_probs: Sequence[Tensor],
    old_log_probs: Sequence[Tensor],
    advantages: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    entropy: Sequence[Tensor] | None = None,
    ref_log_probs: Sequence[Tensor] | None = None,
    rollout_log_probs: Sequence[Tensor] | None = None,
    config: PolicyLossConfig,
    global_num_samples: int,
    global_num_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of one micro-batch: pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss.

    Per token: ratio from ppo_kl = old - new (per sample for gspo), PPO clipped surrogate with
    clip-higher and optional dual clip, times the TIS weight when use_tis. Each term is then reduced
    per sample or per token (`per_token_loss`) against the global counts.

    Args:
        log_probs: B tensors [L_i], current policy (differentiable).
        old_log_probs: B tensors [L_i], the trainer's recomputation of the rollout policy.
        advantages: B tensors [L_i] (`compute_advantages`), treated as constants.
        loss_masks: B tensors [L_i], 1 for tokens that count.
        entropy: B tensors [L_i] per-token entropy of the current policy (needed when entropy_coef != 0).
        ref_log_probs: B tensors [L_i], reference policy (needed when use_kl_loss).
        rollout_log_probs: B tensors [L_i], the engine's log-probs (needed when use_tis).
        config: the objective's settings (`PolicyLossConfig`).
        global_num_samples, global_num_tokens: samples and masked tokens of the whole global batch
            (`reduction.global_counts`).

    Returns:
        (loss: scalar differentiable w.r.t. log_probs (and entropy), metrics: detached scalars
        "loss", "pg_loss", "pg_clipfrac", "ppo_kl", plus "entropy_loss" when entropy is given,
        "kl_loss" when use_kl_loss, "tis" (mean unclamped ratio, as slime) and "tis_clipfrac" when
        use_tis, "opsm_clipfrac" (the loss-weighted share of tokens masked) when use_opsm, and "train_rollout_logprob_abs_diff" when rollout_log_probs is given).
    """
    c = config
    ppo_kl_fn = lookup(PPO_KL_FUNCTIONS, c.estimator, "estimator")
    check_clip_params(c.eps_clip, c.clip_high, c.eps_clip_c)
    if c.use_kl_loss:
        lookup(KL_ESTIMATORS, c.kl_loss_type, "kl_loss_type")
        if ref_log_probs is None:
            raise ValueError("use_kl_loss=True needs ref_log_probs (the reference policy's log-probs)")
    if c.use_tis and rollout_log_probs is None:
        raise ValueError("use_tis=True needs rollout_log_probs (the engine's log-probs of the sampled tokens)")
    if c.use_opsm and rollout_log_probs is None:
        raise ValueError("use_opsm=True needs rollout_log_probs (the engine's log-probs: the behaviour policy)")
    if entropy is None and c.entropy_coef != 0:
        raise ValueError(
            f"entropy_coef={c.entropy_coef!r} needs the per-token entropy; pass entropy (or set entropy_coef=0)"
        )

    if len(loss_masks) == 0:
        raise ValueError("loss_masks is empty; a micro-batch needs at least one sample")
    num_samples = len(loss_masks)
    lengths = torch.tensor([m.numel() for m in loss_masks], dtype=torch.long, device=loss_masks[0].device)
    segment_ids = segment_ids_from_lengths(lengths)
    mask = torch.cat([m.reshape(-1) for m in loss_masks])

    def flat(name: str, tensors: Sequence[Tensor]) -> Tensor:
        check_same_layout(name, tensors, loss_masks, "loss_masks")
        return as_float(torch.cat([t.reshape(-1) for t in tensors]))

    log_probs_flat = flat("log_probs", log_probs)
    old_flat = flat("old_log_probs", old_log_probs).detach()
    advantages_flat = flat("advantages", advantages).detach()
    weights = loss_token_weights(
        mask,
        segment_ids,
        num_segments=num_samples,
        per_token_loss=c.per_token_loss,
        global_num_samples=global_num_samples,
        global_num_tokens=global_num_tokens,
        dtype=log_probs_flat.dtype,
    )

    def reduce(x: Tensor) -> Tensor:
        return (x * weights).sum()

    ppo_kl = ppo_kl_fn(log_probs_flat, old_flat, mask, segment_ids, num_samples)
    pg_losses, pg_clipfrac = clipped_policy_loss(
        ppo_kl, advantages_flat, eps_clip=c.eps_clip, eps_clip_high=c.clip_high, eps_clip_c=c.eps_clip_c
    )
    metrics: dict[str, Tensor] = {}
    if c.use_tis:
        rollout_flat = flat("rollout_log_probs", rollout_log_probs).detach()
        tis = tis_weights(old_flat, rollout_flat, clip=c.tis_clip, clip_low=c.tis_clip_low, level=c.tis_level,
                          mode=c.tis_mode, mask=mask, segment_ids=segment_ids, num_segments=num_samples)
        pg_losses = pg_losses * tis.weights.to(pg_losses.dtype)
    if c.use_opsm:
        opsm = opsm_mask(log_probs_flat, flat("rollout_log_probs", rollout_log_probs), advantages_flat, mask,
                         segment_ids, num_samples, delta=c.opsm_delta)
        pg_losses = pg_losses * opsm.keep.to(pg_losses.dtype)

    pg_loss = reduce(pg_losses)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["pg_clipfrac"] = reduce(pg_clipfrac)
    metrics["ppo_kl"] = reduce(ppo_kl)

    if entropy is not None:
        entropy_loss = reduce(flat("entropy", entropy))
        metrics["entropy_loss"] = entropy_loss
        if c.entropy_coef != 0:
            loss = loss - c.entropy_coef * entropy_loss

    if c.use_kl_loss:
        with_grad = c.kl_loss_coef != 0
        current = log_probs_flat if with_grad else log_probs_flat.detach()
        kl_loss = reduce(compute_approx_kl(current, flat("ref_log_probs", ref_log_probs).detach(), c.kl_loss_type))
        metrics["kl_loss"] = kl_loss
        if with_grad:
            loss = loss + c.kl_loss_coef * kl_loss

    if c.use_tis:
        metrics["tis"] = reduce(tis.ratio)
        metrics["tis_clipfrac"] = reduce(tis.clipfrac)
    if c.use_opsm:
        metrics["opsm_clipfrac"] = reduce(opsm.masked)
    if rollout_log_probs is not None:
        rollout_flat = flat("rollout_log_probs", rollout_log_probs).detach()
        metrics["train_rollout_logprob_abs_diff"] = reduce((old_flat - rollout_flat).abs())

    metrics = {"loss": loss, **metrics}
    return loss, {key: value.detach() for key, value in metrics.items()}


def value_objective(
    *,
    values: Sequence[Tensor],
    old_values: Sequence[Tensor],
    returns: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    value_clip: float,
    per_token_loss: bool = False,
    global_num_samples: int,
    global_num_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of one micro-batch (PPO critic), reduced like `policy_objective`.

    Args:
        values: B tensors [L_i], current critic values (differentiable).
        old_values: B tensors [L_i], values at rollout time.
        returns: B tensors [L_i] from `compute_advantages(\"ppo\", ...)`.
        loss_masks: B tensors [L_i].
        value_clip: > 0.
        per_token_loss, global_num_samples, global_num_tokens: as in `policy_objective`.

    Returns:
        (loss scalar, metrics {"value_loss", "value_clipfrac"} detached).
    """
    if len(loss_masks) == 0:
        raise ValueError("loss_masks is empty; a micro-batch needs at least one sample")
    for name, tensors in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_same_layout(name, tensors, loss_masks, "loss_masks")
    lengths = torch.tensor([m.numel() for m in loss_masks], dtype=torch.long, device=loss_masks[0].device)
    mask = torch.cat([m.reshape(-1) for m in loss_masks])
    losses, clipfrac = clipped_value_loss(
        torch.cat([v.reshape(-1) for v in values]),
        torch.cat([v.reshape(-1) for v in old_values]),
        torch.cat([r.reshape(-1) for r in returns]),
        value_clip=value_clip,
    )
    weights = loss_token_weights(
        mask,
        segment_ids_from_lengths(lengths),
        num_segments=len(loss_masks),
        per_token_loss=per_token_loss,
        global_num_samples=global_num_samples,
        global_num_tokens=global_num_tokens,
        dtype=losses.dtype,
    )
    loss = (losses * weights).sum()
    return loss, {"value_loss": loss.detach(), "value_clipfrac": (clipfrac * weights).sum().detach()}

"""Advantage estimators: per-sample scalar rewards (and per-token KL/values) -> per-token advantages.

Samples are grouped by prompt: `group_size` consecutive samples share a prompt. Every per-token
tensor of sample i has the length of `loss_masks[i]` (its response tokens). Results are detached.

| estimator                    | advantage per token                                  | whitened by default |
|------------------------------|------------------------------------------------------|---------------------|
| grpo, gspo                   | (r - group mean) / (group std + 1e-6), or r - mean   | no                  |
| reinforce_plus_plus          | G_t = sum_k gamma^k r_{t+k}, r_t = -kl_coef*kl_t (+ r on last masked token) | yes |
| reinforce_plus_plus_baseline | (r - group mean) - kl_coef * kl_t                    | yes                 |
| ppo                          | GAE(gamma, lambda) on r_t = -kl_coef*kl_t (+ r on last token) and values | yes |

This follows slime (`slime/ray/rollout.py::_post_process_rewards` for the group statistics: unbiased
std, eps 1e-6 added to the std, std only for grpo/gspo; `slime/utils/ppo_utils.py` for the
estimators; `slime/backends/megatron_utils/loss.py::compute_advantages_and_returns` for whitening).
slime whitens only under `--normalize-advantages` (default off, any estimator); here whitening
defaults on for the estimators whose papers define it over the batch (REINFORCE++, PPO) and off for
GRPO/GSPO, and `normalize_advantages=True/False` overrides that for any estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import as_float, check_range, check_same_layout, lookup
from .reduction import masked_whiten
from .segments import pad, unpad

GRPO_STD_EPS = 1e-6  # slime adds it to the group std
_SCAN_CHUNK = 128


def group_normalize(
    rewards: Tensor, group_size: int, *, std_normalization: bool = True, eps: float = GRPO_STD_EPS
) -> Tensor:
    """Centre each group's rewards and optionally divide by the group's std.

    r'_i = (r_i - mean_g) / (std_g + eps) with the unbiased std (torch.std's default), or
    r'_i = r_i - mean_g without std normalisation. A group whose rewards are all equal gives zeros.
    A group of one sample has no std; its (zero) centred reward is returned as is.

    Args:
        rewards: [B] scalar rewards, B a multiple of group_size, groups consecutive.
        group_size: samples per prompt (>= 1).

    Returns:
        [B] normalised rewards.
    """
    _check_groups(rewards.numel(), group_size)
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalization and group_size > 1:
        centred = centred / (groups.std(dim=-1, keepdim=True) + eps)
    return centred.reshape(-1)


def discounted_cumsum(x: Tensor, factor: float) -> Tensor:
    """Reverse discounted cumulative sum along the last dim: y_t = x_t + factor * y_{t+1}, y_T = 0.

    A chunked scan (matrix product inside chunks of 128 steps, a recurrence across chunks), so long
    responses cost T/128 sequential steps instead of T.

    Args:
        x: [B, T].
        factor: in [0, 1] (gamma, or gamma * lambda for GAE).

    Returns:
        [B, T].
    """
    check_range("factor", factor, 0.0, 1.0)
    if factor == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    batch, steps = x.shape
    if steps == 0:
        return x.clone()
    rev = x.flip(-1)
    chunk = min(_SCAN_CHUNK, steps)
    padded = -steps % chunk
    rev = torch.nn.functional.pad(rev, (0, padded))
    num_chunks = rev.shape[-1] // chunk
    idx = torch.arange(chunk, device=x.device)
    diff = idx[None, :] - idx[:, None]  # diff[i, j] = j - i
    base = torch.tensor(factor, dtype=x.dtype, device=x.device)
    # local[j] = sum_{i <= j} factor^(j - i) * rev[i] within a chunk (0^0 = 1 keeps factor 0 exact).
    kernel = torch.where(
        diff >= 0, base.pow(diff.clamp(min=0).to(x.dtype)), torch.zeros((), dtype=x.dtype, device=x.device)
    )
    local = rev.reshape(batch, num_chunks, chunk) @ kernel
    carry_pow = base.pow(torch.arange(1, chunk + 1, device=x.device, dtype=x.dtype))
    out = torch.empty_like(local)
    carry = x.new_zeros(batch)
    for c in range(num_chunks):
        out[:, c] = local[:, c] + carry[:, None] * carry_pow
        carry = out[:, c, -1]
    return out.reshape(batch, -1)[:, :steps].flip(-1)


def gae(rewards: Tensor, values: Tensor, *, gamma: float, gae_lambda: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on right-padded [B, T] tensors (zeros past each sample's end).

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the end = 0); A_t = delta_t + gamma*lambda*A_{t+1};
    returns_t = A_t + V_t.

    Returns:
        (advantages [B, T], returns [B, T]).
    """
    check_range("gamma", gamma, 0.0, 1.0)
    check_range("gae_lambda", gae_lambda, 0.0, 1.0)
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    deltas = rewards + gamma * next_values - values
    advantages = discounted_cumsum(deltas, gamma * gae_lambda)
    return advantages, advantages + values


# ---- estimators: uniform keyword signature, unwhitened results ---------------------------------


def _broadcast(per_sample: Tensor, loss_masks: Sequence[Tensor]) -> list[Tensor]:
    return [per_sample[i].expand(m.numel()).clone() for i, m in enumerate(loss_masks)]


def _grpo(
    *, rewards: Tensor, group_size: int, loss_masks: Sequence[Tensor], grpo_std_normalization: bool, **_
) -> tuple[list[Tensor], None]:
    scores = group_normalize(rewards, group_size, std_normalization=grpo_std_normalization)
    return _broadcast(scores, loss_masks), None


def _last_index(mask: Tensor, lengths: Tensor) -> Tensor:
    """[B, T] padded mask -> [B] index of the last masked token (the last token when none is masked)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(dim=-1)
    return torch.where(last >= 0, last, lengths - 1)


def _reinforce_plus_plus(
    *, rewards: Tensor, loss_masks: Sequence[Tensor], kl: Sequence[Tensor], kl_coef: float, gamma: float, **_
) -> tuple[list[Tensor], list[Tensor]]:
    check_range("gamma", gamma, 0.0, 1.0)
    lengths = [m.numel() for m in loss_masks]
    token_rewards = -kl_coef * pad(kl)
    sizes = torch.tensor(lengths, device=rewards.device)
    rows = torch.nonzero(sizes > 0).squeeze(-1)  # empty responses get no reward token
    if rows.numel() > 0:
        last = _last_index(pad([m.reshape(-1).float() for m in loss_masks]), sizes)
        token_rewards[rows, last[rows]] += rewards[rows]
    returns = unpad(discounted_cumsum(token_rewards, gamma), lengths)
    return list(returns), returns


def _reinforce_plus_plus_baseline(
    *, rewards: Tensor, group_size: int, loss_masks: Sequence[Tensor], kl: Sequence[Tensor], kl_coef: float, **_
) -> tuple[list[Tensor], None]:
    centred = group_normalize(rewards, group_size, std_normalization=False)
    return [c - kl_coef * k for c, k in zip(_broadcast(centred, loss_masks), kl, strict=True)], None


def _ppo(
    *,
    rewards: Tensor,
    loss_masks: Sequence[Tensor],
    kl: Sequence[Tensor],
    values: Sequence[Tensor],
    kl_coef: float,
    gamma: float,
    gae_lambda: float,
    **_,
) -> tuple[list[Tensor], list[Tensor]]:
    lengths = [m.numel() for m in loss_masks]
    token_rewards = -kl_coef * pad(kl)
    sizes = torch.tensor(lengths, device=rewards.device)
    rows = torch.nonzero(sizes > 0).squeeze(-1)
    # slime puts the reward on the last response token, masked or not (reinforce++ uses the last masked one).
    token_rewards[rows, sizes[rows] - 1] += rewards[rows]
    advantages, returns = gae(token_rewards, pad(values).to(token_rewards.dtype), gamma=gamma, gae_lambda=gae_lambda)
    return unpad(advantages, lengths), unpad(returns, lengths)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registry entry: the estimator and how `compute_advantages` treats it."""

    compute: Callable[..., tuple[list[Tensor], list[Tensor] | None]]
    uses_groups: bool  # needs len(rewards) to be a multiple of group_size
    uses_kl: bool  # a non-zero kl_coef needs the per-token kl
    needs_values: bool
    whiten_by_default: bool


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo, uses_groups=True, uses_kl=False, needs_values=False, whiten_by_default=False),
    "gspo": AdvantageEstimator(_grpo, uses_groups=True, uses_kl=False, needs_values=False, whiten_by_default=False),
    "reinforce_plus_plus": AdvantageEstimator(
        _reinforce_plus_plus, uses_groups=False, uses_kl=True, needs_values=False, whiten_by_default=True
    ),
    "reinforce_plus_plus_baseline": AdvantageEstimator(
        _reinforce_plus_plus_baseline, uses_groups=True, uses_kl=True, needs_values=False, whiten_by_default=True
    ),
    "ppo": AdvantageEstimator(_ppo, uses_groups=False, uses_kl=True, needs_values=True, whiten_by_default=True),
}


@dataclass(frozen=True)
class AdvantageConfig:
    """The estimator and its settings for a run (`compute_advantages` names each one):
    `from_spec` reads them from spec.algorithm, with group_size = rollout.nSamplesPerPrompt."""

    estimator: str
    group_size: int
    gamma: float = 1.0
    gae_lambda: float = 1.0
    kl_coef: float = 0.0
    grpo_std_normalization: bool = True
    normalize_advantages: bool | None = None

    @classmethod
    def from_spec(cls, spec) -> AdvantageConfig:
        """From an RLJobSpec."""
        algo = spec.algorithm
        return cls(algo.advantage_estimator, group_size=spec.rollout.n_samples_per_prompt, gamma=algo.gamma,
                   gae_lambda=algo.gae_lambda, kl_coef=algo.kl_coef,
                   grpo_std_normalization=algo.grpo_std_normalization)

    def compute(
        self,
        *,
        rewards: Tensor | Sequence[float],
        loss_masks: Sequence[Tensor],
        kl: Sequence[Tensor] | None = None,
        values: Sequence[Tensor] | None = None,
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """`compute_advantages` of one rollout's samples with these settings."""
        return compute_advantages(
            self.estimator, rewards=rewards, group_size=self.group_size, loss_masks=loss_masks, kl=kl, values=values,
            gamma=self.gamma, gae_lambda=self.gae_lambda, kl_coef=self.kl_coef,
            grpo_std_normalization=self.grpo_std_normalization, normalize_advantages=self.normalize_advantages,
        )


def compute_advantages(
    estimator: str,
    *,
    rewards: Tensor | Sequence[float],
    group_size: int,
    loss_masks: Sequence[Tensor],
    kl: Sequence[Tensor] | None = None,
    values: Sequence[Tensor] | None = None,
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
    kl_coef: float = 0.0,
    grpo_std_normalization: bool = True,
    normalize_advantages: bool | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Per-token advantages (and returns where the estimator defines them) for a rollout batch.

    Args:
        estimator: a key of `ADVANTAGE_ESTIMATORS`.
        rewards: [B] scalar reward per sample (raw; group statistics are taken here).
        group_size: n_samples_per_prompt; groups are consecutive samples.
        loss_masks: B tensors [L_i], 1 for response tokens that count (0 e.g. for tool output).
        kl: B tensors [L_i] per-token KL to the reference (`compute_approx_kl`); None means zeros.
        values: B tensors [L_i] critic values (ppo only).
        gamma, gae_lambda: discount and GAE lambda in [0, 1].
        kl_coef: weight of the per-token KL penalty in the reward (reinforce++, its baseline, ppo).
        grpo_std_normalization: divide by the group std (grpo/gspo).
        normalize_advantages: whiten the advantages over all masked tokens of the batch; None uses
            the estimator's default (see the module table).

    Returns:
        (advantages: B tensors [L_i], returns: B tensors [L_i] for reinforce_plus_plus (the
        discounted returns) and ppo (advantages + values, before whitening), else None). Detached.
    """
    entry = lookup(ADVANTAGE_ESTIMATORS, estimator, "estimator")
    num = len(loss_masks)
    if num == 0:
        raise ValueError("loss_masks is empty; compute_advantages needs at least one sample")
    device = loss_masks[0].device
    rewards = as_float(rewards).detach().reshape(-1).to(device)
    if rewards.numel() != num:
        raise ValueError(
            f"rewards has {rewards.numel()} values but loss_masks has {num} samples; pass one reward per sample"
        )
    if entry.uses_groups:
        _check_groups(num, group_size)
    dtype = rewards.dtype
    if kl is None:
        if entry.uses_kl and kl_coef != 0:
            raise ValueError(
                f"kl_coef={kl_coef!r} with estimator={estimator!r} needs the per-token kl; pass kl (or set kl_coef=0)"
            )
        kl = [torch.zeros(m.numel(), dtype=dtype, device=device) for m in loss_masks]
    else:
        check_same_layout("kl", kl, loss_masks, "loss_masks")
        kl = [as_float(k).detach() for k in kl]
        dtype = torch.promote_types(dtype, kl[0].dtype)
    if entry.needs_values:
        if values is None:
            raise ValueError(f"estimator={estimator!r} needs the critic's per-token values; pass values")
        check_same_layout("values", values, loss_masks, "loss_masks")
        values = [as_float(v).detach() for v in values]
        dtype = torch.promote_types(dtype, values[0].dtype)
    with torch.no_grad():
        advantages, returns = entry.compute(
            rewards=rewards.to(dtype),
            group_size=group_size,
            loss_masks=loss_masks,
            kl=[k.to(dtype) for k in kl],
            values=values,
            gamma=gamma,
            gae_lambda=gae_lambda,
            kl_coef=kl_coef,
            grpo_std_normalization=grpo_std_normalization,
        )
        whiten = entry.whiten_by_default if normalize_advantages is None else normalize_advantages
        if whiten:
            lengths = [a.numel() for a in advantages]
            flat = masked_whiten(torch.cat(advantages), torch.cat([m.reshape(-1) for m in loss_masks]))
            advantages = list(flat.split(lengths))
    return advantages, returns


def _check_groups(num_samples: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (n_samples_per_prompt)")
    if num_samples % group_size != 0:
        raise ValueError(
            f"{num_samples} samples do not split into groups of group_size={group_size}; "
            "pass whole groups (consecutive samples of one prompt)"
        )

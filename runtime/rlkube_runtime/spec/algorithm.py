"""`spec.algorithm`: advantage estimator and the terms of the policy loss."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import SpecModel, cel_rules, cross_field_error, section

AdvantageEstimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
# Estimators that fold a per-token KL penalty (klCoef) into the rewards; the others ignore it.
KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
_KL_COEF_MESSAGE = (
    "klCoef folds a KL penalty into the rewards, which only {} use; with {} use useKlLoss and klLossCoef "
    "(a KL term in the loss) instead"
)
KlLossType = Literal["k1", "k2", "k3", "low_var_kl"]
# Estimators whose advantages come from a learned value model; no trainer backend has a critic.
CRITIC_ESTIMATORS = ("ppo",)
NO_CRITIC_MESSAGE = (
    "ppo needs a critic (value) model, which rlkube's trainer backends do not have; use grpo, gspo, "
    "reinforce_plus_plus or reinforce_plus_plus_baseline"
)


class TisSpec(SpecModel):
    """Truncated importance sampling: reweights the loss by the trainer/engine probability ratio,
    correcting for the engine's numerics (and fp8 rollouts) differing from the trainer's."""

    model_config = cel_rules(
        {
            "rule": "!has(self.clipLow) || !has(self.clip) || self.clipLow <= self.clip",
            "messageExpression": "'clipLow(%s) must be <= clip(%s)'.format([self.clipLow, self.clip])",
            "fieldPath": ".clipLow",
        }
    )

    enabled: bool = Field(default=False, description="Apply TIS with the engine's per-token logprobs. Default false.")
    clip: float = Field(default=2.0, gt=0, description="Upper bound of the importance weight. Default 2.0, > 0.")
    clip_low: float = Field(default=0.0, ge=0, description="Lower bound of the importance weight. Default 0.0, >= 0, <= clip.")

    @model_validator(mode="after")
    def _check_bounds(self) -> "TisSpec":
        if self.clip_low > self.clip:
            raise cross_field_error([("clipLow", f"clipLow({self.clip_low}) must be <= clip({self.clip})")])
        return self


class OpsmSpec(SpecModel):
    """Off-policy sequence masking: drops the loss of failed samples the policy has moved away from."""

    enabled: bool = Field(
        default=False,
        description="Mask the policy-gradient loss of every sample whose advantage is negative and whose tokens' "
        "mean (engine logprob - current logprob) exceeds delta (slime's --use-opsm, with the engine as the "
        "behaviour policy). Default false.",
    )
    delta: float = Field(default=1e-4, ge=0, description="Drift threshold of opsm. Default 1e-4 (slime's), >= 0.")


class AlgorithmSpec(SpecModel):
    """How rewards become advantages and what the policy loss contains."""

    model_config = cel_rules(
        {
            "rule": "!has(self.epsClipHigh) || !has(self.epsClip) || self.epsClipHigh >= self.epsClip",
            "messageExpression": "'epsClipHigh(%s) must be >= epsClip(%s)'.format([self.epsClipHigh, self.epsClip])",
            "fieldPath": ".epsClipHigh",
        },
        {
            "rule": "!has(self.klCoef) || self.klCoef == 0.0 || (has(self.advantageEstimator) && self.advantageEstimator in "
            + str(list(KL_REWARD_ESTIMATORS))
            + ")",
            "messageExpression": "'"
            + _KL_COEF_MESSAGE.format(", ".join(KL_REWARD_ESTIMATORS), "%s")
            + "'.format([has(self.advantageEstimator) ? self.advantageEstimator : 'grpo'])",
            "fieldPath": ".klCoef",
        },
        {
            "rule": "!has(self.advantageEstimator) || !(self.advantageEstimator in " + str(list(CRITIC_ESTIMATORS)) + ")",
            "message": NO_CRITIC_MESSAGE,
            "fieldPath": ".advantageEstimator",
        },
    )

    advantage_estimator: AdvantageEstimator = Field(
        default="grpo",
        description="Advantage estimator: grpo, gspo (sequence-level ratio), reinforce_plus_plus, "
        "reinforce_plus_plus_baseline. ppo needs a critic model, which no trainer backend has yet: it is refused. "
        "Default grpo.",
    )
    grpo_std_normalization: bool = Field(
        default=True, description="Divide group-relative advantages by the group's reward std (GRPO, GSPO). Default true."
    )
    use_kl_loss: bool = Field(
        default=False, description="Add klLossCoef x KL(policy || reference) to the loss. Default false."
    )
    kl_loss_coef: float = Field(default=0.0, ge=0, description="Weight of the KL loss term. Default 0.0, >= 0.")
    kl_loss_type: KlLossType = Field(
        default="low_var_kl",
        description="KL estimator of the KL loss: k1, k2, k3, or low_var_kl (k3 clamped). Default low_var_kl.",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="KL penalty folded into the rewards (reinforce_plus_plus, ppo). Default 0.0, >= 0.",
    )
    entropy_coef: float = Field(default=0.0, ge=0, description="Weight of the entropy bonus. Default 0.0, >= 0.")
    eps_clip: float = Field(default=0.2, gt=0, description="Lower PPO clip range: ratio >= 1 - epsClip. Default 0.2, > 0.")
    eps_clip_high: Optional[float] = Field(
        default=None,
        gt=0,
        description="Upper PPO clip range: ratio <= 1 + epsClipHigh ('clip higher', e.g. 0.28). Default: epsClip; "
        "must be >= epsClip.",
    )
    eps_clip_c: Optional[float] = Field(
        default=None,
        gt=1,
        description="Dual-clip constant bounding the loss of negative-advantage tokens (e.g. 3.0). Default: unset "
        "(no dual clip); > 1.",
    )
    per_token_loss: bool = Field(
        default=False,
        description="Average the loss over all tokens of the batch (true) instead of per sample first (false). "
        "Default false.",
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount factor (ppo, reinforce_plus_plus). Default 1.0, in [0, 1].")
    gae_lambda: float = Field(default=1.0, ge=0, le=1, description="GAE lambda (ppo). Default 1.0, in [0, 1].")
    tis: TisSpec = section(TisSpec, "Truncated importance sampling against the engine's logprobs. Default: off.")
    opsm: OpsmSpec = section(OpsmSpec, "Off-policy sequence masking against the engine's logprobs. Default: off.")

    @property
    def effective_eps_clip_high(self) -> float:
        """The upper clip range in use: epsClipHigh, or epsClip when it is unset."""
        return self.eps_clip_high if self.eps_clip_high is not None else self.eps_clip

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "AlgorithmSpec":
        violations = []
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            violations.append(("epsClipHigh", f"epsClipHigh({self.eps_clip_high}) must be >= epsClip({self.eps_clip})"))
        if self.kl_coef != 0 and self.advantage_estimator not in KL_REWARD_ESTIMATORS:
            violations.append(("klCoef", _KL_COEF_MESSAGE.format(", ".join(KL_REWARD_ESTIMATORS), self.advantage_estimator)))
        if self.advantage_estimator in CRITIC_ESTIMATORS:
            violations.append(("advantageEstimator", NO_CRITIC_MESSAGE))
        if violations:
            raise cross_field_error(violations)
        return self

    @property
    def needs_reference_model(self) -> bool:
        """A KL term (in the loss, or in the rewards of the estimators that use klCoef) compares
        the policy with the frozen reference."""
        return self.use_kl_loss or (self.kl_coef != 0 and self.advantage_estimator in KL_REWARD_ESTIMATORS)

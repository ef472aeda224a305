"""RL math as pure torch functions: KL estimators, advantages, policy/value losses, TIS, reductions.

Tensors in, tensors out; no I/O and no global state. Variants live in registries
(`KL_ESTIMATORS`, `ADVANTAGE_ESTIMATORS`, `PPO_KL_FUNCTIONS`); an unknown name raises a ValueError
listing the known ones. Semantics follow slime (`slime/utils/ppo_utils.py`,
`slime/backends/megatron_utils/loss.py`); each module says where it matches and where it differs.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageConfig,
    compute_advantages,
    discounted_cumsum,
    gae,
    group_normalize,
)
from .entropy import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from .kl import KL_ESTIMATORS, compute_approx_kl
from .loss import PolicyLossConfig, policy_objective, value_objective
from .policy_loss import (
    PPO_KL_FUNCTIONS,
    clipped_policy_loss,
    clipped_value_loss,
    sequence_ppo_kl,
    token_ppo_kl,
)
from .reduction import (
    global_counts,
    loss_token_weights,
    masked_mean,
    masked_whiten,
    reduce_loss,
    reduce_per_sample,
    reduce_per_token,
)
from .segments import pack, pad, segment_ids_from_lengths, segment_sum, unpack, unpad
from .tis import TisWeights, tis_weights

__all__ = [
    "PolicyLossConfig",
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "PPO_KL_FUNCTIONS",
    "AdvantageEstimator",
    "TisWeights",
    "clipped_policy_loss",
    "clipped_value_loss",
    "AdvantageConfig",
    "compute_advantages",
    "compute_approx_kl",
    "discounted_cumsum",
    "entropy_from_logits",
    "gae",
    "global_counts",
    "group_normalize",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "loss_token_weights",
    "masked_mean",
    "masked_whiten",
    "pack",
    "pad",
    "policy_objective",
    "reduce_loss",
    "reduce_per_sample",
    "reduce_per_token",
    "segment_ids_from_lengths",
    "segment_sum",
    "sequence_ppo_kl",
    "tis_weights",
    "token_ppo_kl",
    "unpack",
    "unpad",
    "value_objective",
]

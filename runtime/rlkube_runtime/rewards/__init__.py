"""The reward step: rule-based (math-verify, F1, exact), remote and custom rewards, group rewards.

math-verify is imported on first use, so importing this package stays cheap.
"""

from rlkube_runtime.rewards.hub import (
    REWARD_FN_KEY,
    REWARD_TYPE_KEY,
    REWARD_TYPES,
    RULE_REWARDS,
    RewardConfig,
    compute_reward,
    compute_rewards,
)
from rlkube_runtime.rewards.math_rules import dapo_reward, deepscaler_reward, math_reward
from rlkube_runtime.rewards.remote import RemoteRewardClient, RemoteRewardError
from rlkube_runtime.rewards.text_rules import exact_reward, f1_reward, normalize_squad

__all__ = [
    "REWARD_FN_KEY",
    "REWARD_TYPES",
    "REWARD_TYPE_KEY",
    "RULE_REWARDS",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardConfig",
    "compute_reward",
    "compute_rewards",
    "dapo_reward",
    "deepscaler_reward",
    "exact_reward",
    "f1_reward",
    "math_reward",
    "normalize_squad",
]

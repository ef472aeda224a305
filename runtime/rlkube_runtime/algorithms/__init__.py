"""RL math as pure torch functions: KL estimators, advantages, policy/value losses, TIS, reductions.

Tensors in, tensors out; no I/O and no global state. Variants live in registries
(`KL_ESTIMATORS`, `ADVANTAGE_ESTIMATORS`, `PPO_KL_FUNCTIONS`); an unknown name raises a ValueError
listing the known ones. Semantics follow slime (`slime/utils/ppo_utils.py`,
`slime/backends/megatron_utils/loss.py`); each module says where it matches and where it differs.
"""

from .entropy import entropy_from_logits, log_probs_from_logits
from .kl import KL_ESTIMATORS, compute_approx_kl
from .segments import pack, pad, segment_ids_from_lengths, segment_sum, unpack, unpad
from .tis import TisWeights, tis_weights

__all__ = [
    "KL_ESTIMATORS",
    "TisWeights",
    "compute_approx_kl",
    "entropy_from_logits",
    "log_probs_from_logits",
    "pack",
    "pad",
    "segment_ids_from_lengths",
    "segment_sum",
    "tis_weights",
    "unpack",
    "unpad",
]

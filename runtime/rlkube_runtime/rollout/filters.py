"""Built-in dynamic-sampling filters (`spec.rollout.dynamicSamplingFilter`).

A filter takes one rewarded group (the n samples of a prompt) and says whether to keep it. With
`overSamplingBatchSize` the rollout keeps drawing groups until `batchSize` of them pass.
"""

from __future__ import annotations

import statistics

from rlkube_runtime.data.sample import Sample


def check_reward_nonzero_std(group: list[Sample]) -> bool:
    """Keep groups whose rewards differ (slime's filter of the same name, DAPO's dynamic sampling).

    A group where every sample got the same reward has zero GRPO advantage everywhere: it costs a
    training step and teaches nothing.
    """
    rewards = [_scalar(s.reward) for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 0.0


def _scalar(reward) -> float:
    if isinstance(reward, dict):
        if "reward" not in reward:
            raise ValueError(f"a dict reward needs a 'reward' key to be filtered on, got keys {sorted(reward)}")
        reward = reward["reward"]
    return float(reward)

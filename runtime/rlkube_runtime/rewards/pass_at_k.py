"""pass@k and the per-dataset evaluation numbers computed from rewarded eval responses.

pass@k is the chance that at least one of k responses to a prompt is correct. Drawing k of the n
sampled responses without replacement, it is estimated without bias (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code") by

    pass@k = 1 - C(n - c, k) / C(n, k)        c = correct responses among the n

and averaged over prompts. The plain (1 - (1 - c/n)^k) estimate is biased low for k > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct out of `n` responses."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct response
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def is_correct(reward: float) -> bool:
    """A response counts as correct when its reward is positive (rule rewards give 1 for right, 0 or -1 for wrong)."""
    return reward > 0


def eval_dataset_metrics(
    name: str,
    rewards_by_prompt: Sequence[Sequence[float]],
    *,
    response_lengths: Sequence[int],
    truncated: Sequence[bool],
    pass_k: Sequence[int] = (),
) -> dict[str, float]:
    """`eval/<name>/...` numbers of one dataset: mean reward, accuracy (the share of correct
    responses), pass@k for each k, mean response length, truncated share and the prompt count."""
    rewards = [float(r) for group in rewards_by_prompt for r in group]
    if not rewards:
        raise ValueError(f"eval dataset {name!r} produced no responses")
    correct = [sum(is_correct(float(r)) for r in group) for group in rewards_by_prompt]
    metrics = {
        f"eval/{name}/reward": sum(rewards) / len(rewards),
        f"eval/{name}/accuracy": sum(correct) / len(rewards),
        f"eval/{name}/response_len/mean": sum(response_lengths) / len(response_lengths),
        f"eval/{name}/truncated_ratio": sum(bool(t) for t in truncated) / len(truncated),
        f"eval/{name}/num_prompts": float(len(rewards_by_prompt)),
    }
    for k in pass_k:
        per_prompt = [pass_at_k(len(group), c, k) for group, c in zip(rewards_by_prompt, correct)]
        metrics[f"eval/{name}/pass_at_{k}"] = sum(per_prompt) / len(per_prompt)
    return metrics

"""A reward a random-init model can learn at any vocabulary size: the share of its response
tokens whose id is even (chance 0.5). The megatron MoE run uses it, as `reward.customPath`
`even_token_reward:even_token_share`, so that the policy gradient is not zero as an exact-match
reward on a random model would make it."""

from __future__ import annotations

from rlkube_runtime.data.sample import Sample


def even_token_share(sample: Sample) -> float:
    tokens = sample.response_tokens
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens) if tokens else 0.0

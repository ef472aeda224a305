"""Token log-probabilities and entropy from logits, matching the rollout engine's definitions.

The engine (SGLang) reports log p(token) = log_softmax(logits / temperature)[token] in float32; the
trainer must compute exactly the same quantity or the PPO ratio and TIS weights are biased.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import as_float


def _scaled(logits: Tensor, temperature: float | None) -> Tensor:
    # Temperature 0 (greedy) or None means the logits are used as they are.
    if temperature is None or temperature == 0:
        temperature = 1.0
    if temperature < 0:
        raise ValueError(f"temperature={temperature!r} is negative; use a value > 0 (or 0/None for 1.0)")
    logits = as_float(logits)
    return logits if temperature == 1.0 else logits / temperature


def log_probs_from_logits(logits: Tensor, tokens: Tensor, temperature: float | None = None) -> Tensor:
    """log_softmax(logits / temperature) gathered at `tokens`.

    Args:
        logits: [..., V] (e.g. [T, V] or [B, T, V]); bf16/fp16 are upcast to float32.
        tokens: [...] int64 token ids, the leading shape of `logits`.
        temperature: the sampling temperature; 0 or None means 1.0.

    Returns:
        [...] log-probabilities (float32, or float64 for float64 logits); differentiable w.r.t. logits.
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but logits has shape {tuple(logits.shape)}; "
            "tokens must have the shape of logits without its last (vocabulary) dimension"
        )
    z = _scaled(logits, temperature)
    picked = z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float | None = None) -> Tensor:
    """Entropy of softmax(logits / temperature) over the last dimension.

    Computed as -sum p * log p with log p from log_softmax (stable for large logits); tokens with
    logit -inf (p = 0) contribute 0 and do not produce NaN values or gradients.

    Args:
        logits: [..., V] (e.g. [T, V] or [B, T, V]).
        temperature: 0 or None means 1.0.

    Returns:
        [...] entropy in nats; differentiable w.r.t. logits.
    """
    log_p = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    p = log_p.exp()
    # 0 * (-inf) would be NaN; a zero-probability token contributes nothing.
    log_p = torch.where(torch.isneginf(log_p), torch.zeros_like(log_p), log_p)
    return -(p * log_p).sum(dim=-1)

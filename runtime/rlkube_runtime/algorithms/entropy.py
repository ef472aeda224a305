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


# Tokens per chunk in `log_probs_and_entropy`: about 512 MiB of float32 logits at a 150k vocabulary.
_CHUNK_ELEMENTS = 2**27


def log_probs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    temperature: float | None = None,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_elements: int = _CHUNK_ELEMENTS,
    compiled: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`log_probs_from_logits` and `entropy_from_logits` of [N, V] logits in one pass, in chunks.

    The same values, but the float32 copy of the logits exists for one chunk of rows at a time,
    in the forward and in the backward (which recomputes it from the bf16 logits instead of
    keeping float32 intermediates). At a 150k vocabulary the unchunked functions hold several
    [N, V] float32 tensors per micro-batch (4 bytes x 150k per response token each) and make a
    dozen passes over them; this keeps one chunk and makes about four.

    Returns ([N] log-probs, [N] entropy or None), float32 (float64 for float64 logits). With
    `entropy_grad` False the entropy carries no gradient (it is a metric only). `compiled` runs
    each chunk's arithmetic through torch.compile (for GPUs: fused kernels).
    """
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(
            f"log_probs_and_entropy takes [N, V] logits and [N] tokens; got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    scale = 1.0 if temperature is None or temperature == 0 else float(temperature)
    if scale < 0:
        raise ValueError(f"temperature={temperature!r} is negative; use a value > 0 (or 0/None for 1.0)")
    chunk = max(1, chunk_elements // max(1, logits.shape[-1]))
    logp, ent = _ChunkedLogProbsEntropy.apply(logits, tokens.long(), scale, with_entropy, entropy_grad, chunk, compiled)
    return logp, (ent if with_entropy else None)


def _chunk_stats(logits: Tensor, tokens: Tensor, scale: float, with_entropy: bool):
    """(log-sum-exp, log-prob of the token, entropy or None) of one chunk."""
    z = as_float(logits)
    if scale != 1.0:
        z = z / scale
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        p = torch.exp(z - lse.unsqueeze(-1))
        # H = lse - sum p z; where p == 0 (z == -inf) the term is 0, not nan.
        ent = lse - torch.where(p > 0, p * z, 0.0).sum(-1)
    return lse, logp, ent


def _chunk_grad(logits, tokens, lse, ent, grad_logp, grad_ent, scale: float) -> Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype, from the saved log-sum-exp/entropy."""
    z = as_float(logits)
    if scale != 1.0:
        z = z / scale
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    g = torch.zeros_like(z)
    if grad_logp is not None:
        # d logp / dz = onehot(token) - p
        g_lp = grad_logp.unsqueeze(-1)
        g = (g - p * g_lp).scatter_add(-1, tokens.unsqueeze(-1), g_lp)
    if grad_ent is not None:
        # dH / dz_j = -p_j (log p_j + H); 0 where p_j == 0
        g = g - torch.where(p > 0, p * (log_p + ent.unsqueeze(-1)), 0.0) * grad_ent.unsqueeze(-1)
    if scale != 1.0:
        g = g / scale
    return g.to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _compiled(which: str):
    """The chunk functions through torch.compile (one fused kernel or two per chunk instead of
    a dozen passes), made on first use; shapes are dynamic (the last chunk is shorter)."""
    if which not in _COMPILED:
        _COMPILED[which] = torch.compile(_chunk_stats if which == "stats" else _chunk_grad, dynamic=True)
    return _COMPILED[which]


class _ChunkedLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, scale, with_entropy, entropy_grad, chunk, compiled):
        chunk_stats = _compiled("stats") if compiled else _chunk_stats
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        n = logits.shape[0]
        logp = torch.empty(n, dtype=out_dtype, device=logits.device)
        ent = torch.zeros(n if with_entropy else 0, dtype=out_dtype, device=logits.device)
        lse = torch.empty(n, dtype=out_dtype, device=logits.device)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            lse[rows], logp[rows], chunk_ent = chunk_stats(logits[rows], tokens[rows], scale, with_entropy)
            if with_entropy:
                ent[rows] = chunk_ent
        ctx.save_for_backward(logits, tokens, lse, ent)
        ctx.scale, ctx.chunk, ctx.entropy_grad, ctx.compiled = scale, chunk, with_entropy and entropy_grad, compiled
        ctx.set_materialize_grads(False)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, tokens, lse, ent = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_ent = None
        if grad_logp is None and grad_ent is None:
            return torch.zeros_like(logits), None, None, None, None, None, None
        grad = torch.empty_like(logits)
        chunk_grad = _compiled("grad") if ctx.compiled else _chunk_grad
        for start in range(0, logits.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            grad[rows] = chunk_grad(
                logits[rows],
                tokens[rows],
                lse[rows],
                None if grad_ent is None else ent[rows],
                None if grad_logp is None else grad_logp[rows],
                None if grad_ent is None else grad_ent[rows],
                ctx.scale,
            )
        return grad, None, None, None, None, None, None

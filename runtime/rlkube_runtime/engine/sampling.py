"""Next-token sampling for a batch whose rows have their own settings and random streams.

Each request owns a stream of uniform numbers drawn up front from a CPU `torch.Generator`
seeded from (server seed, sampling_seed or rid): its i-th sampled token uses the i-th number, so
its tokens do not depend on what else shares the batch, nor on when it was retracted or resumed.
Drawing the stream up front keeps per-step work on the device (one small copy of the step's
numbers) instead of one generator call per row per step.

A row without top-p/top-k is sampled by inverse CDF over the vocabulary in id order (no sort of
a [batch, vocab] matrix); a row with them sorts its own distribution and keeps the smallest
prefix. The reported logprob is log_softmax(logits / temperature) at the chosen token, before
top-p/top-k filtering: the quantity the trainer recomputes. Temperature 0 is greedy, with the
logprob under the raw logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from rlkube_runtime.engine.protocol import SamplingParams


def request_generator(server_seed: int, params: SamplingParams, rid: str, sample_index: int) -> torch.Generator:
    """The request's private random stream.

    With `sampling_seed` the stream is fixed by (server seed, sampling_seed, sample index), so the
    n samples of one request differ; otherwise by (server seed, rid).
    """
    if params.sampling_seed is not None:
        material = f"{server_seed}/seed/{params.sampling_seed}/{sample_index}"
    else:
        material = f"{server_seed}/rid/{rid}"
    seed = int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def uniform_stream(server_seed: int, params: SamplingParams, rid: str, sample_index: int, length: int) -> list[float] | None:
    """The request's `length` uniform numbers in [0, 1), one per token it may sample (None when greedy)."""
    if params.greedy:
        return None
    return torch.rand(length, generator=request_generator(server_seed, params, rid, sample_index)).tolist()


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """One step's per-row settings as device tensors [batch]; `filtered` lists the rows (host
    indices) that use top-p or top-k."""

    temperature: torch.Tensor  # float32; 1.0 for greedy rows so their logprob is the raw one
    greedy: torch.Tensor  # bool
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # float32 (exact for any vocabulary below 2**24); vocab for "all"
    uniform: torch.Tensor  # float32
    filtered: tuple[int, ...]

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], uniforms: Sequence[float], *, vocab_size: int, device: torch.device
    ) -> SamplingRows:
        """One host-to-device copy for the whole step."""
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        table = torch.tensor(
            [
                [1.0 if p.greedy else p.temperature for p in params],
                [1.0 if p.greedy else 0.0 for p in params],
                [p.top_p for p in params],
                top_ks,
                list(uniforms),
            ],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        filtered = tuple(i for i, (p, k) in enumerate(zip(params, top_ks)) if not p.greedy and (p.top_p < 1.0 or k < vocab_size))
        return cls(
            temperature=table[0], greedy=table[1] > 0.5, top_p=table[2], top_k=table[3], uniform=table[4], filtered=filtered
        )


def sample_tokens(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [batch, vocab]: (token ids [batch] long, their logprobs [batch]
    float32), left on the device so the caller copies both back at once."""
    logits = logits.float()
    vocab = logits.shape[-1]
    logprobs = torch.log_softmax(logits / rows.temperature[:, None], dim=-1)

    # Inverse CDF in id order: the first token whose cumulative mass exceeds u * total.
    cdf = logprobs.exp().cumsum(-1)
    target = (rows.uniform * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    if rows.filtered:
        index = torch.tensor(rows.filtered, device=logits.device)
        sampled[index] = _sample_filtered(
            logprobs[index], rows.top_p[index], rows.top_k[index], rows.uniform[index]
        )
    tokens = torch.where(rows.greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _sample_filtered(logprobs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Rows with top-p/top-k: sort, keep the smallest prefix whose mass reaches top_p (the first
    token always stays) among the top_k, and invert that prefix's CDF."""
    vocab = logprobs.shape[-1]
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logprobs.exp()
    rank = torch.arange(vocab, device=logprobs.device)[None, :]
    keep = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]) & (rank < top_k[:, None])
    cdf = (sorted_probs * keep).cumsum(-1)
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    return order.gather(1, position).squeeze(1)

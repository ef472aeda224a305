"""Next-token sampling for a batch whose rows have their own settings and random streams.

Each request owns a CPU `torch.Generator` seeded from (server seed, sampling_seed or rid) and draws
exactly one uniform number per sampled token, so its tokens do not depend on what else shares the
batch. The reported logprob is log_softmax(logits / temperature) at the chosen token, before
top-p/top-k filtering: the quantity the trainer recomputes. Temperature 0 is greedy, with the
logprob under the raw logits.
"""

from __future__ import annotations

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


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [batch, vocab]; return (token ids, their logprobs)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    # Greedy rows use temperature 1 so their logprob is the raw log_softmax.
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)

    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logprobs.exp()
    top_k = torch.tensor([vocab if p.top_k < 0 else min(p.top_k, vocab) for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    rank = torch.arange(vocab, device=device)[None, :]
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]) & (rank < top_k[:, None])
    cdf = (sorted_probs * keep).cumsum(-1)
    uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(device)
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    sampled = order.gather(1, position).squeeze(1)

    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()

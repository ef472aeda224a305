"""Routed experts on the wire: every token's top-k expert ids in each MoE layer of a mixture of
experts, as SGLang returns them (`meta_info.routed_experts` under `--enable-return-routed-experts`
and a request's `return_routed_experts`): int32 [tokens, layers, top_k] in C order, base64.

The tokens are a sequence's all but its last (prompt and response: the last token is sampled,
never fed back), so the routes of a sample of L tokens have L - 1 rows. Rollout routing replay
(spec.training.routingReplay) carries them from the engine to the trainer in this form, one piece
for the built-in engine that writes them and the trainer that reads them.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode_routes(routes: torch.Tensor) -> str:
    """[tokens, layers, top_k] expert ids as SGLang sends them."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routes(encoded: str, *, num_layers: int, top_k: int, what: str) -> torch.Tensor:
    """The int64 [tokens, num_layers, top_k] routes `encode_routes` (or SGLang) wrote; `what`
    names their sequence in the error when they are not whole tokens of that shape."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_token = num_layers * top_k
    if flat.size % per_token:
        raise ValueError(f"{what}: the engine's routed experts hold {flat.size} expert ids, not whole tokens of "
                         f"{num_layers} layers x top-{top_k} (an engine serving another model?)")
    return torch.from_numpy(flat.astype(np.int64).reshape(-1, num_layers, top_k))

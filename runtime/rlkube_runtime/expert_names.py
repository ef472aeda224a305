"""One expert per name: the names a mixture-of-experts checkpoint, SGLang and the megatron export use.

transformers 5 fuses each MoE layer's experts into two parameters, `...mlp.experts.gate_up_proj`
[E, 2I, H] (expert e's [gate; up]) and `...mlp.experts.down_proj` [E, H, I]. Checkpoints, SGLang's
MoE loaders and the megatron backend's export name every expert apart
(`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`). The weight sync speaks the latter,
so the torch backend sends its fused parameters as per-expert views and the built-in engine takes
per-expert names into its fused ones; both go through `per_expert_views`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_FUSED = re.compile(r"^(?P<experts>.*\.experts\.)(?P<which>gate_up_proj|down_proj)$")


def per_expert_views(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (name, tensor) as it is, except a fused experts parameter, which becomes its experts'
    checkpoint-named views (no copies: writing into a view writes into the fused parameter)."""
    for name, tensor in named:
        fused = _FUSED.match(name)
        if fused is None:
            yield name, tensor
            continue
        experts = fused["experts"]
        for e, expert in enumerate(tensor.unbind(0)):
            if fused["which"] == "down_proj":
                yield f"{experts}{e}.down_proj.weight", expert
            else:
                gate, up = expert.chunk(2, dim=0)
                yield f"{experts}{e}.gate_proj.weight", gate
                yield f"{experts}{e}.up_proj.weight", up

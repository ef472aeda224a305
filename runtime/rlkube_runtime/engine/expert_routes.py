"""What the built-in engine reports under `--enable-return-routed-experts`: the experts each MoE
layer's router picked for every token of a forward, read off the routers by forward hooks.

transformers' Qwen3-MoE router is a module returning (logits, weights, indices) from 5.x on; in 4.x
the block's `gate` is a Linear returning logits, and the block takes the top k of their float32
softmax, which is what is recomputed here, so the ids are those the model used either way.
"""

from __future__ import annotations

import torch


class ExpertRouteRecorder:
    """Hooks on every decoder layer's router; `take` returns the last forward's picks."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        gates = [getattr(getattr(layer, "mlp", None), "gate", None) for layer in layers]
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        if not gates or any(g is None for g in gates) or not self.top_k:
            raise ValueError(
                f"--enable-return-routed-experts: the model (model_type {getattr(config, 'model_type', None)!r}) "
                "does not route every layer's tokens to experts; routes are reported for mixture-of-experts "
                "models whose every decoder layer has a router (Qwen3-MoE)"
            )
        self.num_layers = len(gates)
        self._picked: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(gates)]

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            if isinstance(output, tuple):  # transformers 5: (logits, weights, indices)
                picked = output[2]
            else:  # transformers 4: the gate's logits
                picked = torch.softmax(output, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1).indices
            self._picked[layer] = picked.reshape(-1, self.top_k)

        return record

    def take(self) -> torch.Tensor:
        """[tokens, layers, top_k] int32 on the CPU, tokens in the forward's (batch, position) order."""
        if any(p is None for p in self._picked):
            raise RuntimeError("no forward ran since the last take")
        routes = torch.stack(self._picked, dim=1).to("cpu", torch.int32)
        self._picked = [None] * self.num_layers
        return routes

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

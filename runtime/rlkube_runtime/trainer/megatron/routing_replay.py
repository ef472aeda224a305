"""Rollout routing replay on the megatron backend (slime's --use-rollout-routing-replay): every
MoE router of the actor takes, for each token, the experts the rollout engine routed it to, and
weighs them with its own scores (megatron-core's RouterReplay: the scores gathered at the given
experts), so log-probs and gradients go through the experts that produced the tokens.

A micro-batch's rows are right-padded samples; megatron's routers see its tokens position-major
([s, b] flattened, split over tensor ranks along s under sequence parallelism). Each sample's
routes cover its tokens but the last; that position and the padding get experts 0..k-1, which
changes no trained position (the model is causal and those positions predict nothing trained).
"""

from __future__ import annotations

import torch


def replay_targets(routes: list[torch.Tensor], rows: int, length: int, *, tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per layer, the [tokens, top_k] experts of a micro-batch of `rows` x `length` positions whose
    first samples have `routes` ([L_i - 1, layers, top_k] each), in the order this rank's routers
    see its tokens."""
    layers, top_k = routes[0].shape[1:]
    grid = torch.arange(top_k, dtype=torch.long).expand(rows, length, layers, top_k).clone()
    for i, sample in enumerate(routes):
        grid[i, : sample.shape[0]] = sample
    grid = grid.transpose(0, 1)  # [s, b, layers, top_k]: the routers' token order
    if sequence_parallel and tp_size > 1:
        grid = grid.chunk(tp_size, dim=0)[tp_rank]
    flat = grid.reshape(-1, layers, top_k).to(device)
    return [flat[:, layer].contiguous() for layer in range(layers)]


class RouteReplay:
    """The actor's routers, in layer order, switched between replaying given experts and routing
    by themselves (the reference model's routers are not touched: it routes for itself)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [layer.mlp.router.router_replay for layer in model.decoder.layers]
        if any(r is None for r in self.routers):
            raise ValueError("routing replay needs every layer's router built with moe_enable_routing_replay")

    def replay(self, targets: list[torch.Tensor]) -> None:
        """Until `stop`, every forward (and the recompute in its backward) takes these experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if len(targets) != len(self.routers):
            raise ValueError(f"routes of {len(targets)} layers for a model of {len(self.routers)} MoE layers")
        for router, target in zip(self.routers, targets):
            router.clear_indices()
            router.set_target_indices(target)
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def stop(self) -> None:
        for router in self.routers:
            router.clear_indices()
            router.clear_router_replay_action()

"""Rollout routing replay on the megatron backend (slime's --use-rollout-routing-replay): every
MoE router of the actor takes, for each token, the experts the rollout engine routed it to, and
weighs them with its own scores (megatron-core's RouterReplay: the scores gathered at the given
experts), so log-probs and gradients go through the experts that produced the tokens.

A micro-batch's rows are right-padded samples; megatron's routers see its tokens position-major
([s, b] flattened, split over tensor ranks along s under sequence parallelism). Each sample's
routes cover its tokens but the last; that position and the padding get experts 0..k-1, which
changes no trained position (the model is causal and those positions predict nothing trained).

While training, each router also counts the real tokens whose experts its own top k would have
chosen differently (`RouteReplay.counted`): how far the trainer's routing is from the engine's,
which is what replay corrects.
"""

from __future__ import annotations

import torch


def replay_targets(routes: list[torch.Tensor], rows: int, length: int, *, tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False, device: torch.device | str = "cpu"
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per layer, the [tokens, top_k] experts of a micro-batch of `rows` x `length` positions whose
    first samples have `routes` ([L_i - 1, layers, top_k] each), in the order this rank's routers
    see its tokens; and which of those tokens are real (routed by the engine), not padding."""
    layers, top_k = routes[0].shape[1:]
    grid = torch.arange(top_k, dtype=torch.long).expand(rows, length, layers, top_k).clone()
    real = torch.zeros(rows, length, dtype=torch.bool)
    for i, sample in enumerate(routes):
        grid[i, : sample.shape[0]] = sample
        real[i, : sample.shape[0]] = True
    grid, real = grid.transpose(0, 1), real.transpose(0, 1)  # [s, b, ...]: the routers' token order
    if sequence_parallel and tp_size > 1:
        grid, real = grid.chunk(tp_size, dim=0)[tp_rank], real.chunk(tp_size, dim=0)[tp_rank]
    flat = grid.reshape(-1, layers, top_k).to(device)
    return [flat[:, layer].contiguous() for layer in range(layers)], real.reshape(-1).to(device)


class RouteReplay:
    """The actor's routers, in layer order, switched between replaying given experts and routing
    by themselves (the reference model's routers are not touched: it routes for itself)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [layer.mlp.router.router_replay for layer in model.decoder.layers]
        if any(r is None for r in self.routers):
            raise ValueError("routing replay needs every layer's router built with moe_enable_routing_replay")
        self._real: torch.Tensor | None = None  # set while counting: the real tokens of the micro-batch
        self._differ: list[torch.Tensor] = []  # per counted forward and layer: real tokens routed otherwise
        self._routes = 0  # real (token, layer) routes counted
        for router in self.routers:
            router.get_replay_topk = self._counting(router, router.get_replay_topk)

    def replay(self, targets: list[torch.Tensor], real: torch.Tensor | None = None) -> None:
        """Until `stop`, every forward (and the recompute in its backward) takes these experts;
        given `real` (the micro-batch's real tokens), the first forward counts disagreements."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if len(targets) != len(self.routers):
            raise ValueError(f"routes of {len(targets)} layers for a model of {len(self.routers)} MoE layers")
        for router, target in zip(self.routers, targets):
            router.clear_indices()
            router.set_target_indices(target)
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.rlkube_counted = real is None  # the recompute in a backward is not counted again
        self._real = real

    def stop(self) -> None:
        self._real = None
        for router in self.routers:
            router.clear_indices()
            router.clear_router_replay_action()

    def counted(self) -> tuple[float, int]:
        """(real routes the trainer's routers would have chosen otherwise, real routes) since the
        last call; one device-to-host copy."""
        differ = float(torch.stack(self._differ).sum()) if self._differ else 0.0
        routes, self._differ, self._routes = self._routes, [], 0
        return differ, routes

    def _counting(self, router, replay_topk):
        def counting_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self._real is not None and not router.rlkube_counted and router.target_topk_idx is not None:
                router.rlkube_counted = True
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups, group_topk)
                    given = router.target_topk_idx.to(own.device)
                    same = (own.sort(-1).values == given.sort(-1).values).all(-1)
                    self._differ.append((~same & self._real).sum())
                    self._routes += int(self._real.sum())
            return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

        return counting_replay_topk

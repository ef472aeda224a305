"""One rollout engine as the engine pool sees it: the actors of its nodes, started, stopped and
restarted together.

An engine of one node is one `EngineActor`. An engine over spec.rollout.nodesPerEngine nodes is
one actor per node (each in a bundle of its own, so on a pod of its own), each running one SGLang
server of the group: node 0 picks where the nodes meet (`--dist-init-addr`, its IP and a free
port), every node starts with its `--node-rank`, and node 0's URL is the engine's, the one the
router and the weight sync talk to. SGLang's nodes fail together (their tensor-parallel ranks
are one NCCL world), so a restart of any node is a restart of all of them, at a fresh address.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from rlkube_runtime.serving.sglang_args import EngineNode, engine_nodes

log = logging.getLogger(__name__)


class EngineGroup:
    """The node actors of engine `index`; `create_node(k)` makes node k's actor (not started),
    also again for a node whose actor died with its pod (Ray places it on the pod replacing it)."""

    def __init__(self, index: int, nnodes: int, create_node: Callable[[int], Any]):
        if nnodes < 1:
            raise ValueError(f"an engine has at least one node, got nnodes={nnodes}")
        self.index = index
        self.nnodes = nnodes
        self._create_node = create_node
        self.nodes = [create_node(k) for k in range(nnodes)]

    async def start(self) -> str:
        """Start every node; the engine's URL (node 0's) once all of them are ready."""
        return await self._run_nodes(lambda actor, node: actor.start.remote(node))

    async def restart(self) -> str:
        """Stop every node, then start them all again (node 0 at a fresh address for the others)."""
        if self.nnodes == 1:
            return await self._restart_single()
        await self.stop(replace_dead=True)
        return await self._run_nodes(lambda actor, node: actor.restart.remote(node))

    async def stop(self, *, replace_dead: bool = False) -> None:
        """Stop every node's process. A node whose actor is gone has nothing left to stop; with
        `replace_dead` it gets a new actor, ready for the next start."""
        from ray.exceptions import RayActorError

        results = await asyncio.gather(*(actor.stop.remote() for actor in self.nodes), return_exceptions=True)
        for k, result in enumerate(results):
            if isinstance(result, RayActorError):
                log.warning("engine %d node %d: its actor is gone (%s)", self.index, k, type(result).__name__)
                if replace_dead:
                    self.nodes[k] = self._create_node(k)
            elif isinstance(result, BaseException):
                raise result

    async def nodes_alive(self) -> bool:
        """Whether the processes of nodes 1.. run (node 0's health check covers node 0); an engine
        of one node has none to check."""
        from ray.exceptions import RayActorError

        if self.nnodes == 1:
            return True
        results = await asyncio.gather(*(actor.alive.remote() for actor in self.nodes[1:]), return_exceptions=True)
        for k, result in enumerate(results, start=1):
            if isinstance(result, RayActorError) or result is False:
                log.warning("engine %d node %d is down (%s)", self.index, k, result)
                return False
            if isinstance(result, BaseException):
                raise result
        return True

    async def _run_nodes(self, call: Callable[[Any, EngineNode], Any]) -> str:
        """`call(actor, its EngineNode)` on every node at once (SGLang's nodes wait for each
        other); node 0's result, the engine's URL."""
        address = await self.nodes[0].dist_init_address.remote() if self.nnodes > 1 else ""
        nodes = engine_nodes(self.nnodes, address)
        urls = await asyncio.gather(*(call(actor, node) for actor, node in zip(self.nodes, nodes)))
        return urls[0]

    async def _restart_single(self) -> str:
        """An engine of one node restarts in its actor; when the actor died (its pod or Ray node
        is gone), a new actor in the same bundle starts it, waiting for the pod that replaces it."""
        from ray.exceptions import RayActorError

        try:
            return await self.nodes[0].restart.remote()
        except RayActorError as err:
            log.warning("engine %d: its actor is gone (%s); starting a new one in its bundle", self.index, type(err).__name__)
            self.nodes[0] = self._create_node(0)
            return await self.nodes[0].start.remote()

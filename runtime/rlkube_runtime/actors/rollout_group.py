"""The rollout side of a job as the loop sees it: one RolloutManager actor (prompts, engines,
router, rewards, eval) behind plain methods, as slime's RolloutManager. The only place that
waits on the manager; the engines behind it are fanned out over by its EnginePool.
"""

from __future__ import annotations

from typing import Any

from rlkube_runtime.actors.engine_pool import PoolConfig
from rlkube_runtime.actors.rollout_manager import RolloutManager
from rlkube_runtime.weight_sync.coordinator import SyncReport
from rlkube_runtime.weight_sync.plan import SyncPlan

Rollout = tuple[list[dict[str, Any]], dict[str, float]]  # (samples as dicts, rollout metrics)


class RolloutGroup:
    def __init__(self, handle: Any):
        self.handle = handle

    @classmethod
    def start(cls, spec: dict[str, Any], pool: PoolConfig, *, resources: dict[str, float]) -> RolloutGroup:
        """The manager actor (Ray `resources` beside its CPU share), not yet started (see `start_ref`)."""
        import ray

        manager_cls = ray.remote(RolloutManager)
        handle = manager_cls.options(num_cpus=0, max_concurrency=16, resources=resources).remote(spec, pool)
        return cls(handle)

    def start_ref(self) -> Any:
        """Starts the engines and the router; the ref to wait for (with the trainers' readiness)."""
        return self.handle.start.remote()

    @staticmethod
    def wait_started(started: Any) -> None:
        import ray

        ray.get(started)

    # -- generation -----------------------------------------------------------------------

    def generate(self, rollout_id: int) -> Any:
        """Rollout `rollout_id`, generating in the background: the ref `take` waits for."""
        return self.handle.generate.remote(rollout_id)

    def take(self, pending: Any, stop) -> Rollout | None:
        """The rollout `pending` generates; None when `stop` is requested before it is ready."""
        import ray

        while not ray.wait([pending], timeout=0.5)[0]:
            if stop.requested:
                return None
        return ray.get(pending)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        import ray

        return ray.get(self.handle.evaluate.remote(rollout_id))

    # -- weights and memory ---------------------------------------------------------------

    def set_weight_pushers(self, pushers: list[Any], plan: SyncPlan) -> None:
        import ray

        ray.get(self.handle.set_weight_pushers.remote(pushers, plan))

    def update_weights(self, version: int) -> SyncReport:
        """Pause, load (by the plan's pushing ranks), resume and check every engine at `version`."""
        import ray

        return ray.get(self.handle.update_weights.remote(str(version)))

    def release(self, tags: list[str] | None = None) -> None:
        """Colocated: every engine frees `tags` (weights, kv_cache, cuda_graph; default all)."""
        import ray

        ray.get(self.handle.release_memory.remote(tags))

    def restore(self, tags: list[str] | None = None) -> None:
        import ray

        ray.get(self.handle.resume_memory.remote(tags))

    # -- bookkeeping ----------------------------------------------------------------------

    def data_state(self, next_rollout_id: int) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.data_state.remote(next_rollout_id))

    def load_data_state(self, state: dict[str, Any]) -> None:
        import ray

        ray.get(self.handle.load_data_state.remote(state))

    def take_engine_restarts(self) -> int:
        import ray

        return ray.get(self.handle.take_engine_restarts.remote())

    def engine_urls(self) -> list[str]:
        import ray

        return ray.get(self.handle.engine_urls.remote())

    def shutdown(self, timeout: float = 60) -> None:
        import ray

        ray.get(self.handle.shutdown.remote(), timeout=timeout)

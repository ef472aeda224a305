"""The trainer ranks as one object, as slime's RayTrainGroup: each method is one phase of the
loop, fanned out over every rank and waited for. The only place that calls `ray.get` over the
trainer actors; the loop never sees a rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkube_runtime.actors.rendezvous import rendezvous_address
from rlkube_runtime.actors.trainer import TrainerWorker
from rlkube_runtime.weight_sync.coordinator import SyncReport
from rlkube_runtime.weight_sync.plan import SyncPlan


class TrainerGroup:
    """`handles`: the TrainerWorker actors in rank order. `sync`: which rank pushes weights to
    which engine, and how (the weight-sync plan)."""

    def __init__(self, handles: list[Any], sync: SyncPlan):
        self.handles = list(handles)
        self.sync = sync
        self._gathers = True  # whether a push gathers the model first; the ranks say so when ready

    @classmethod
    def start(cls, spec: dict[str, Any], *, model_path: str, topology, in_bundle, sync: SyncPlan) -> TrainerGroup:
        """One TrainerWorker per trainer bundle, not yet waited for (see `wait_ready`)."""
        import ray

        # Trainer ranks meet at rank 0's node (its IP, a free port there): on a cluster the ranks
        # are pods of their own, and loopback reaches none of them.
        master_addr, master_port = ray.get(
            ray.remote(rendezvous_address)
            .options(num_cpus=0, scheduling_strategy=in_bundle(topology.trainer_bundles[0]))
            .remote()
        )
        trainer_cls = ray.remote(TrainerWorker)
        threads = 1 if topology.device == "cpu" else None
        handles = [
            trainer_cls.options(
                num_cpus=topology.trainer_actor_resources.get("CPU", 0),
                num_gpus=topology.trainer_actor_resources.get("GPU", 0),
                scheduling_strategy=in_bundle(topology.trainer_bundles[rank]),
            ).remote(
                spec,
                hf_checkpoint=model_path,
                rank=rank,
                world_size=topology.trainer_world_size,
                master_addr=master_addr,
                master_port=master_port,
                device=topology.device,
                num_threads=threads,
            )
            for rank in range(topology.trainer_world_size)
        ]
        return cls(handles, sync)

    def wait_ready(self, also: list[Any] = ()) -> None:
        """Until every rank has built its model, and the refs in `also` (the engines' start) are done."""
        import ray

        answers = ray.get([t.ready.remote() for t in self.handles] + list(also))
        self._gathers = any(answers[: len(self.handles)])

    def gpus(self) -> list[tuple[str, list[int]]]:
        """Every rank's (node IP, GPU ids), rank order."""
        return self._all("gpus")

    # -- the loop's phases ----------------------------------------------------------------

    def train(self, rollout_id: int, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Advantages and `numStepsPerRollout` optimizer steps on every rank; rank 0's metrics
        (every rank returns the same)."""
        return self._all("train", rollout_id, samples)[0]

    def push_weights(self, rollouts, version: int) -> SyncReport:
        """The current weights into every engine of `rollouts` (a RolloutGroup): where the model is
        sharded (megatron), every rank first gathers what the pushing ranks send; then the engines
        are paused, loaded by their pushing rank and resumed at `version`."""
        if self._gathers:
            self._all("stage_weights", per_rank=lambda rank: {"keep": rank in self.sync.pushing_ranks})
        return rollouts.update_weights(version)

    def save(self, directory: Path) -> dict[str, Any]:
        """Every rank's part of a checkpoint into `directory` (collective); returns what the
        checkpoint's payload records of the trainer: its format (none for the torch format, the first)."""
        fmt = self._all("save", str(directory))[0]
        return {} if fmt is None else {"trainer_format": fmt}

    def load(self, directory: Path, payload: dict[str, Any]) -> None:
        """Restore what `save` wrote (collective). A checkpoint from before the ranks wrote their
        own random streams holds them in its payload: each rank takes its own back, or rank 0's
        (inside the trainer state) from a checkpoint of another world size."""
        rngs = payload.get("trainer_rng") or []
        if len(rngs) != len(self.handles):
            rngs = [None] * len(self.handles)
        self._all("load", str(directory), payload.get("trainer_format"), payload.get("trainer"),
                  per_rank=lambda rank: {"rng": rngs[rank]})

    def release(self, *, keep_weights: bool = False) -> None:
        """Colocated: every rank gives its device memory back (the weights too unless `keep_weights`)."""
        self._all("release", keep_weights=keep_weights)

    def restore(self) -> None:
        self._all("restore")

    def close(self, timeout: float = 60) -> None:
        """Every rank leaves the process group at once (TrainerWorker.close) before Ray ends them."""
        import ray

        ray.get([handle.close.remote() for handle in self.handles], timeout=timeout)

    def last_advantages(self, count: int) -> list[list[float]]:
        import ray

        return ray.get(self.handles[0].last_advantages.remote(count))

    def export_hf(self, directory: Path) -> str:
        """The trained weights as a Hugging Face directory, gathered on rank 0 and written there
        under a temporary name, renamed to `directory` once complete."""
        import ray

        if self._gathers:
            self._all("stage_weights", per_rank=lambda rank: {"keep": rank == 0})
        return ray.get(self.handles[0].export_hf.remote(str(directory)))

    def _all(self, method: str, *args: Any, per_rank=None, **kwargs: Any) -> list[Any]:
        """`method` on every rank at once (the collective calls need all of them), results in rank order."""
        import ray

        refs = []
        for rank, handle in enumerate(self.handles):
            extra = per_rank(rank) if per_rank is not None else {}
            refs.append(getattr(handle, method).remote(*args, **{**kwargs, **extra}))
        return ray.get(refs)

"""The rollout engines of a job and the router in front of them: start, health, replacement,
weight pushes and memory hand-off. The rollout manager actor owns one; generation goes through
the router and never needs to know which engine serves it.

An engine that stops answering (its health check, or a weight sync that finds it dead) is
replaced: deregistered from the router, started again, given the weights of the last sync by the
trainer rank that pushes to it, and registered again. Every attempt counts against
spec.faultTolerance.maxEngineRestarts; when they are used up the failure is kept and raised by
the next call, and `unless_failed` stops a rollout that waits on engines that will not return.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlkube_runtime.actors.engine import EngineActor, engine_actor_options
from rlkube_runtime.actors.engine_group import EngineGroup
from rlkube_runtime.serving.client import engine_unreachable
from rlkube_runtime.spec import RLJobSpec
from rlkube_runtime.weight_sync.coordinator import SyncReport, pause, resume_and_check, run_sync, sync_engines
from rlkube_runtime.weight_sync.plan import SyncPlan

log = logging.getLogger(__name__)
T = TypeVar("T")

# In the run's log directory: one JSON line per engine replacement (see _journal_replacement).
ENGINE_RESTARTS_JOURNAL = "engine_restarts.jsonl"


class EngineRestartLimitExceeded(RuntimeError):
    pass


@dataclass(frozen=True)
class PoolConfig:
    """Where a job's engines run and what they load.

    model_path: the HF directory every engine starts from. log_dir: engine logs and the
    replacement journal. placement_group / engine_bundles: the Ray placement group and engine
    j's bundle per node in it, node 0's first (one each unless engines span nodes; None: no
    placement group, one engine). engine_resources: each engine (node) actor's Ray resources.
    device: "cpu" or "cuda". engine_gpu_ids: per engine, the GPU ids it is handed (a colocated
    engine over several GPUs); empty: what Ray gives its actor.
    fp8_model_dir: an fp8 rollout's block-fp8 copy of the model, which the engines start from.
    """

    model_path: str
    log_dir: str
    placement_group: Any = None
    engine_bundles: tuple[tuple[int | None, ...], ...] = ((None,),)
    engine_resources: Mapping[str, float] = field(default_factory=dict)
    device: str = "cpu"
    engine_gpu_ids: tuple[tuple[int, ...], ...] = ()
    fp8_model_dir: str | None = None


class EnginePool:
    """Not an actor: lives in the rollout manager's event loop (its methods are coroutines)."""

    def __init__(self, spec: RLJobSpec, config: PoolConfig):
        self.spec = spec
        self.config = config
        self.model_path = config.model_path
        self.log_dir = config.log_dir
        self._engines: list[EngineGroup] = []  # each engine's node actors
        self._urls: list[str] = []
        self._router = None
        self._admins: dict[str, Any] = {}  # engine URL -> its EngineAdmin, kept for the run
        # Who pushes weights: the trainer rank handles, and the plan (which rank serves engine j, how).
        self._pushers: list[Any] = []
        self._sync_plan = SyncPlan()
        self._synced_version: str | None = None  # what every engine holds since the last sync
        self._restarts_total = 0
        self._restarts_unreported = 0
        self.generating: int | None = None  # the rollout in flight, for the replacement journal
        self._health_task: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._failed = asyncio.Event()  # set with _failure: stops a rollout waiting on dead engines
        self._lock = asyncio.Lock()

    # -- life cycle -----------------------------------------------------------------------

    def launch(self) -> Awaitable[list[str]]:
        """Start one engine per bundle; awaiting the result gives their URLs. The engines take
        the longest to start (each imports torch and loads the model): the caller gets the rest
        of the job ready meanwhile, and `start_router` starts the router beside them."""
        self._engines = self._create_engines()
        return asyncio.gather(*(engine.start() for engine in self._engines))

    async def start_router(self, engine_urls: Awaitable[list[str]]) -> str:
        """The real sglang-router in front of the engines, and the health watch; returns its URL.
        The router starts while the engines do (it runs with no workers), and each engine is
        registered as it would be after a restart (`POST /workers`) once all of them answer."""
        from rlkube_runtime.serving.launch import node_ip
        from rlkube_runtime.serving.router import RouterProcess

        self._router = RouterProcess(
            worker_urls=[],
            log_dir=self.log_dir,
            model_path=self.model_path,
            # Reached by the engines' and trainer's pods at this pod's IP (loopback only off Ray).
            host=node_ip(),
            router_args=dict(self.spec.rollout.router_args),
        )
        urls, _ = await asyncio.gather(engine_urls, asyncio.to_thread(self._router.start))
        self._urls = list(urls)
        await asyncio.gather(*(asyncio.to_thread(self._router.add_worker, url) for url in self._urls))
        if self.spec.fault_tolerance.enabled:
            self._health_task = asyncio.create_task(self._watch_engines())
        return self._router.url

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for admin in self._admins.values():
            await admin.close()
        await asyncio.to_thread(self._deregister_engines)
        # The engines and the router stop independently: at the same time.
        engines_stopped = asyncio.gather(*(e.stop() for e in self._engines), return_exceptions=True)
        if self._router is not None:
            await asyncio.to_thread(self._router.stop)
        await engines_stopped

    def _deregister_engines(self) -> None:
        """Take every engine out of the router by its worker id before the engines stop, as a
        replacement does, so the router never routes to an engine that is going away. Best
        effort: a router that is already gone has nothing left to route."""
        if self._router is None or not self._router.alive():
            return
        for url in self._urls:
            try:
                self._router.remove_worker(url, wait=False)
            except (OSError, RuntimeError) as err:  # URLError is an OSError; RuntimeError: a non-2xx answer
                log.warning("could not deregister engine %s from the router at shutdown: %s", url, err)

    def _create_engines(self) -> list[EngineGroup]:
        """One EngineGroup per engine (not started yet): an actor per node of the engine."""
        return [
            EngineGroup(j, len(nodes), lambda k, j=j: self._create_engine(j, k))
            for j, nodes in enumerate(self.config.engine_bundles)
        ]

    def _create_engine(self, j: int, node_rank: int = 0) -> Any:
        """Node `node_rank` of engine j: an EngineActor in its bundle, its arguments read from the
        spec by `engine_actor_options` (seed = training.seed + the engine's index). Also for a
        node whose actor died with its pod: Ray places the bundle again on the pod that replaces it."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = self.config
        bundle = config.engine_bundles[j][node_rank]
        options: dict[str, Any] = {
            "num_cpus": config.engine_resources.get("CPU", 0),
            "num_gpus": config.engine_resources.get("GPU", 0),
        }
        if config.placement_group is not None and bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=config.placement_group, placement_group_bundle_index=bundle
            )
        gpus = config.engine_gpu_ids[j] if j < len(config.engine_gpu_ids) else ()
        arguments = engine_actor_options(
            self.spec, j, model_path=config.model_path, log_dir=config.log_dir, device=config.device, gpu_ids=gpus,
            fp8_model_dir=config.fp8_model_dir, node_rank=node_rank,
        )
        return ray.remote(EngineActor).options(**options).remote(**arguments)

    # -- weights --------------------------------------------------------------------------

    def set_weight_pushers(self, pushers: list[Any], plan: SyncPlan) -> None:
        """The trainer ranks (Ray handles, rank order) and the sync plan: which rank serves engine
        j (the rank sharing its GPU for `tensor`, rank 0 otherwise), and the transport."""
        self._pushers, self._sync_plan = list(pushers), plan

    @property
    def synced(self) -> bool:
        """Whether the trainer's weights have reached the engines (under LoRA: they serve its adapter)."""
        return self._synced_version is not None

    async def update_weights(self, version: str) -> SyncReport:
        """Pause and flush every engine, have the trainer push its weights, resume, and check that
        each engine reports `version` (`weight_sync.sync_engines`). An engine that fails on the
        way is replaced (and given the weights) before it rejoins. Returns the push's figures."""
        self.raise_if_failed()
        async with self._lock:
            report = await sync_engines(self._sync_plan, self._push_from, self, version)
            self._synced_version = version
            return report

    async def replace_lost(self, j: int, version: str) -> None:
        """Engine j died since the last health check (the sync of `version` found it): replace it
        now; the replacement gets these weights before it joins the router."""
        self._synced_version = version
        await self._replace_engine_locked(j)

    async def _push(self, version: str, engines: list[int], urls: dict[int, str] | None = None) -> SyncReport:
        """Push `version` (the trainer's current weights) to these engines, each from its pusher
        rank (weight_sync.run_sync)."""
        urls = urls or {j: self._urls[j] for j in engines}
        return await run_sync(self._sync_plan, self._push_from, {j: urls[j] for j in engines}, version)

    async def _push_from(self, rank: int, urls: list[str], plan: SyncPlan, version: str) -> SyncReport:
        return await self._pushers[rank].push_weights.remote(urls, plan, version)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees `tags` (weights, kv_cache, cuda_graph; default all) until resumed."""
        await self._each_live_engine(lambda admin: admin.release_memory_occupation(tags))

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._each_live_engine(lambda admin: admin.resume_memory_occupation(tags))

    async def _each_live_engine(self, call) -> None:
        """`call` every engine's admin at once. An engine that does not answer is passed over: a
        dead engine holds no memory, and the health check (or the next weight sync) replaces it
        with one that starts with its memory in place."""
        urls = list(self._urls)
        results = await asyncio.gather(*(call(self.admin(url)) for url in urls), return_exceptions=True)
        for url, result in zip(urls, results):
            if isinstance(result, BaseException):
                if not engine_unreachable(result):
                    raise result
                log.warning("engine %s did not answer (%s); it will be replaced", url, result)

    def admin(self, url: str):
        """The engine's control client: one per engine for the run, so one connection pool and
        not a new session and connection for every call."""
        from rlkube_runtime.serving.client import EngineAdmin

        if url not in self._admins:
            self._admins[url] = EngineAdmin(url)
        return self._admins[url]

    # -- fault tolerance ------------------------------------------------------------------

    def take_restarts(self) -> int:
        """Engine restarts since the last call (the driver counts them into its metrics)."""
        n, self._restarts_unreported = self._restarts_unreported, 0
        return n

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def unless_failed(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless engine replacement fails first: then raise that failure at once
        instead of letting requests retry against engines that will not come back."""
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise self._failure
        return task.result()

    async def _watch_engines(self) -> None:
        from rlkube_runtime.serving.client import EngineAdmin

        check = self.spec.fault_tolerance.health_check
        await asyncio.sleep(check.first_wait_seconds)
        while True:
            for j, url in enumerate(list(self._urls)):
                admin = EngineAdmin(url, timeout=check.timeout_seconds)
                try:
                    # Node 0 answers for the engine; the process of each of its other nodes must run too.
                    healthy = await admin.health_generate() and await self._engines[j].nodes_alive()
                except Exception as err:  # a dead engine fails in many ways; all mean "replace it"
                    log.warning("engine %s failed its health check: %s", url, err)
                    healthy = False
                finally:
                    await admin.close()
                if not healthy:
                    try:
                        await self._replace_engine(j, url)
                    except BaseException as err:
                        self._failure = err
                        self._failed.set()
                        return
            await asyncio.sleep(check.interval_seconds)

    async def _replace_engine(self, j: int, failed_url: str) -> None:
        async with self._lock:
            if self._urls[j] != failed_url:
                return  # a weight sync found it dead first and has replaced it already
            await self._replace_engine_locked(j)

    async def _replace_engine_locked(self, j: int) -> None:
        """Deregister engine j, start it again (each attempt counts as a restart: a replacement
        can fail too, e.g. when its fresh port was taken meanwhile), give it the weights of the
        last sync (pushed by the trainer; a replacement during a train phase waits for the phase
        and gets the trainer's weights as they are then), register it."""
        old = self._urls[j]
        detected_at = time.time()
        await asyncio.to_thread(self._router.remove_worker, old)
        if old in self._admins:
            await self._admins.pop(old).close()
        while True:
            self._count_restart(j)
            try:
                new = await self._restarted(j)
                if self._synced_version is not None:
                    await pause(self.admin(new))
                    report = await self._push(self._synced_version, [j], urls={j: new})
                    if report.failed:
                        raise RuntimeError(f"the replacement did not take the weights: {report.failed[new]}")
                    await resume_and_check(self.admin(new), new, self._synced_version)
                # What the replacement holds as it joins the router, asked of the engine itself:
                # the record that a joining engine serves the trainer's latest weights.
                serving = await self.admin(new).get_weight_version()
                break
            except Exception as err:  # the next attempt stops whatever this one left running
                log.warning("engine %d: replacement %d failed: %s", j, self._restarts_total, err)
        self._urls[j] = new
        await asyncio.to_thread(self._router.add_worker, new)
        log.warning("engine %d replaced: %s -> %s (weight version %s)", j, old, new, serving)
        self._journal_replacement({
            "engine": j, "old": old, "new": new, "rollout": self.generating,
            "weight_version": serving, "synced_version": self._synced_version,
            "detected_at": detected_at, "joined_at": time.time(),
        })

    async def _restarted(self, j: int) -> str:
        """Engine j started again: all of its nodes, by their actors or, for one whose actor died
        (its pod or Ray node is gone), by a new actor in the same bundle (EngineGroup.restart)."""
        return await self._engines[j].restart()

    def _journal_replacement(self, record: dict[str, Any]) -> None:
        """One line per replaced engine in `<log dir>/engine_restarts.jsonl`: which engine, the
        rollout in flight, the weight version it joined with and the last synced one, and when
        its failure was found and when it joined the router again (Unix seconds)."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(os.path.join(self.log_dir, ENGINE_RESTARTS_JOURNAL), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:  # a full or read-only log volume must not stop the run
            log.warning("could not record the engine replacement in %s: %s", self.log_dir, err)

    def _count_restart(self, j: int) -> None:
        limit = self.spec.fault_tolerance.max_engine_restarts
        if not self.spec.fault_tolerance.enabled:
            raise EngineRestartLimitExceeded(
                f"rollout engine {j} stopped answering, and spec.faultTolerance.enabled = false: it is not replaced"
            )
        if self._restarts_total >= limit:
            raise EngineRestartLimitExceeded(
                f"rollout engine {j} stopped answering, and all restarts are used "
                f"({self._restarts_total} of spec.faultTolerance.maxEngineRestarts = {limit})"
            )
        self._restarts_total += 1
        self._restarts_unreported += 1

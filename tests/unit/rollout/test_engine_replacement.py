"""How the engine pool replaces a dead engine: deregister, restart (retrying a failed
replacement), register; every attempt counts against spec.faultTolerance.maxEngineRestarts.

The engine actor and the router are stand-ins recording calls: this is the pool's bookkeeping,
the real processes are exercised by tests/integration/test_fault_tolerance.py and tests/chaos.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
import yaml

from rlkube_runtime.serving.launch import ProcessStartError
from rlkube_runtime.actors.engine_group import EngineGroup
from rlkube_runtime.actors.engine_pool import EnginePool, EngineRestartLimitExceeded, PoolConfig
from rlkube_runtime.serving.sglang_args import EngineNode
from rlkube_runtime.spec import RLJobSpec

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


class _RemoteMethod:
    """`actor.method.remote()` as Ray spells it, awaiting a coroutine instead of an ObjectRef."""

    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class _EngineActor:
    def __init__(self, outcomes):
        self._outcomes = list(outcomes)  # a URL to come up on, or an exception to fail with
        self.restart = _RemoteMethod(self._restart)

    async def _restart(self):
        outcome = self._outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class _Admin:
    """An engine's control client: reports the weight version the engine holds."""

    def __init__(self, version="default"):
        self.version = version

    async def get_weight_version(self):
        return self.version

    async def close(self):
        pass


class _Router:
    def __init__(self, workers):
        self.workers = list(workers)

    def remove_worker(self, url):
        self.workers.remove(url)

    def add_worker(self, url):
        self.workers.append(url)


def _pool(outcomes, max_restarts=2):
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    spec["faultTolerance"] = {"maxEngineRestarts": max_restarts}
    manager = EnginePool(
        RLJobSpec.model_validate(spec),
        PoolConfig(model_path="unused", log_dir=tempfile.mkdtemp(prefix="rlkube-replacement-")),
    )
    manager._urls = ["http://engine:1", "http://engine:2"]
    manager._admins = {f"http://engine:{i}": _Admin() for i in range(1, 10)}
    manager._engines = [EngineGroup(j, 1, lambda k, a=actor: a) for j, actor in enumerate([_EngineActor([]), _EngineActor(outcomes)])]
    manager._router = _Router(manager._urls)
    return manager


async def test_a_replacement_that_fails_to_start_is_retried_and_both_attempts_count():
    manager = _pool([ProcessStartError("port taken"), "http://engine:3"])
    await manager._replace_engine(1, "http://engine:2")
    assert manager._urls == ["http://engine:1", "http://engine:3"]
    assert manager._router.workers == ["http://engine:1", "http://engine:3"]
    assert manager.take_restarts() == 2
    assert manager.take_restarts() == 0
    # The replacement is journalled with the version it reported as it joined the router.
    [record] = [json.loads(line) for line in (Path(manager.log_dir) / "engine_restarts.jsonl").read_text().splitlines()]
    assert {k: record[k] for k in ("engine", "old", "new", "weight_version", "synced_version")} == {
        "engine": 1, "old": "http://engine:2", "new": "http://engine:3", "weight_version": "default",
        "synced_version": None,
    }
    assert record["detected_at"] <= record["joined_at"]


async def test_replacements_stop_at_max_engine_restarts_with_the_field_named():
    manager = _pool([ProcessStartError("1"), ProcessStartError("2"), "http://engine:3"], max_restarts=2)
    with pytest.raises(EngineRestartLimitExceeded, match="maxEngineRestarts = 2"):
        await manager._replace_engine(1, "http://engine:2")
    # The dead engine is out of the router either way: nothing is sent to it any more.
    assert manager._router.workers == ["http://engine:1"]


async def test_an_engine_already_replaced_by_a_weight_sync_is_not_replaced_again():
    manager = _pool(["http://engine:3"])
    manager._urls[1] = "http://engine:9"  # the weight sync's replacement
    await manager._replace_engine(1, "http://engine:2")
    assert manager._urls[1] == "http://engine:9"
    assert manager.take_restarts() == 0


async def test_a_rollout_waiting_on_engines_fails_at_once_when_replacement_has_failed():
    manager = _pool([])
    never_answered = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(manager.unless_failed(never_answered))
    await asyncio.sleep(0)
    manager._failure = EngineRestartLimitExceeded("engine 1 failed after 2 restarts")
    manager._failed.set()
    with pytest.raises(EngineRestartLimitExceeded):
        await asyncio.wait_for(waiting, timeout=5)
    assert never_answered.cancelled()


async def test_a_rollout_that_finishes_returns_its_result():
    manager = _pool([])

    async def rollout():
        return "samples"

    assert await manager.unless_failed(rollout()) == "samples"


# ---- an engine over several nodes ----------------------------------------------------------


class _NodeActor:
    """One node's EngineActor: records each start with the EngineNode it was given."""

    def __init__(self, k, calls, *, gone=False):
        self.k, self.calls, self.gone, self.running = k, calls, gone, False
        self.start = _RemoteMethod(self._start)
        self.restart = _RemoteMethod(self._restart)
        self.stop = _RemoteMethod(self._stop)
        self.alive = _RemoteMethod(self._alive)
        self.dist_init_address = _RemoteMethod(self._address)

    def _check(self):
        if self.gone:
            from ray.exceptions import RayActorError

            raise RayActorError()

    async def _address(self):
        self._check()
        self.calls.append((self.k, "address"))
        return f"10.0.1.1:{29600 + len(self.calls)}"

    async def _start(self, node=EngineNode()):
        self._check()
        self.calls.append((self.k, "start", node))
        self.running = True
        return f"http://10.0.1.{self.k + 1}:30000"

    async def _restart(self, node=EngineNode()):
        await self._stop()
        return await self._start(node)

    async def _stop(self):
        self._check()
        self.running = False
        self.calls.append((self.k, "stop"))

    async def _alive(self):
        self._check()
        return self.running


def _group(nnodes, *, gone=()):
    calls, made = [], []

    def create(k):
        actor = _NodeActor(k, calls, gone=k in gone and k not in [a.k for a in made])
        made.append(actor)
        return actor

    return EngineGroup(0, nnodes, create), calls, made


async def test_the_nodes_of_an_engine_start_together_at_node_0s_address_and_node_0_is_the_engine():
    group, calls, _ = _group(3)
    assert await group.start() == "http://10.0.1.1:30000"
    address = "10.0.1.1:29601"
    assert calls[0] == (0, "address")
    assert sorted((c[2] for c in calls[1:]), key=lambda n: n.node_rank) == [EngineNode(3, k, address) for k in range(3)]
    assert await group.nodes_alive()


async def test_a_node_that_stops_makes_its_engine_down_and_a_restart_starts_every_node_at_a_fresh_address():
    group, calls, made = _group(2)
    await group.start()
    made[1].running = False  # node 1's SGLang server exited
    assert not await group.nodes_alive()
    calls.clear()
    assert await group.restart() == "http://10.0.1.1:30000"
    # Every node stops before any starts again (the old group is gone), then all start at node 0's new address.
    assert [c[:2] for c in calls[:2]] == [(0, "stop"), (1, "stop")]
    address = next(c for c in calls if c[1] == "address")
    starts = [c[2] for c in calls if c[1] == "start"]
    assert sorted(starts, key=lambda n: n.node_rank) == [EngineNode(2, 0, "10.0.1.1:29603"), EngineNode(2, 1, "10.0.1.1:29603")]
    assert calls.index(address) < calls.index(next(c for c in calls if c[1] == "start"))
    assert await group.nodes_alive()


async def test_a_node_whose_actor_died_with_its_pod_gets_a_new_actor_when_its_engine_restarts():
    group, calls, made = _group(2, gone={1})
    assert not await group.nodes_alive()  # its actor is gone
    await group.restart()
    assert len(made) == 3 and group.nodes[1] is made[2]  # a new actor for node 1, in its bundle
    assert [c[2].node_rank for c in calls if c[1] == "start"] == [0, 1]
    assert await group.nodes_alive()


async def test_the_pool_replaces_an_engine_over_two_nodes_as_one_and_registers_node_0_only():
    manager = _pool([])
    group, calls, made = _group(2)
    manager._engines[1] = group
    manager._admins["http://10.0.1.1:30000"] = _Admin()
    await manager._replace_engine(1, "http://engine:2")
    assert manager._urls == ["http://engine:1", "http://10.0.1.1:30000"]
    assert manager._router.workers == ["http://engine:1", "http://10.0.1.1:30000"]
    assert {c[2].node_rank for c in calls if c[1] == "start"} == {0, 1}
    assert manager.take_restarts() == 1

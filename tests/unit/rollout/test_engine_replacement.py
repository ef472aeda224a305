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
from rlkube_runtime.actors.engine_pool import EnginePool, EngineRestartLimitExceeded, PoolConfig
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
    manager._engines = [_EngineActor([]), _EngineActor(outcomes)]
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

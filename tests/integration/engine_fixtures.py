"""Fixtures for process-level engine tests: a tiny checkpoint, built-in engines as real processes,
and the real sglang-router in front of them. Import the fixtures you use into the test module.
"""

from __future__ import annotations

import asyncio

import pytest

from rlkube_runtime.serving.client import EngineAdmin
from rlkube_runtime.serving.launch import start_engines
from rlkube_runtime.serving.router import RouterProcess
from rlkube_runtime.tiny.model import build_tiny_checkpoint

# Fast failure detection, so a killed engine leaves the rotation within a couple of seconds.
FAST_HEALTH_CHECKS = {"health-check-interval-secs": 1, "health-failure-threshold": 1, "health-check-timeout-secs": 2}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def engine_pair(tiny_checkpoint, log_dir):
    """Two built-in engines (seeds 100 and 101), one CPU thread each."""
    engines = start_engines(2, model_path=str(tiny_checkpoint), log_dir=str(log_dir), seed=100, name_prefix="pair",
                            engine_args={"num-threads": 1})
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture(scope="module")
def router(engine_pair, log_dir, tiny_checkpoint):
    router = RouterProcess(
        [e.url for e in engine_pair], log_dir=str(log_dir), model_path=str(tiny_checkpoint),
        router_args={"policy": "round_robin", **FAST_HEALTH_CHECKS},
    ).start()
    yield router
    router.stop()


async def engine_state(url: str) -> dict:
    """The engine's request counters: running, waiting, finished, generated tokens."""
    async with EngineAdmin(url) as admin:
        return (await admin.server_info())["internal_states"][0]


async def finished_requests(url: str) -> int:
    return (await engine_state(url))["num_finished_reqs"]


async def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)

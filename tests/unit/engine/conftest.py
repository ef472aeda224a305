"""Fixtures for the engine's unit tests: tiny checkpoints per session, in-process servers per test.

The servers are real aiohttp servers on a local port, driven over HTTP; only the process
boundary is skipped (the integration tests cover that).
"""

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.engine.routes import build_app
from rlkube_runtime.tiny.model import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Same architecture and tokenizer as `tiny_model_dir`, different weights."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model-seed1"), seed=1)


@pytest.fixture
async def start_engine(tiny_model_dir):
    """`await start_engine(**EngineConfig fields)` → an aiohttp TestClient bound to a fresh engine."""
    clients = []

    async def start(**overrides) -> TestClient:
        overrides.setdefault("model_path", str(tiny_model_dir))
        engine = Engine.load(EngineConfig(**overrides))
        client = TestClient(TestServer(build_app(engine)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def client(start_engine):
    return await start_engine()


"""Helpers shared by the engine's unit tests (a uniquely named module, importable from them)."""

from aiohttp.test_utils import TestClient

from rlkube_runtime.engine.engine import Engine
from rlkube_runtime.engine.routes import ENGINE_KEY


def engine_of(client: TestClient) -> Engine:
    """The Engine behind an in-process test server, for checks HTTP cannot make."""
    return client.server.app[ENGINE_KEY]

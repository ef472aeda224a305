"""Helpers shared by the engine's unit tests (a uniquely named module, importable from them)."""

from aiohttp.test_utils import TestClient

from rlkube_runtime.engine.engine import Engine
from rlkube_runtime.engine.routes import ENGINE_KEY


def engine_of(client: TestClient) -> Engine:
    """The Engine behind an in-process test server, for checks HTTP cannot make."""
    return client.server.app[ENGINE_KEY]


def record_batch_sizes(client: TestClient) -> list[int]:
    """Batch sizes of the engine's forward passes (prefills and decode steps), in order."""
    runner = engine_of(client).runner
    sizes: list[int] = []
    prefill, decode = runner.prefill, runner.decode

    def counted_prefill(rows, slots_needed):
        sizes.append(len(rows))
        return prefill(rows, slots_needed)

    def counted_decode(tokens, positions):
        sizes.append(len(tokens))
        return decode(tokens, positions)

    runner.prefill, runner.decode = counted_prefill, counted_decode
    return sizes

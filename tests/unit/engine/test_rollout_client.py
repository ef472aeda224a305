"""The rollout client and engine admin against a real (in-process) engine server."""

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.engine.routes import build_app
from rlkube_runtime.serving.client import EngineAdmin, EngineHTTPError, RolloutClient
from rlkube_runtime.serving.launch import free_port


def _url(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def test_generate_assigns_a_rid_when_missing_and_keeps_a_given_one(client):
    async with RolloutClient(_url(client)) as rollout:
        given = await rollout.generate({"text": "a", "rid": "mine", "sampling_params": {"max_new_tokens": 2}})
        assigned = await rollout.generate({"text": "a", "sampling_params": {"max_new_tokens": 2}})
        batch = await rollout.generate({"input_ids": [[1], [2, 3]], "sampling_params": {"max_new_tokens": 2}})
    assert given["meta_info"]["id"] == "mine"
    assert assigned["meta_info"]["id"].startswith("rlkube-")
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [1, 2]


async def test_a_bad_request_raises_the_servers_message_without_retrying(client):
    async with RolloutClient(_url(client), max_attempts=5) as rollout:
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineHTTPError) as error:
            await rollout.generate({"text": "a", "sampling_params": {"top_k": 0}})
    assert error.value.status == 400 and "sampling_params.top_k" in error.value.message
    assert asyncio.get_running_loop().time() - started < 0.2, "a 400 was retried"


async def test_connection_errors_are_retried_until_the_engine_comes_up(tiny_model_dir):
    port = free_port()
    async with RolloutClient(f"http://127.0.0.1:{port}", max_attempts=8) as rollout:
        pending = asyncio.ensure_future(rollout.generate({"text": "late", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
        await asyncio.sleep(0.5)
        assert not pending.done()
        server = TestServer(build_app(Engine.load(EngineConfig(model_path=str(tiny_model_dir)))), port=port)
        await server.start_server()
        try:
            assert len((await pending)["output_ids"]) == 3
        finally:
            await server.close()


async def test_abort_without_a_router_goes_to_the_engine_itself(client):
    async with RolloutClient(_url(client)) as rollout:
        assert await rollout.worker_urls() == [_url(client)]
        task = asyncio.ensure_future(rollout.generate({"text": "x", "rid": "job-7", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}))
        async with EngineAdmin(_url(client)) as admin:
            while (await admin.load())[0]["num_tokens"] < 5:
                await asyncio.sleep(0.01)
        assert await rollout.abort("job-") == 1
        assert (await task)["meta_info"]["finish_reason"]["type"] == "abort"


async def test_admin_reports_health_flush_refusal_and_weight_version(client):
    async with EngineAdmin(_url(client)) as admin:
        assert await admin.health() and await admin.health_generate()
        assert await admin.flush_cache() is True
        assert await admin.get_weight_version() == "default"
        assert (await admin.model_info())["is_generation"] is True
        await admin.pause_generation(mode="in_place")
        async with RolloutClient(_url(client)) as rollout:
            pending = asyncio.ensure_future(rollout.generate({"text": "x", "sampling_params": {"max_new_tokens": 2}}))
            await asyncio.sleep(0.2)
            assert await admin.flush_cache() is False  # a request is waiting
            await admin.continue_generation()
            await pending
        await admin.release_memory_occupation(["kv_cache"])
        assert (await admin.server_info())["memory_released"] == ["kv_cache"]
        await admin.resume_memory_occupation()
        assert (await admin.server_info())["memory_released"] == []
    async with EngineAdmin(f"http://127.0.0.1:{free_port()}", max_attempts=1) as nobody:
        assert await nobody.health() is False

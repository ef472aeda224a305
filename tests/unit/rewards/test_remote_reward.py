"""Remote rewards against a real aiohttp server on localhost: payload, answers, retries, errors."""

import asyncio
import socket

import pytest
from aiohttp import web
from rlkube_runtime.data import Sample
from rlkube_runtime.rewards import (
    RemoteRewardClient,
    RemoteRewardError,
    compute_reward,
    compute_rewards,
)


class LocalServers:
    """Starts real reward servers on free localhost ports; `hang()` blocks a handler until the
    test ends (a server that never answers), without keeping the teardown waiting."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.released = asyncio.Event()

    async def start(self, handler) -> str:
        app = web.Application()
        app.router.add_post("/reward", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/reward"

    async def hang(self) -> None:
        await self.released.wait()


@pytest.fixture
async def servers():
    servers = LocalServers()
    yield servers
    servers.released.set()
    for runner in servers.runners:
        await runner.cleanup()


def sample(**kw) -> Sample:
    return Sample(prompt="2+2?", response="4", label="4", metadata={"task": "add"}, index=7, **kw)


def fast_client(url: str, **kw) -> RemoteRewardClient:
    kw.setdefault("timeout_seconds", 2.0)
    return RemoteRewardClient(url, retry_wait_seconds=0.01, max_retry_wait_seconds=0.02, **kw)


async def test_the_server_receives_prompt_response_label_and_metadata(servers):
    received = []

    async def handler(request):
        received.append(await request.json())
        return web.json_response(1.0)

    url = await servers.start(handler)
    assert await compute_reward(sample(), reward_type="remote", url=url) == 1.0
    assert received == [
        {"prompt": "2+2?", "response": "4", "label": "4", "metadata": {"task": "add"}}
    ]


async def test_an_object_answer_with_a_reward_key_is_accepted(servers):
    async def handler(request):
        return web.json_response({"reward": 0.25, "detail": "partial"})

    async with fast_client(await servers.start(handler)) as client:
        assert await client.score(sample()) == 0.25


async def test_a_server_that_fails_twice_then_answers_is_retried_until_it_answers(servers):
    calls = 0

    async def handler(request):
        nonlocal calls
        calls += 1
        if calls <= 2:
            return web.Response(status=503, text="warming up")
        return web.json_response(0.5)

    async with fast_client(await servers.start(handler), max_retries=3) as client:
        assert await client.score(sample()) == 0.5
    assert calls == 3


async def test_persistent_5xx_fails_after_max_retries_plus_one_attempts_naming_url_and_status(
    servers,
):
    calls = 0

    async def handler(request):
        nonlocal calls
        calls += 1
        return web.Response(status=500, text="boom")

    url = await servers.start(handler)
    async with fast_client(url, max_retries=2) as client:
        with pytest.raises(
            RemoteRewardError,
            match=rf"reward server {url} failed 3 time\(s\) for sample index 7; last error: .*HTTP 500: 'boom'",
        ):
            await client.score(sample())
    assert calls == 3


async def test_a_4xx_fails_at_once_naming_url_and_status(servers):
    calls = 0

    async def handler(request):
        nonlocal calls
        calls += 1
        return web.Response(status=422, text="missing field")

    url = await servers.start(handler)
    async with fast_client(url, max_retries=3) as client:
        with pytest.raises(
            RemoteRewardError,
            match=rf"reward server {url} rejected the request with HTTP 422: 'missing field'",
        ):
            await client.score(sample())
    assert calls == 1


async def test_a_server_that_does_not_answer_in_time_fails_after_its_retries(servers):
    calls = 0

    async def handler(request):
        nonlocal calls
        calls += 1
        await servers.hang()
        return web.json_response(1.0)

    url = await servers.start(handler)
    async with fast_client(url, timeout_seconds=0.2, max_retries=1) as client:
        with pytest.raises(RemoteRewardError, match=r"failed 2 time\(s\).*no answer within 0.2 s"):
            await client.score(sample())
    assert calls == 2


async def test_a_slow_first_answer_is_retried_and_the_second_counts(servers):
    calls = 0

    async def handler(request):
        nonlocal calls
        calls += 1
        if calls == 1:
            await servers.hang()
        return web.json_response(1.0)

    async with fast_client(
        await servers.start(handler), timeout_seconds=0.2, max_retries=1
    ) as client:
        assert await client.score(sample()) == 1.0


async def test_an_unreachable_server_fails_with_a_connection_error_after_retries():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with fast_client(f"http://127.0.0.1:{port}/reward", max_retries=1) as client:
        with pytest.raises(
            RemoteRewardError, match=rf"127.0.0.1:{port}/reward failed 2 time\(s\).*Client\w*Error"
        ):
            await client.score(sample())


@pytest.mark.parametrize(
    "body, message",
    [
        ("not json", "which is not JSON"),
        ('{"score": 1}', "an object without 'reward'"),
    ],
)
async def test_an_answer_that_is_not_a_reward_is_an_error(servers, body, message):
    async def handler(request):
        return web.Response(text=body)

    async with fast_client(await servers.start(handler)) as client:
        with pytest.raises(RemoteRewardError, match=message):
            await client.score(sample())


async def test_a_non_numeric_reward_names_the_server(servers):
    async def handler(request):
        return web.json_response({"reward": "high"})

    url = await servers.start(handler)
    async with fast_client(url) as client:
        with pytest.raises(TypeError, match=rf"reward server {url} returned str 'high'"):
            await client.score(sample())


async def test_a_batch_shares_one_client_and_runs_requests_concurrently(servers):
    in_flight = peak = 0

    async def handler(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        body = await request.json()
        return web.json_response(float(body["response"]))

    url = await servers.start(handler)
    samples = [Sample(response=str(i), index=i) for i in range(8)]
    rewards = await compute_rewards(samples, reward_type="remote", url=url, max_concurrency=4)
    assert rewards == [float(i) for i in range(8)]
    assert [s.reward for s in samples] == rewards
    assert peak == 4


def test_client_settings_are_checked():
    with pytest.raises(
        ValueError, match="must start with http:// or https://, got 'localhost:8000'"
    ):
        RemoteRewardClient("localhost:8000")
    with pytest.raises(ValueError, match="timeout_seconds must be > 0, got 0"):
        RemoteRewardClient("http://x", timeout_seconds=0)

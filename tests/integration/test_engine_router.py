"""Built-in engines as real processes behind the real sglang-router, driven by the rollout client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from engine_fixtures import (  # noqa: F401  (fixtures)
    FAST_HEALTH_CHECKS,
    engine_pair,
    engine_state,
    finished_requests,
    log_dir,
    router,
    tiny_checkpoint,
    wait_until,
)
from rlkube_runtime.serving.client import EngineAdmin, EngineHTTPError, RolloutClient
from rlkube_runtime.serving.launch import ProcessStartError, start_engine, start_engines
from rlkube_runtime.serving.router import RouterProcess

pytestmark = pytest.mark.slow


def _request(rid: str, **sampling) -> dict:
    return {"input_ids": [5, 6, 7, 8], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **sampling}}


async def test_two_engines_behind_the_router_serve_64_concurrent_requests(engine_pair, router):
    before = [await finished_requests(e.url) for e in engine_pair]
    async with RolloutClient(router.url) as client:
        results = await asyncio.gather(*(client.generate(_request(f"c{i}")) for i in range(64)))
    assert [r["meta_info"]["id"] for r in results] == [f"c{i}" for i in range(64)]
    assert all(len(r["output_ids"]) == 16 == len(r["meta_info"]["output_token_logprobs"]) for r in results)
    served = [await finished_requests(e.url) - b for e, b in zip(engine_pair, before)]
    assert sum(served) == 64 and min(served) > 0, f"per-engine requests: {served}"


async def test_the_router_forwards_generate_unchanged(engine_pair, router):
    """The answer through the router is exactly one engine's own answer to the same request."""
    body = _request("same-request", temperature=0.9)
    async with RolloutClient(router.url) as client:
        via_router = await client.generate(body)
    direct = []
    for engine in engine_pair:
        async with RolloutClient(engine.url) as client:
            direct.append((await client.generate(body))["output_ids"])
    assert direct[0] != direct[1]  # different server seeds
    assert via_router["output_ids"] in direct


async def _engine_states(engines) -> list[dict]:
    return [await engine_state(e.url) for e in engines]


async def _every_request_has_tokens(engines, requests: int, finished_before: int) -> None:
    """Wait until all `requests` reached the engines and none waits (each is running, or finished since
    `finished_before`), then until two decode steps have passed for every running one, so every one holds
    tokens: a fixed sleep is not enough when the machine is busy."""
    async def all_admitted():
        states = await _engine_states(engines)
        arrived = sum(s["num_running_reqs"] + s["num_finished_reqs"] for s in states) - finished_before
        return arrived >= requests and not any(s["num_waiting_reqs"] for s in states)
    await wait_until(all_admitted, timeout_s=60, what=f"{requests} requests admitted")
    before = await _engine_states(engines)

    async def two_steps_each():
        now = await _engine_states(engines)
        return all(n["num_generated_tokens"] - b["num_generated_tokens"] >= 2 * b["num_running_reqs"]
                   for n, b in zip(now, before))
    await wait_until(two_steps_each, timeout_s=60, what="two decode steps on every engine")


async def test_client_abort_reaches_every_engine_and_returns_partial_tokens(engine_pair, router):
    finished_before = sum(s["num_finished_reqs"] for s in await _engine_states(engine_pair))
    async with RolloutClient(router.url) as client:
        tasks = [asyncio.ensure_future(client.generate(_request(f"abort-me-{i}", max_new_tokens=3000))) for i in range(4)]
        keep = asyncio.ensure_future(client.generate(_request("keep-me", max_new_tokens=40)))
        await _every_request_has_tokens(engine_pair, requests=5, finished_before=finished_before)
        assert await client.abort("abort-me-") == 4
        results = await asyncio.gather(*tasks)
        assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
        assert all(0 < len(r["output_ids"]) < 3000 for r in results)
        assert (await keep)["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


async def test_pause_holds_requests_through_the_router_until_continue(engine_pair, router):
    admins = [EngineAdmin(e.url) for e in engine_pair]
    try:
        for admin in admins:
            await admin.pause_generation(mode="in_place")
        async with RolloutClient(router.url) as client:
            pending = asyncio.ensure_future(client.generate(_request("paused")))
            done, _ = await asyncio.wait({pending}, timeout=1.0)
            assert not done
            for admin in admins:
                await admin.continue_generation()
            assert len((await pending)["output_ids"]) == 16
    finally:
        for admin in admins:
            await admin.continue_generation()
            await admin.close()


async def test_weight_updates_change_generation_and_version_on_every_engine(engine_pair, router, tiny_checkpoint):
    greedy = _request("greedy", temperature=0.0)
    async with RolloutClient(router.url) as client:
        original = (await client.generate(greedy))["output_ids"]
        hidden = 64
        for engine in engine_pair:  # the sync sequence the train loop runs
            async with EngineAdmin(engine.url) as admin:
                await admin.pause_generation()
                assert await admin.flush_cache()
                await admin.update_weights_from_tensors({"model.norm.weight": torch.zeros(hidden)}, version="v2")
                await admin.continue_generation()
                assert await admin.get_weight_version() == "v2"
        # A zero final norm: every logit is 0, greedy emits token 0 everywhere.
        for i in range(4):
            result = await client.generate({**greedy, "rid": f"after-{i}"})
            assert result["output_ids"] == [0] * 16 and result["meta_info"]["weight_version"] == "v2"

        for engine in engine_pair:
            async with EngineAdmin(engine.url) as admin:
                await admin.update_weights_from_disk(str(tiny_checkpoint), version="v3")
                assert await admin.get_weight_version() == "v3"
        for i in range(4):
            assert (await client.generate({**greedy, "rid": f"restored-{i}"}))["output_ids"] == original

        with pytest.raises(EngineHTTPError) as error:
            async with EngineAdmin(engine_pair[0].url) as admin:
                await admin.update_weights_from_tensors({"model.missing": torch.zeros(1)})
        assert error.value.status == 400 and "model.missing" in error.value.message


async def test_router_keeps_serving_when_an_engine_dies_and_both_serve_after_restart(tiny_checkpoint, tmp_path):
    engines = start_engines(2, model_path=str(tiny_checkpoint), log_dir=str(tmp_path), seed=7, name_prefix="ft",
                            engine_args={"num-threads": 1})
    router = RouterProcess([e.url for e in engines], log_dir=str(tmp_path),
                           router_args={"policy": "round_robin", **FAST_HEALTH_CHECKS}).start()
    try:
        engines[0].kill()
        async with RolloutClient(router.url, max_attempts=10) as client:
            results = await asyncio.gather(*(client.generate(_request(f"survive-{i}")) for i in range(16)))
            assert all(len(r["output_ids"]) == 16 for r in results)

            # As the engine pool replaces an engine: out of the router, started again, back in.
            router.remove_worker(engines[0].url)
            new = await asyncio.to_thread(engines[0].restart)
            router.add_worker(new.url)
            engines[0] = new
            assert sorted(w["url"] for w in router.workers()) == sorted(e.url for e in engines)
            before = [await finished_requests(e.url) for e in engines]
            await asyncio.gather(*(client.generate(_request(f"both-{i}")) for i in range(16)))
            served = [await finished_requests(e.url) - b for e, b in zip(engines, before)]
            assert min(served) > 0, f"per-engine requests after restart: {served}"
    finally:
        router.stop()
        for engine in engines:
            engine.stop()
    for pid in [router.pid, *(e.pid for e in engines)]:
        assert not _running(pid), f"process {pid} outlived stop()"


async def test_routing_replays_requests_reach_the_engines_whole_spread_over_them_and_past_a_dead_one(tmp_path):
    """sglang-router 0.3.2 drops `return_routed_experts` from what it forwards, so routing replay's
    requests go straight to the engines the router lists (generate_on_engines): they come back with
    the routes, both engines serve, and a dead engine is passed over."""
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    moe = build_tiny_checkpoint(tmp_path / "moe", experts=8)
    engines = start_engines(2, model_path=str(moe), log_dir=str(tmp_path), seed=3, name_prefix="routes",
                            engine_args={"num-threads": 1}, return_routed_experts=True)
    router = RouterProcess([e.url for e in engines], log_dir=str(tmp_path), router_args={"policy": "round_robin"}).start()
    asks = {**_request("routes"), "return_routed_experts": True}
    try:
        async with RolloutClient(router.url, max_attempts=10) as client:
            assert "routed_experts" not in (await client.generate(asks))["meta_info"]  # the router's forward
            before = [await finished_requests(e.url) for e in engines]
            results = await asyncio.gather(*(client.generate_on_engines({**asks, "rid": f"direct-{i}"}) for i in range(16)))
            assert all("routed_experts" in r["meta_info"] for r in results)
            served = [await finished_requests(e.url) - b for e, b in zip(engines, before)]
            assert min(served) > 0 and sum(served) == 16, served
            engines[0].kill()  # still listed by the router: its failures take it out of the client's rotation
            results = await asyncio.gather(*(client.generate_on_engines({**asks, "rid": f"past-{i}"}) for i in range(8)))
            assert all(len(r["output_ids"]) == 16 and "routed_experts" in r["meta_info"] for r in results)
    finally:
        router.stop()
        for engine in engines:
            engine.stop()


def test_an_engine_that_cannot_start_fails_fast_quoting_its_log(tmp_path):
    with pytest.raises(ProcessStartError) as error:
        start_engine(model_path=str(tmp_path / "no-such-model"), log_dir=str(tmp_path), name="broken", startup_timeout_s=120)
    message = str(error.value)
    assert "exited with code" in message and "no-such-model" in message
    assert (tmp_path / "broken.log").exists()


def test_started_processes_die_with_their_parent(tmp_path):
    """SIGKILL the parent: its engine (here a stand-in `sleep`) must not be left behind."""
    script = textwrap.dedent(
        f"""
        import pathlib, sys, time
        from rlkube_runtime.serving.launch import ManagedProcess
        child = ManagedProcess(["sleep", "600"], log_path=pathlib.Path({str(tmp_path / "sleep.log")!r}))
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert _running(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        if not _running(child_pid):
            break
        import time

        time.sleep(0.05)
    assert not _running(child_pid)


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent) is not running.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False

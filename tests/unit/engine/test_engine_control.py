"""Abort, pause/continue, flush and health behave as SGLang's do, and pausing never changes tokens."""

import asyncio

import pytest

LONG = {"max_new_tokens": 3000, "ignore_eos": True}


async def _post(client, path, body=None):
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def _load(client):
    response = await client.get("/get_load")
    return (await response.json())[0]


async def _wait_for_tokens(client, at_least, timeout=20.0):
    """Until the running batch holds `at_least` KV tokens, i.e. generation is under way."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (await _load(client))["num_tokens"] < at_least:
        assert asyncio.get_running_loop().time() < deadline, "generation never started"
        await asyncio.sleep(0.01)


def _start(client, body):
    return asyncio.ensure_future(_post(client, "/generate", body))


async def _still_pending(task, seconds=0.3):
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return not done


async def test_abort_by_rid_prefix_returns_partial_tokens_and_spares_others(client):
    target = _start(client, {"text": "abc", "rid": "job-1-sample-0", "return_logprob": True, "sampling_params": LONG})
    other = _start(client, {"text": "abc", "rid": "job-2-sample-0", "sampling_params": LONG})
    await _wait_for_tokens(client, 40)

    assert (await _post(client, "/abort_request", {"rid": "job-1"}))["num_aborted"] == 1
    result = await target
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"]
    assert 0 < len(result["output_ids"]) < 3000
    assert meta["completion_tokens"] == len(result["output_ids"]) == len(meta["output_token_logprobs"])
    assert await _still_pending(other, 0.1)

    await _post(client, "/abort_request", {"abort_all": True})
    assert (await other)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await _load(client))["num_reqs"] == 0


async def test_abort_of_a_waiting_request_returns_no_tokens(start_engine):
    client = await start_engine(max_running_requests=1)
    running = _start(client, {"text": "a", "rid": "running", "sampling_params": LONG})
    await _wait_for_tokens(client, 5)
    waiting = _start(client, {"text": "b", "rid": "waiting", "sampling_params": LONG})
    await asyncio.sleep(0.05)
    assert (await _load(client))["num_waiting_reqs"] == 1

    await _post(client, "/abort_request", {"rid": "waiting"})
    result = await waiting
    assert result["output_ids"] == [] and result["meta_info"]["finish_reason"]["type"] == "abort"
    assert await _still_pending(running, 0.1)
    await _post(client, "/abort_request", {"abort_all": True})
    await running


async def _paused_run_matches_uninterrupted(start_engine, mode):
    reference = await start_engine(seed=3)
    body = {"text": "pause me", "rid": "p", "return_logprob": True, "sampling_params": {"max_new_tokens": 80, "ignore_eos": True}}
    expected = await _post(reference, "/generate", body)

    client = await start_engine(seed=3)
    task = _start(client, body)
    await _wait_for_tokens(client, 20)
    await _post(client, "/pause_generation", {"mode": mode})
    held = await _load(client)
    late = _start(client, {"text": "late", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert await _still_pending(task) and await _still_pending(late, 0.05)
    assert (await _load(client))["num_tokens"] == held["num_tokens"], "tokens were generated while paused"

    await _post(client, "/continue_generation")
    result, late_result = await task, await late
    assert result["output_ids"] == expected["output_ids"]
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 80}
    assert len(late_result["output_ids"]) == 3
    return held


@pytest.mark.slow
async def test_pause_in_place_holds_everything_and_continues_with_the_same_tokens(start_engine):
    held = await _paused_run_matches_uninterrupted(start_engine, "in_place")
    assert held["num_reqs"] == 1 and held["num_tokens"] >= 20  # the cache stays


@pytest.mark.slow
async def test_pause_retract_drops_the_cache_and_recomputes_the_same_tokens(start_engine):
    held = await _paused_run_matches_uninterrupted(start_engine, "retract")
    assert held["num_waiting_reqs"] == 1 and held["num_tokens"] == 0


async def test_pause_abort_ends_running_requests_and_holds_new_ones(client):
    task = _start(client, {"text": "x", "sampling_params": LONG})
    await _wait_for_tokens(client, 10)
    assert (await _post(client, "/pause_generation", {"mode": "abort"}))["status"] == "ok"
    assert (await task)["meta_info"]["finish_reason"]["type"] == "abort"

    late = _start(client, {"text": "y", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert await _still_pending(late)
    await _post(client, "/continue_generation")
    assert len((await late)["output_ids"]) == 2


async def test_health_generate_answers_when_idle_saturated_and_paused(start_engine):
    client = await start_engine(max_running_requests=1)
    assert (await client.get("/health_generate")).status == 200
    # The only slot is taken, so the probe cannot run; progress on other work counts as health.
    task = _start(client, {"text": "x", "sampling_params": LONG})
    await _wait_for_tokens(client, 5)
    started = asyncio.get_running_loop().time()
    assert (await client.get("/health_generate")).status == 200
    assert asyncio.get_running_loop().time() - started < 5
    for _ in range(200):  # the abandoned probe leaves the queue at the next step boundary
        if (await _load(client))["num_waiting_reqs"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await _load(client))["num_waiting_reqs"] == 0
    await _post(client, "/pause_generation", {"mode": "in_place"})
    assert (await client.get("/health_generate")).status == 200
    await _post(client, "/abort_request", {"abort_all": True})
    await task


async def test_flush_cache_is_refused_while_requests_run(client):
    assert (await client.post("/flush_cache")).status == 200
    task = _start(client, {"text": "x", "sampling_params": LONG})
    await _wait_for_tokens(client, 5)
    assert (await client.post("/flush_cache")).status == 400
    await _post(client, "/abort_request", {"abort_all": True})
    await task
    assert (await client.get("/flush_cache")).status == 200


async def test_load_endpoints_report_running_requests(client):
    task = _start(client, {"text": "abcd", "sampling_params": LONG})
    await _wait_for_tokens(client, 10)
    load = await _load(client)
    assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0 and load["num_tokens"] >= 10
    loads = await (await client.get("/v1/loads")).json()
    assert loads["loads"][0]["num_running_reqs"] == 1 and loads["loads"][0]["num_used_tokens"] >= 10
    await _post(client, "/abort_request", {"abort_all": True})
    await task


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
async def test_model_info_names_the_model_path(client, tiny_model_dir, path):
    info = await (await client.get(path)).json()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
async def test_server_info_describes_the_engine(client, path):
    info = await (await client.get(path)).json()
    assert info["engine"] == "rlkube-builtin" and info["max_running_requests"] == 64 and info["weight_version"] == "default"

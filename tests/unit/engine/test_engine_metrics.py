"""The built-in engine's /metrics: SGLang's series names, with the counts its scheduler keeps."""

import asyncio
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from rlkube_runtime.engine.metrics import SGLANG_SERIES, metrics_text


def samples(text: str) -> dict[str, float]:
    """{sample name: value} of an exposition (one model, so one sample per name)."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_scheduler_counts_come_out_under_sglangs_names():
    scheduler = SimpleNamespace(load=lambda: {"running": 3, "waiting": 2, "kv_tokens": 41},
                                generated_tokens=120, prefill_tokens=57, finished_requests=9)
    text = metrics_text(scheduler, "/models/tiny").decode()
    assert samples(text) == {
        "sglang:num_running_reqs": 3, "sglang:num_queue_reqs": 2, "sglang:num_used_tokens": 41,
        "sglang:generation_tokens_total": 120, "sglang:prompt_tokens_total": 57, "sglang:num_requests_total": 9,
    }
    assert set(samples(text)) == set(SGLANG_SERIES)
    assert 'model_name="/models/tiny"' in text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["sglang:generation_tokens"] == types["sglang:num_requests"] == "counter"  # for rate()


async def test_a_generation_moves_the_counters_by_what_it_answered(client):
    before = samples(await (await client.get("/metrics")).text())
    assert before["sglang:generation_tokens_total"] == before["sglang:num_requests_total"] == 0
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    answers = await (await client.post("/generate", json=body)).json()
    after = samples(await (await client.get("/metrics")).text())
    assert after["sglang:generation_tokens_total"] == sum(a["meta_info"]["completion_tokens"] for a in answers)
    assert after["sglang:prompt_tokens_total"] == 3 + 2  # no retraction: each prompt prefilled once
    assert after["sglang:num_requests_total"] == 2
    # The answers go out just before the scheduler drops their rows from the batch: the gauges follow.
    for _ in range(100):
        idle = samples(await (await client.get("/metrics")).text())
        if idle["sglang:num_running_reqs"] == 0:
            break
        await asyncio.sleep(0.05)
    assert idle["sglang:num_running_reqs"] == idle["sglang:num_queue_reqs"] == idle["sglang:num_used_tokens"] == 0


"""The static-cache runner computes what transformers' own forward computes: same greedy tokens
and logprobs as the generic runner while requests join, leave (rows move up) and are retracted;
the KV budget bounds what is admitted; sampling follows the distribution it reports."""

import asyncio

import pytest
import torch

from rlkube_runtime.engine.protocol import SamplingParams
from rlkube_runtime.engine.sampling import SamplingRows, sample_tokens
from rlkube_runtime.engine.slot_runner import SlotRunner, _batch_bucket, _round_slots, unsupported_reason

from engine_testutil import engine_of, record_batch_sizes


async def _generate(client, body, status=200):
    response = await client.post("/generate", json=body)
    assert response.status == status, await response.text()
    return await response.json()


def _bodies():
    # Different prompt lengths and budgets: rows finish at different steps, so the ones behind
    # move up, and a late joiner is prefilled while others decode.
    lengths = [3, 17, 9, 30, 1, 12, 25, 6]
    return [
        {"text": "ab" * (i + 1), "rid": f"q{i}", "return_logprob": True,
         "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8}}
        for i, n in enumerate(lengths)
    ]


async def test_slot_and_generic_runners_agree_token_for_token(start_engine):
    slot, generic = await start_engine(runner="slot"), await start_engine(runner="hf")
    assert type(engine_of(slot).runner).__name__ == "SlotRunner"
    assert type(engine_of(generic).runner).__name__ == "HFRunner"

    async def run(client):
        first = asyncio.gather(*(_generate(client, b) for b in _bodies()[:5]))
        await asyncio.sleep(0.01)
        late = asyncio.gather(*(_generate(client, b) for b in _bodies()[5:]))
        return [*(await first), *(await late)]

    a, b = await run(slot), await run(generic)
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        lx = torch.tensor([lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]])
        ly = torch.tensor([lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]])
        assert (lx - ly).abs().max() < 1e-4


async def test_retracted_requests_resume_with_the_same_tokens(start_engine):
    client = await start_engine(runner="slot")
    body = {"text": "retract me", "rid": "rr", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    alone = await _generate(client, body)

    engine = engine_of(client)
    task = asyncio.ensure_future(_generate(client, body))
    while engine.scheduler.generated_tokens < alone["meta_info"]["completion_tokens"] + 10:
        await asyncio.sleep(0.001)
    await client.post("/pause_generation", json={"mode": "retract"})
    assert engine.runner.rows == 0 and len(engine.scheduler._waiting) == 1  # back in the queue, its row given up
    await client.post("/continue_generation", json={})
    assert (await task)["output_ids"] == alone["output_ids"]


async def test_kv_budget_limits_admission_and_refuses_a_request_that_cannot_fit(start_engine):
    client = await start_engine(runner="slot", max_total_tokens=600)
    sizes = record_batch_sizes(client)
    # Each needs ~2 + 200 slots, rounded up to 256: two rows fit in 600 slots, never three.
    bodies = [{"text": "x", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}} for _ in range(4)]
    results = await asyncio.gather(*(_generate(client, b) for b in bodies))
    assert all(len(r["output_ids"]) == 200 for r in results)
    assert max(sizes) == 2

    too_long = await _generate(client, {"text": "x", "sampling_params": {"max_new_tokens": 1000}}, status=400)
    assert too_long["param"] == "sampling_params.max_new_tokens" and "KV" in too_long["message"]


def test_inverse_cdf_sampling_follows_the_reported_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    probs = torch.softmax(logits / 0.7, -1)[0]
    params = [SamplingParams(temperature=0.7)] * 20000
    uniforms = torch.rand(20000).tolist()
    rows = SamplingRows.build(params, uniforms, vocab_size=12, device=torch.device("cpu"))
    tokens, logprobs = sample_tokens(logits.expand(20000, -1), rows)
    frequency = torch.bincount(tokens, minlength=12).double() / 20000
    # 20000 draws: a standard error of at most sqrt(.25/20000) = 0.0035 per token.
    assert (frequency - probs.double()).abs().max() < 0.015
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-5)


def test_mixed_rows_sample_as_they_would_alone():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0), SamplingParams(top_k=5), SamplingParams(temperature=0.0)]
    uniforms = [0.3, 0.6, 0.0]
    together = sample_tokens(logits, SamplingRows.build(params, uniforms, vocab_size=50, device=torch.device("cpu")))
    for i in range(3):
        alone = sample_tokens(logits[i : i + 1], SamplingRows.build(params[i : i + 1], uniforms[i : i + 1], vocab_size=50, device=torch.device("cpu")))
        assert together[0][i] == alone[0][0] and torch.isclose(together[1][i], alone[1][0])
    assert together[0][2] == logits[2].argmax()


def test_only_llama_family_models_with_full_attention_take_the_slot_runner(tiny_model_dir):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    assert unsupported_reason(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert "gpt2" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="gpt2"):
        SlotRunner(gpt2, max_rows=4, kv_budget_bytes=2**20)


def test_buckets_bound_the_number_of_captured_shapes():
    assert [_round_slots(n) for n in (1, 256, 257, 1024, 1025, 3000)] == [256, 256, 512, 1024, 2048, 4096]
    assert [_batch_bucket(b, 256) for b in (1, 3, 5, 9, 16, 17, 250, 256)] == [1, 4, 8, 16, 16, 32, 256, 256]
    assert _batch_bucket(20, 24) == 24


def test_torch_compile_is_sglangs_flag_and_a_gpu_only_switch(tiny_model_dir):
    from rlkube_runtime.engine.__main__ import parse_args
    from transformers import AutoModelForCausalLM

    assert parse_args(["--model-path", str(tiny_model_dir), "--enable-torch-compile"]).torch_compile is True
    assert parse_args(["--model-path", str(tiny_model_dir)]).torch_compile is False
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    runner = SlotRunner(model, max_rows=4, kv_budget_bytes=2**26, compile_kernels=True)
    assert runner.compiled is False  # on a CPU the step stays eager: nothing to capture, compile time only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_decode_on_a_gpu_gives_the_eager_tokens_and_logprobs(tiny_model_dir):
    from rlkube_runtime.engine.engine import Engine, EngineConfig

    def generate(compiled: bool):
        eng = Engine.load(EngineConfig(model_path=str(tiny_model_dir), device="cuda", dtype="float32",
                                       max_running_requests=8, runner="slot", torch_compile=compiled))
        eng.start()
        try:
            bodies = [{"input_ids": [3 + i, 5, 7], "rid": f"c{i}", "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "sampling_seed": i}}
                      for i in range(6)]
            async def run():
                return await asyncio.gather(*(eng.generate(b) for b in bodies))
            return asyncio.run(run())
        finally:
            eng.stop()

    eager, compiled = generate(False), generate(True)
    for a, b in zip(eager, compiled):
        assert a["output_ids"] == b["output_ids"]
        got = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(got, want)) < 1e-4

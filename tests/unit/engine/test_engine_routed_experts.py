"""`--enable-return-routed-experts`: the built-in engine reports every token's experts as SGLang
does (meta_info.routed_experts, base64 int32 [prompt + output - 1, layers, top_k]), and they are
the experts transformers' own model picks when it runs the whole sequence at once."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.routed_experts import decode_routes
from rlkube_runtime.tiny.model import build_tiny_checkpoint

from engine_testutil import engine_of

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"), experts=8, seed=3)


def whole_sequence_routes(model_dir, tokens: list[int]) -> torch.Tensor:
    """[len - 1, layers, top_k]: the experts of one uncached forward over the tokens but the last."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    picked = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: picked.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([tokens[:-1]]))
    for hook in hooks:
        hook.remove()
    return torch.stack([picked[i] for i in range(len(picked))], dim=1).long()


async def test_every_token_but_the_last_is_reported_with_the_experts_the_model_routes_it_to(start_engine, moe_dir):
    client = await start_engine(model_path=str(moe_dir), return_routed_experts=True, max_running_requests=8)
    # Prompts of different lengths, sent together: left-padded prefills and shared decode steps.
    prompts = [[5, 9, 14], [7] * 11, [20, 21, 22, 23, 24, 25]]
    bodies = [{"input_ids": p, "return_routed_experts": True, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 7 + i, "ignore_eos": True}} for i, p in enumerate(prompts)]
    replies = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    for prompt, reply in zip(prompts, replies):
        assert reply.status == 200, await reply.text()
        out = await reply.json()
        tokens = prompt + out["output_ids"]
        routes = decode_routes(out["meta_info"]["routed_experts"], num_layers=LAYERS, top_k=TOP_K, what="reply")
        want = whole_sequence_routes(moe_dir, tokens)
        assert torch.equal(routes.sort(-1).values, want.sort(-1).values)
    plain = await client.post("/generate", json={"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in (await plain.json())["meta_info"]  # only for requests that ask


async def test_a_retracted_request_reports_the_routes_of_its_whole_sequence(start_engine, moe_dir):
    client = await start_engine(model_path=str(moe_dir), return_routed_experts=True)
    body = {"input_ids": [3, 4, 5, 6], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    task = asyncio.ensure_future(client.post("/generate", json=body))
    engine = engine_of(client)
    while engine.scheduler.generated_tokens < 5:
        await asyncio.sleep(0.001)
    assert (await client.post("/pause_generation", json={"mode": "retract"})).status == 200
    assert (await client.post("/continue_generation", json={})).status == 200
    out = await (await task).json()
    tokens = body["input_ids"] + out["output_ids"]
    routes = decode_routes(out["meta_info"]["routed_experts"], num_layers=LAYERS, top_k=TOP_K, what="reply")
    assert engine.scheduler.prefill_tokens > len(body["input_ids"]) + 1  # it was prefilled again
    assert torch.equal(routes.sort(-1).values, whole_sequence_routes(moe_dir, tokens).sort(-1).values)


async def test_routes_are_refused_by_name_where_the_engine_cannot_give_them(start_engine, moe_dir, tiny_model_dir):
    client = await start_engine(model_path=str(moe_dir))
    reply = await client.post("/generate", json={"input_ids": [1, 2], "return_routed_experts": True})
    assert reply.status == 400
    assert "return_routed_experts" in (text := await reply.text()) and "--enable-return-routed-experts" in text
    with pytest.raises(ValueError, match="--enable-return-routed-experts: the model .*'llama'"):
        Engine.load(EngineConfig(model_path=str(tiny_model_dir), return_routed_experts=True))
    with pytest.raises(ValueError, match="--enable-return-routed-experts .*runner 'hf' or 'auto'"):
        Engine.load(EngineConfig(model_path=str(moe_dir), return_routed_experts=True, runner="slot"))


async def test_a_request_aborted_before_it_ran_answers_with_no_routes(start_engine, moe_dir):
    client = await start_engine(model_path=str(moe_dir), return_routed_experts=True, max_running_requests=1)
    body = {"input_ids": [3, 4, 5], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    first = asyncio.ensure_future(client.post("/generate", json={**body, "rid": "first"}))
    engine = engine_of(client)
    while engine.scheduler.generated_tokens < 3:
        await asyncio.sleep(0.001)
    second = asyncio.ensure_future(client.post("/generate", json={**body, "rid": "second"}))
    while engine.scheduler.load()["waiting"] < 1:  # queued behind the first, never admitted
        await asyncio.sleep(0.001)
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 200
    ran, queued = await (await first).json(), await (await second).json()
    assert queued["output_ids"] == [] and queued["meta_info"]["routed_experts"] == ""
    tokens = body["input_ids"] + ran["output_ids"]
    assert decode_routes(ran["meta_info"]["routed_experts"], num_layers=LAYERS, top_k=TOP_K, what="reply").shape[0] == len(tokens) - 1

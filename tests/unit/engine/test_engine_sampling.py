"""Seeded sampling: tokens depend on (server seed, weights, request), never on batch neighbours;
logprobs are the temperature-scaled ones the trainer recomputes."""

import asyncio
import math

import torch
from transformers import AutoModelForCausalLM

from rlkube_runtime.engine.protocol import SamplingParams
from rlkube_runtime.engine.sampling import SamplingRows, sample_tokens, uniform_stream


def _sample(logits, params, rid):
    """One token of `logits` [1, vocab] for a request `rid` sampling with `params`."""
    uniforms = uniform_stream(0, params, rid, 0, 1)
    rows = SamplingRows.build([params], [0.0 if uniforms is None else uniforms[0]], vocab_size=logits.shape[-1], device=logits.device)
    tokens, logprobs = sample_tokens(logits, rows)
    return tokens.tolist(), logprobs.tolist()


def _body(text, rid, **sampling):
    return {"text": text, "rid": rid, "return_logprob": True, "sampling_params": {"max_new_tokens": 12, **sampling}}


async def _generate(client, body):
    response = await client.post("/generate", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_same_seed_and_rid_give_same_tokens_alone_or_in_a_crowd(start_engine):
    first, second = await start_engine(seed=7), await start_engine(seed=7)
    alone = await _generate(first, _body("The quick brown fox", "probe", temperature=0.9))

    crowd = [_body(f"neighbour {i} " * (i + 1), f"n{i}", temperature=1.3, top_k=20) for i in range(7)]
    results = await asyncio.gather(*(_generate(second, b) for b in [*crowd[:3], _body("The quick brown fox", "probe", temperature=0.9), *crowd[3:]]))
    in_crowd = results[3]

    assert in_crowd["output_ids"] == alone["output_ids"]
    lp_alone = [lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]
    lp_crowd = [lp for lp, _, _ in in_crowd["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp_alone, lp_crowd)) < 1e-5


async def test_rid_server_seed_and_sampling_seed_each_change_the_stream(start_engine):
    seven, eight = await start_engine(seed=7), await start_engine(seed=8)
    base = (await _generate(seven, _body("abc", "r1")))["output_ids"]
    assert (await _generate(seven, _body("abc", "r2")))["output_ids"] != base
    assert (await _generate(eight, _body("abc", "r1")))["output_ids"] != base
    # sampling_seed replaces the rid as the stream's key.
    a = await _generate(seven, _body("abc", "x", sampling_seed=5))
    b = await _generate(seven, _body("abc", "y", sampling_seed=5))
    assert a["output_ids"] == b["output_ids"]


async def test_n_samples_of_one_prompt_differ_even_with_one_sampling_seed(client):
    results = await _generate(client, {"text": "abc", "sampling_params": {"n": 3, "max_new_tokens": 10, "sampling_seed": 1}})
    assert len(results) == 3
    assert len({tuple(r["output_ids"]) for r in results}) == 3


async def test_logprobs_match_a_full_forward_recomputation(client, tiny_model_dir):
    """Concurrent prompts of different lengths (so padding, joins and leaves all happen)."""
    cases = [("a", 1.0, 17), ("hello there, model", 0.7, 9), ("xyz" * 7, 1.5, 23), ("greedy one", 0.0, 14)]
    bodies = [
        {"text": text, "rid": f"lp{i}", "return_logprob": True, "sampling_params": {"temperature": t, "max_new_tokens": n, "ignore_eos": True}}
        for i, (text, t, n) in enumerate(cases)
    ]
    results = await asyncio.gather(*(_generate(client, b) for b in bodies))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    diffs = []
    for (text, temperature, n), result in zip(cases, results):
        prompt = tokenizer.encode(text)
        output = result["output_ids"]
        assert len(output) == n and result["meta_info"]["prompt_tokens"] == len(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
        scaled = logits / (temperature if temperature > 0 else 1.0)
        expected = torch.log_softmax(scaled, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)
        returned = torch.tensor([lp for lp, tok, _ in result["meta_info"]["output_token_logprobs"]])
        assert [tok for _, tok, _ in result["meta_info"]["output_token_logprobs"]] == output
        diffs.append((expected - returned).abs())
        if temperature == 0:
            assert output == logits.argmax(-1).tolist()
    assert torch.cat(diffs).max() < 1e-4


def test_top_k_and_top_p_restrict_the_choice_but_not_the_reported_logprob():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    top_k = SamplingParams(top_k=2)
    seen = set()
    for i in range(200):
        tokens, logprobs = _sample(logits, top_k, f"r{i}")
        seen.add(tokens[0])
        assert math.isclose(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]].item(), rel_tol=1e-6)
    assert seen == {0, 1}

    # Token 0 holds ~64% of the mass, so top_p=0.5 leaves only it.
    top_p = SamplingParams(top_p=0.5, temperature=1.0)
    assert {_sample(logits, top_p, f"r{i}")[0][0] for i in range(50)} == {0}


def test_temperature_scales_the_reported_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5)
    tokens, logprobs = _sample(logits, params, "r")
    assert math.isclose(logprobs[0], torch.log_softmax(logits[0] / 0.5, -1)[tokens[0]].item(), rel_tol=1e-6)

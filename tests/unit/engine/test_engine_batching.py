"""Concurrent requests share forward passes, the batch never exceeds its cap, greedy decoding
matches transformers' own `generate`, and stop rules end sequences as SGLang's do."""

import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkube_runtime.engine.kv_batch import KVBatch, new_cache
from rlkube_runtime.engine.weights import encode_named_tensors

from engine_testutil import engine_of, record_batch_sizes


async def _generate(client, body):
    response = await client.post("/generate", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_concurrent_requests_share_decode_forwards(client):
    sizes = record_batch_sizes(client)
    bodies = [{"text": "x" * (i + 1), "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}} for i in range(8)]
    results = await asyncio.gather(*(_generate(client, b) for b in bodies))
    assert all(len(r["output_ids"]) == 24 for r in results)
    assert len(sizes) < 8 * 24 / 2, f"{len(sizes)} forwards for 8 requests of 24 tokens: they were not batched"
    assert max(sizes) >= 4


async def test_batch_never_exceeds_max_running_requests(start_engine):
    client = await start_engine(max_running_requests=3)
    sizes = record_batch_sizes(client)
    bodies = [{"text": f"r{i}", "sampling_params": {"max_new_tokens": 6 + i, "ignore_eos": True}} for i in range(8)]
    results = await asyncio.gather(*(_generate(client, b) for b in bodies))
    assert [len(r["output_ids"]) for r in results] == [6 + i for i in range(8)]
    assert max(sizes) == 3


async def test_greedy_decoding_matches_transformers_generate(client, tiny_model_dir):
    prompts = ["a", "The cat sat", "0123456789" * 3, "Hi!"]
    bodies = [{"text": p, "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}} for p in prompts]
    results = await asyncio.gather(*(_generate(client, b) for b in bodies))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16, min_new_tokens=16)
        assert result["output_ids"] == expected[0, ids.shape[1]:].tolist()


async def test_stop_token_stop_string_and_zero_budget(client):
    tokenizer = engine_of(client).tokenizer
    # The same rid replays the same random stream, so each run below shares the free run's prefix.
    sampled = {"max_new_tokens": 20, "ignore_eos": True}
    free = await _generate(client, {"text": "stop", "rid": "s", "sampling_params": sampled})
    ids, text = free["output_ids"], free["text"]
    assert text == tokenizer.decode(ids, skip_special_tokens=True)

    by_token = await _generate(client, {"text": "stop", "rid": "s", "sampling_params": {**sampled, "stop_token_ids": [ids[5]]}})
    first = ids.index(ids[5])
    assert by_token["output_ids"] == ids[: first + 1]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[5]}
    assert by_token["text"] == tokenizer.decode(ids[:first], skip_special_tokens=True)

    stop = tokenizer.decode(ids[7:9])
    by_string = await _generate(client, {"text": "stop", "rid": "s", "sampling_params": {**sampled, "stop": [stop]}})
    completes_at = next(k for k in range(1, 21) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_string["output_ids"] == ids[:completes_at]
    assert by_string["text"] == text[: text.index(stop)]
    kept = await _generate(client, {"text": "stop", "rid": "s", "sampling_params": {**sampled, "stop": stop, "no_stop_trim": True}})
    assert kept["text"] == text[: text.index(stop) + len(stop)]

    empty = await _generate(client, {"text": "stop", "sampling_params": {"max_new_tokens": 0}})
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_eos_ends_a_sequence_unless_ignored(client):
    """Weights that make EOS every step's greedy choice: the constant embedding survives to the
    last hidden state (attention and MLP outputs zeroed) and only EOS's head row points along it."""
    engine = engine_of(client)
    eos = engine.tokenizer.eos_token_id
    state = engine.model.state_dict()
    update = {name: torch.zeros_like(t) for name, t in state.items() if name.endswith(("o_proj.weight", "down_proj.weight"))}
    update["model.embed_tokens.weight"] = torch.ones_like(state["model.embed_tokens.weight"])
    head = torch.zeros_like(state["lm_head.weight"])
    head[eos] = 1.0
    update["lm_head.weight"] = head
    response = await client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [encode_named_tensors(update)], "load_format": "rlkube_safetensors"})
    assert response.status == 200, await response.text()

    greedy = {"max_new_tokens": 30, "temperature": 0.0}
    stopped = await _generate(client, {"text": "e", "sampling_params": greedy})
    assert stopped["output_ids"] == [eos]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    ignored = await _generate(client, {"text": "e", "sampling_params": {**greedy, "ignore_eos": True}})
    assert ignored["output_ids"] == [eos] * 30
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 30}


def test_kv_batch_join_pads_left_and_select_trims_unused_slots():
    def batch(lengths, fill):
        slots = max(lengths)
        mask = torch.zeros(len(lengths), slots, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, slots - n :] = 1
        k = torch.full((len(lengths), 1, slots, 2), float(fill)) * mask[:, None, :, None]
        cache = new_cache()
        cache.update(k, k.clone(), 0)
        return KVBatch(cache=cache, attention_mask=mask)

    joined = batch([2, 3], 1.0).join(batch([5], 2.0))
    assert joined.slots == 5 and joined.batch_size == 3
    assert joined.attention_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert joined.layer_tensors()[0][0][:, 0, :, 0].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [2, 2, 2, 2, 2]]

    kept = joined.select([1, 0])
    assert kept.slots == 3 and kept.attention_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert kept.num_tokens() == 5


def test_growable_layer_appends_in_place_past_its_first_capacity():
    cache = new_cache()
    first = torch.randn(2, 1, 3, 4)
    cache.update(first, first.clone(), 0)
    steps = [torch.randn(2, 1, 1, 4) for _ in range(200)]  # well past the initial headroom
    for step in steps:
        keys, values = cache.update(step, step.clone(), 0)
    expected = torch.cat([first, *steps], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, expected)
    assert cache.get_seq_length() == 203

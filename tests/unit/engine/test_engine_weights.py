"""Weight updates (from tensors and from disk) change what the engine generates, report the new
version, and reject bad input without touching the model; memory release really frees weights
and KV and resumes to the same tokens."""

import asyncio
import math

import torch
from safetensors.torch import load_file

from rlkube_runtime.engine.weights import decode_named_tensors, encode_named_tensors

from engine_testutil import engine_of

GREEDY = {"text": "weights!", "rid": "w", "return_logprob": True,
          "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}}


async def _post(client, path, body=None, status=200):
    response = await client.post(path, json=body)
    assert response.status == status, await response.text()
    return await response.json()


def _tensor_update(tensors, version):
    return {"serialized_named_tensors": [encode_named_tensors(tensors)], "load_format": "rlkube_safetensors",
            "flush_cache": True, "weight_version": version}


def test_encoding_round_trips_names_dtypes_and_values():
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.ones(2, dtype=torch.bfloat16)}
    decoded, offsets = decode_named_tensors(encode_named_tensors(tensors))
    assert decoded.keys() == tensors.keys() and offsets == {}
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor)


async def test_subset_update_from_tensor_makes_the_model_emit_a_known_token(client):
    before = await _post(client, "/generate", GREEDY)
    vocab = engine_of(client).vocab_size
    hidden = engine_of(client).model.config.hidden_size
    # A zero final norm makes every logit 0: greedy picks token 0 with logprob -log(vocab).
    reply = await _post(client, "/update_weights_from_tensor", _tensor_update({"model.norm.weight": torch.zeros(hidden)}, "v1"))
    assert reply["success"] is True

    after = await _post(client, "/generate", GREEDY)
    assert before["output_ids"] != after["output_ids"] == [0] * 12
    assert all(math.isclose(lp, -math.log(vocab), rel_tol=1e-5) for lp, _, _ in after["meta_info"]["output_token_logprobs"])
    assert after["meta_info"]["weight_version"] == "v1"
    assert await (await client.get("/get_weight_version")).json() == {"weight_version": "v1"}


SAMPLED = {"text": "weights!", "rid": "s", "return_logprob": True, "sampling_params": {"max_new_tokens": 16}}


def _same_generation(a, b):
    """Same tokens and (to float tolerance) the same logprobs."""
    lp_a = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
    lp_b = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
    return a["output_ids"] == b["output_ids"] and max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-5


async def test_full_update_from_tensor_generates_like_an_engine_started_on_those_weights(start_engine, other_model_dir):
    client, reference = await start_engine(), await start_engine(model_path=str(other_model_dir))
    expected = await _post(reference, "/generate", SAMPLED)
    assert not _same_generation(await _post(client, "/generate", SAMPLED), expected)

    await _post(client, "/update_weights_from_tensor", _tensor_update(load_file(other_model_dir / "model.safetensors"), "step-2"))
    assert _same_generation(await _post(client, "/generate", SAMPLED), expected)


async def test_update_from_disk_generates_like_the_checkpoint_and_reports_path_and_version(start_engine, other_model_dir):
    client, reference = await start_engine(), await start_engine(model_path=str(other_model_dir))
    expected = await _post(reference, "/generate", SAMPLED)
    assert not _same_generation(await _post(client, "/generate", SAMPLED), expected)
    reply = await _post(client, "/update_weights_from_disk", {"model_path": str(other_model_dir), "weight_version": "disk-1"})
    assert reply["success"] is True

    after = await _post(client, "/generate", SAMPLED)
    assert _same_generation(after, expected)
    assert after["meta_info"]["weight_version"] == "disk-1"
    assert (await (await client.get("/model_info")).json())["model_path"] == str(other_model_dir)


async def test_bad_tensor_updates_are_400_and_leave_the_model_unchanged(client):
    before = await _post(client, "/generate", GREEDY)
    hidden = engine_of(client).model.config.hidden_size
    unknown = _tensor_update({"model.norm.weight": torch.zeros(hidden), "model.nope.weight": torch.zeros(2)}, "bad")
    error = await _post(client, "/update_weights_from_tensor", unknown, status=400)
    assert "model.nope.weight" in error["message"] and error["param"] == "serialized_named_tensors"
    wrong_shape = _tensor_update({"model.norm.weight": torch.zeros(hidden + 1)}, "bad")
    assert "shape" in (await _post(client, "/update_weights_from_tensor", wrong_shape, status=400))["message"]

    assert (await _post(client, "/generate", GREEDY))["output_ids"] == before["output_ids"]
    assert (await (await client.get("/get_weight_version")).json())["weight_version"] == "default"


async def test_released_weights_are_freed_hold_generation_and_come_back_intact(client):
    before = await _post(client, "/generate", GREEDY)
    model = engine_of(client).model
    params_before = sum(p.numel() for p in model.parameters())

    reply = await _post(client, "/release_memory_occupation", {"tags": ["weights"]})
    assert reply["released_tags"] == ["weights"]
    assert sum(p.numel() for p in model.parameters()) == 0
    hidden = model.config.hidden_size
    update = _tensor_update({"model.norm.weight": torch.zeros(hidden)}, "x")
    assert "resume" in (await _post(client, "/update_weights_from_tensor", update, status=400))["message"]
    pending = asyncio.ensure_future(_post(client, "/generate", GREEDY))
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done, "generated while the weights were released"
    assert (await client.get("/health_generate")).status == 200

    await _post(client, "/resume_memory_occupation", {"tags": ["weights"]})
    assert sum(p.numel() for p in model.parameters()) == params_before
    assert (await pending)["output_ids"] == before["output_ids"]


async def test_released_kv_cache_retracts_running_requests_which_finish_identically(start_engine):
    body = {"text": "kv", "rid": "k", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    expected = await _post(await start_engine(), "/generate", body)
    client = await start_engine()
    task = asyncio.ensure_future(_post(client, "/generate", body))
    while (await (await client.get("/get_load")).json())[0]["num_tokens"] < 10:
        await asyncio.sleep(0.01)

    await _post(client, "/release_memory_occupation", {"tags": ["kv_cache"]})
    load = (await (await client.get("/get_load")).json())[0]
    assert load["num_tokens"] == 0 and load["num_waiting_reqs"] == 1
    await _post(client, "/resume_memory_occupation")  # no tags: everything
    assert (await task)["output_ids"] == expected["output_ids"]

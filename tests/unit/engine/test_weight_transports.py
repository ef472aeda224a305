"""Every weight-sync transport, driven by the trainer-side sender against a real engine over
HTTP: with buckets far smaller than the model (and rows split over requests), the engine ends up
generating exactly what an engine loaded with those weights from disk generates."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkube_runtime.weight_sync import WeightSender
from rlkube_runtime.memory import unique_named_tensors

from engine_testutil import engine_of

PROBES = [
    {"text": "sync me", "rid": "g", "return_logprob": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}},
    {"text": "and me", "rid": "s", "return_logprob": True, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}},
]


async def _outputs(client):
    results = []
    for body in PROBES:
        response = await client.post("/generate", json=body)
        assert response.status == 200, await response.text()
        results.append(await response.json())
    return results


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        lx = [lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]]
        ly = [lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-5


@pytest.mark.parametrize("transport", ["tensor", "distributed", "http"])
async def test_a_bucketed_push_makes_the_engine_generate_as_the_pushed_weights_do(start_engine, other_model_dir, transport):
    engine = await start_engine()
    reference = await start_engine(model_path=str(other_model_dir))
    before, expected = await _outputs(engine), await _outputs(reference)
    assert before[1]["output_ids"] != expected[1]["output_ids"]

    trainer_model = AutoModelForCausalLM.from_pretrained(other_model_dir)  # float32, as the engine
    total = sum(t.numel() * 4 for _, t in unique_named_tensors(trainer_model))
    bucket = 3000  # bytes: far below the largest tensor, so many buckets (and row blocks over HTTP)
    sender = WeightSender(trainer_model, dtype=torch.float32, bucket_bytes=bucket, device=torch.device("cpu"))
    url = str(engine.make_url("")).rstrip("/")
    try:
        report = await asyncio.to_thread(sender.push, [url], transport=transport, version="v7")
    finally:
        sender.close()
    assert report.failed == {}
    assert report.bytes_per_engine == total
    # Over HTTP no request exceeds the bucket (rows split); the others send a big tensor alone.
    assert report.requests_per_engine >= (-(-total // bucket) if transport == "http" else 10)
    assert engine_of(engine).weight_version == "v7"
    _assert_same(await _outputs(engine), expected)


async def test_a_failing_engine_is_reported_and_the_others_still_load(start_engine, other_model_dir):
    engine = await start_engine()
    trainer_model = AutoModelForCausalLM.from_pretrained(other_model_dir)
    sender = WeightSender(trainer_model, dtype=torch.float32, bucket_bytes=1 << 20, device=torch.device("cpu"))
    good = str(engine.make_url("")).rstrip("/")
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    report = await asyncio.to_thread(sender.push, [dead, good], transport="distributed", version="v2")
    sender.close()
    assert list(report.failed) == [dead]
    assert engine_of(engine).weight_version == "v2"


async def test_a_shape_mismatch_is_refused_by_name_and_changes_nothing(start_engine):
    engine = await start_engine()
    before = await _outputs(engine)
    wrong = torch.nn.Module()  # a module whose only tensor is model.norm.weight, of the wrong size
    wrong.model = torch.nn.Module()
    wrong.model.norm = torch.nn.Module()
    wrong.model.norm.weight = torch.nn.Parameter(torch.zeros(3))
    sender = WeightSender(wrong, dtype=torch.float32, bucket_bytes=1 << 20, device=torch.device("cpu"))
    url = str(engine.make_url("")).rstrip("/")
    for transport in ("tensor", "distributed", "http"):
        report = await asyncio.to_thread(sender.push, [url], transport=transport, version="bad")
        assert "model.norm.weight" in report.failed[url] and "shape" in report.failed[url]
    sender.close()
    _assert_same(await _outputs(engine), before)
    assert engine_of(engine).weight_version == "default"


async def test_the_disk_transport_keeps_only_the_newest_version(start_engine, other_model_dir, tmp_path):
    """Each sync writes a full HF directory; the ones before it are deleted once it is written
    (at 4B an fp32 directory per rollout would fill the disk in a day)."""
    engine = await start_engine()
    reference = await start_engine(model_path=str(other_model_dir))
    expected = await _outputs(reference)
    trainer_model = AutoModelForCausalLM.from_pretrained(other_model_dir)
    sender = WeightSender(trainer_model, dtype=torch.float32, bucket_bytes=1 << 20, device=torch.device("cpu"),
                          save_hf=trainer_model.save_pretrained)
    url = str(engine.make_url("")).rstrip("/")
    weights = tmp_path / "weights"
    (weights / "v0").mkdir(parents=True)  # left by an earlier attempt of the run
    for version in ("1", "2"):
        report = await asyncio.to_thread(sender.push, [url], transport="disk", version=version, disk_dir=str(weights))
        assert report.failed == {}
        assert sorted(p.name for p in weights.iterdir()) == [f"v{version}"]
    assert engine_of(engine).weight_version == "2"
    _assert_same(await _outputs(engine), expected)


@pytest.mark.parametrize("transport", ["tensor", "distributed", "http"])
async def test_an_fp8_push_sends_e4m3_weights_with_block_scales_and_the_engine_serves_them_dequantized(
        start_engine, other_model_dir, transport):
    """quantization fp8: the decoder layers' linear weights go as float8_e4m3fn + float32
    `_scale_inv` (every other tensor in the engine dtype), mixed in the same buckets; the engine
    holds exactly the quantize-dequantized weights, and the report counts the bytes sent."""
    from rlkube_runtime import fp8

    engine = await start_engine()
    trainer_model = AutoModelForCausalLM.from_pretrained(other_model_dir)
    named = dict(unique_named_tensors(trainer_model))
    quantized = {n for n, t in named.items() if fp8.is_quantized_name(n, t.shape)}
    assert len(quantized) == 7 * trainer_model.config.num_hidden_layers  # q k v o gate up down
    expected_bytes = sum(fp8.quantized_nbytes(t.shape) if n in quantized else t.numel() * 4 for n, t in named.items())
    sender = WeightSender(trainer_model, dtype=torch.float32, bucket_bytes=20000, device=torch.device("cpu"),
                          quantization="fp8")
    url = str(engine.make_url("")).rstrip("/")
    try:
        report = await asyncio.to_thread(sender.push, [url], transport=transport, version="q1")
    finally:
        sender.close()
    assert report.failed == {}
    assert report.bytes_per_engine == expected_bytes
    # The quantized part travels at ~1/4 of its float32 bytes (1/2 of bf16).
    float_bytes = sum(named[n].numel() * 4 for n in quantized)
    assert sum(fp8.quantized_nbytes(named[n].shape) for n in quantized) < 0.26 * float_bytes
    served = engine_of(engine).model.state_dict()
    for name, tensor in named.items():
        want = fp8.quantize_dequantize(tensor.detach()) if name in quantized else tensor.detach()
        assert torch.equal(served[name], want), name
    some = sorted(quantized)[0]
    assert not torch.equal(served[some], named[some].detach())  # really quantized
    assert engine_of(engine).weight_version == "q1"


async def test_an_fp8_weight_without_its_scales_is_refused_by_name_and_changes_nothing(start_engine):
    from rlkube_runtime.engine.weights import encode_named_tensors

    engine = await start_engine()
    before = await _outputs(engine)
    name = "model.layers.0.mlp.up_proj.weight"
    shape = engine_of(engine).model.state_dict()[name].shape
    payload = encode_named_tensors({name: torch.zeros(shape).to(torch.float8_e4m3fn)})
    response = await engine.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [payload], "load_format": "rlkube_safetensors", "weight_version": "bad"})
    assert response.status == 400, await response.text()
    assert "up_proj.weight_scale_inv" in await response.text()
    _assert_same(await _outputs(engine), before)


async def test_an_fp8_engine_starts_serving_the_checkpoints_weights_quantize_dequantized(start_engine, tiny_model_dir):
    """Version 0 at the precision of every later version: the loaded decoder-layer linear weights
    are replaced by their blockwise e4m3 round trip, the rest kept as loaded."""
    from rlkube_runtime import fp8

    plain, quantized = await start_engine(), await start_engine(quantization="fp8")
    loaded = engine_of(plain).model.state_dict()
    served = engine_of(quantized).model.state_dict()
    changed = 0
    for name, tensor in loaded.items():
        if fp8.is_quantized_name(name, tensor.shape):
            assert torch.equal(served[name], fp8.quantize_dequantize(tensor)), name
            changed += not torch.equal(served[name], tensor)
        else:
            assert torch.equal(served[name], tensor), name
    assert changed == 7 * engine_of(plain).model.config.num_hidden_layers
    info = await (await quantized.get("/get_server_info")).json()
    assert info["quantization"] == "fp8"

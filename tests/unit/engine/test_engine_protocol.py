"""Malformed requests get HTTP 400 naming the field; valid ones are normalised like SGLang does."""

import asyncio
import dataclasses
import inspect

import pytest
from sglang_testutil import require_pinned_sglang

from rlkube_runtime.engine import protocol
from rlkube_runtime.engine.protocol import ProtocolError, parse_generate

BAD_GENERATE_BODIES = [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": 5}, "text"),
    ({"text": ""}, "text"),
    ({"text": ["a", ""]}, "text[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 10_000]}, "input_ids[1]"),
    ({"input_ids": [[1], [2, -1]]}, "input_ids[1][1]"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": ["x"]}}, "sampling_params.stop_token_ids"),
    ({"text": "a", "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params.n"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "rid": 7}, "rid"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": "a", "stream": True}, "stream"),
    ({"text": "a", "sampling_param": {}}, "sampling_param"),
]


@pytest.mark.parametrize(("body", "field"), BAD_GENERATE_BODIES)
async def test_bad_generate_body_is_400_naming_the_field_and_server_keeps_serving(client, body, field):
    response = await client.post("/generate", json=body)
    assert response.status == 400
    error = await response.json()
    assert error["param"] == field
    assert error["code"] == 400 and field in error["message"]

    good = await client.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert good.status == 200
    assert len((await good.json())["output_ids"]) == 2


async def test_body_that_is_not_json_is_400(client):
    response = await client.post("/generate", data=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert (await response.json())["param"] == "body"


async def test_prompt_longer_than_the_context_is_400(start_engine):
    client = await start_engine(context_length=8)
    response = await client.post("/generate", json={"input_ids": [5] * 8})
    assert response.status == 400
    assert "context length is 8" in (await response.json())["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/abort_request", {}, "rid"),
        ("/abort_request", {"rid": ""}, "rid"),
        ("/pause_generation", {"mode": "later"}, "mode"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"}, "load_format"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "load_format": None}, "serialized_named_tensors[0]"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "abort_all_requests": True}, "abort_all_requests"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 2, "world_size": 2},
         "rank_offset"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2,
                                        "backend": "mpi"}, "backend"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]]}, "group_name"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]}, "dtypes[0]"),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[1]]}, "dtypes"),
        ("/destroy_weights_update_group", {"group_name": "nope"}, "group_name"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": "x", "load_format": "rlkube_safetensors"},
         "serialized_named_tensors"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"], "load_format": "rlkube_safetensors"},
         "serialized_named_tensors[0]"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, "model_path"),
    ],
)
async def test_bad_control_bodies_are_400_naming_the_field(client, path, body, field):
    response = await client.post(path, json=body)
    assert response.status == 400
    assert (await response.json())["param"] == field


def test_n_samples_expand_prompt_major_with_numbered_rids():
    request = parse_generate({"text": ["p", "q"], "rid": ["a", "b"], "sampling_params": {"n": 2}}, vocab_size=10)
    assert [(item.text, item.rid, item.sample_index) for item in request.items] == [
        ("p", "a_0", 0), ("p", "a_1", 1), ("q", "b_0", 0), ("q", "b_1", 1)
    ]
    assert not request.is_single


def test_single_prompt_with_n_one_answers_with_an_object_and_keeps_its_rid():
    request = parse_generate({"input_ids": [1, 2], "rid": "r"}, vocab_size=10)
    assert request.is_single and request.items[0].rid == "r" and request.items[0].input_ids == (1, 2)
    assert parse_generate({"text": "x", "sampling_params": {"n": 3}}, vocab_size=10).is_single is False


def test_sampling_defaults_match_sglang():
    params = parse_generate({"text": "x"}, vocab_size=10).items[0].sampling
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (1.0, 1.0, -1, 128)
    assert params.skip_special_tokens and not params.ignore_eos and params.stop == ()


def test_neutral_values_of_unsupported_fields_are_accepted():
    body = {"text": "x", "stream": False, "logprob_start_len": -1,
            "sampling_params": {"min_p": 0.0, "repetition_penalty": 1.0, "spaces_between_special_tokens": True}}
    assert parse_generate(body, vocab_size=10).items[0].sampling.temperature == 1.0


def test_fields_sglang_router_adds_at_their_off_value_are_accepted():
    # What sglang-router 0.3.2 sends after re-serialising {"text": "x", "rid": "r"}.
    body = {"text": "x", "model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
            "return_entropy": False, "rid": "r"}
    assert parse_generate(body, vocab_size=10).items[0].rid == "r"
    with pytest.raises(ProtocolError, match="background"):
        parse_generate({**body, "background": True}, vocab_size=10)


def test_memory_tags_default_to_all():
    assert protocol.parse_memory_tags(None) == protocol.MEMORY_TAGS
    with pytest.raises(ProtocolError, match="tags"):
        protocol.parse_memory_tags({"tags": []})


# ---- what SGLang's own code sends (the pinned sglang wheel, installed without its dependencies) ----

# A value other than "off" for each SGLang sampling parameter the built-in engine does not implement.
NOT_NEUTRAL = {
    "stop_regex": ["[0-9]+"], "min_p": 0.1, "min_new_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "repetition_penalty": 1.2, "json_schema": '{"type": "string"}', "regex": "a+", "ebnf": 'root ::= "a"',
    "structural_tag": '{"type": "structural_tag"}', "logit_bias": {"1": 2.0}, "custom_params": {"k": 1},
    "stream_interval": 2, "spaces_between_special_tokens": False,
}


def _sglang_sampling_defaults() -> dict:
    """Every parameter of SGLang's SamplingParams (srt/sampling/sampling_params.py) at its default."""
    require_pinned_sglang()
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    parameters = inspect.signature(SGLangSamplingParams.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name != "self"}


def test_every_sglang_sampling_parameter_is_implemented_or_accepted_only_when_off():
    implemented = {f.name for f in dataclasses.fields(protocol.SamplingParams)}
    off_only = set(protocol._NEUTRAL_SAMPLING_FIELDS)
    sglang = set(_sglang_sampling_defaults())
    assert sglang - implemented - off_only == set(), "SGLang sampling parameters the built-in engine does not know"
    assert off_only == set(NOT_NEUTRAL), "each off-only parameter needs a refused value below"


async def test_all_of_sglangs_sampling_parameters_at_their_defaults_generate(client):
    body = {"text": "ab", "sampling_params": {**_sglang_sampling_defaults(), "max_new_tokens": 2, "ignore_eos": True}}
    response = await client.post("/generate", json=body)
    assert response.status == 200, await response.text()
    assert len((await response.json())["output_ids"]) == 2


@pytest.mark.parametrize("field", sorted(NOT_NEUTRAL))
async def test_an_sglang_sampling_parameter_the_engine_does_not_implement_is_refused_by_name_unless_off(client, field):
    response = await client.post("/generate", json={"text": "ab", "sampling_params": {field: NOT_NEUTRAL[field]}})
    assert response.status == 400
    error = await response.json()
    assert error["param"] == f"sampling_params.{field}" and "not supported by the built-in engine" in error["message"]


async def test_sglangs_frontend_client_generates_against_the_builtin_engine(client, monkeypatch):
    """sglang.RuntimeEndpoint and an `sgl.function` program, unchanged, against the built-in engine:
    the body is the one SGLang's client builds (stop_regex included, as [])."""
    require_pinned_sglang()
    import sglang as sgl
    from sglang.lang.backend import runtime_endpoint

    bodies = []
    send = runtime_endpoint.http_request

    def recording(url, json=None, **kwargs):
        bodies.append((url, json))
        return send(url, json=json, **kwargs)

    monkeypatch.setattr(runtime_endpoint, "http_request", recording)

    @sgl.function
    def answer(s):
        s += "3>" + sgl.gen("reply", max_tokens=3, temperature=0)

    def run():  # the client blocks; the engine serves on this test's event loop
        backend = runtime_endpoint.RuntimeEndpoint(str(client.make_url("")).rstrip("/"))
        state = answer.run(backend=backend)
        return state["reply"], state.get_meta_info("reply")

    reply, meta = await asyncio.to_thread(run)
    generate = [body for url, body in bodies if url.endswith("/generate")]
    assert len(generate) == 1 and generate[0]["sampling_params"]["stop_regex"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["completion_tokens"] == 3
    assert isinstance(reply, str)

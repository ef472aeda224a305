"""SGLang's HTTP request and response shapes, validated into plain dataclasses.

Everything a client can get wrong is checked here, before it reaches the scheduler, and reported
as a `ProtocolError` naming the field, the value received and what is allowed. The server turns
that into one error envelope (SGLang's `ErrorResponse` shape) with HTTP 400.

Longer than the 500 lines other modules keep to, on purpose: every request and response shape
of the protocol in one module, as SGLang keeps its own (serving's protocol module), so a route
reads its shape in one place; split by endpoint, the shared field checks would be written twice.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

# Top-level /generate fields SGLang defines that the built-in engine accepts as no-ops when they
# carry their neutral value (null, false, 0, -1 or empty); anything else is rejected by name.
_NEUTRAL_GENERATE_FIELDS = {
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "session_params": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "log_metrics": True,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": None,
}

# Sampling parameters SGLang defines that the built-in engine does not implement; accepted only at
# the value that means "off", so a request never silently samples differently than asked. With
# the fields of `SamplingParams` below they cover every parameter of SGLang 0.5.8's SamplingParams
# (tests/unit/engine/test_engine_protocol.py checks that against the installed sglang).
_NEUTRAL_SAMPLING_FIELDS = {
    # SGLang's frontend client (RuntimeEndpoint) always sends it, as [] when unused.
    "stop_regex": None,
    "min_p": 0.0,
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
    "spaces_between_special_tokens": True,
}

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
RLKUBE_LOAD_FORMAT = "rlkube_safetensors"
# SGLang's default /update_weights_from_tensor format: pickled (name, tensor) handles.
SHARED_LOAD_FORMATS = (None, "direct")
GROUP_BACKENDS = ("nccl", "gloo")
DEFAULT_GROUP_NAME = "weight_update_group"


class ProtocolError(ValueError):
    """A request the server cannot accept; `field` names the offending JSON path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Rebuilt from its fields, so it crosses process boundaries (Ray) intact.
        return type(self), (self.field, self.message)


def error_envelope(message: str, *, status: int, field: str | None = None) -> dict[str, Any]:
    """SGLang's `ErrorResponse` body, plus `param` naming the field when one is at fault."""
    phrase = {400: "BadRequest", 404: "NotFound", 500: "InternalServerError", 503: "ServiceUnavailable"}
    return {"object": "error", "message": message, "type": phrase.get(status, str(status)), "param": field, "code": status}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with SGLang's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class GenerateItem:
    """One sequence to generate: a prompt (text or ids), its rid and settings."""

    rid: str
    text: str | None
    input_ids: tuple[int, ...] | None
    sampling: SamplingParams
    return_logprob: bool
    sample_index: int  # which of the n parallel samples of its prompt this is
    return_routed_experts: bool = False  # answer with meta_info.routed_experts (rollout routing replay)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A validated /generate body: its items in response order, and whether to answer with a list."""

    items: tuple[GenerateItem, ...]
    is_single: bool


def parse_generate(body: Any, *, vocab_size: int, routes_enabled: bool = False,
                   served_adapter: str | None = None) -> GenerateRequest:
    """Validate a /generate body the way SGLang's GenerateReqInput normalises it.

    `lora_path` (one name, or one per prompt) must name `served_adapter`, the LoRA adapter the
    engine has merged into its weights, and is None only while it serves none: the weights serve
    one model at a time, so a request for another (the base included) is refused by name.

    `return_routed_experts` needs `routes_enabled` (the server's --enable-return-routed-experts):
    SGLang would answer without routes; here the request is refused, naming the flag.

    Batch input (a list of texts or of id lists) and `n > 1` both answer with a list; the n samples
    of a prompt are adjacent (prompt-major order), each with its own rid.
    """
    body = _require_object(body, "body")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ProtocolError("text", "give exactly one of 'text' (a string or list of strings) or 'input_ids'")
    _check_neutral_fields(body, _NEUTRAL_GENERATE_FIELDS, known={"text", "input_ids", "sampling_params", "rid", "return_logprob",
                                                                        "return_routed_experts", "lora_path"})

    if text is not None:
        prompts, is_batch = _parse_texts(text)
    else:
        prompts, is_batch = _parse_input_ids(input_ids, vocab_size)
    batch_size = len(prompts)

    sampling = _per_prompt(body.get("sampling_params"), batch_size, is_batch, "sampling_params", _parse_sampling)
    n_values = {p.n for p in sampling}
    if len(n_values) > 1:
        raise ProtocolError("sampling_params.n", f"must be the same for every prompt of a batch, got {sorted(n_values)}")
    n = n_values.pop()
    return_logprob = _per_prompt(body.get("return_logprob"), batch_size, is_batch, "return_logprob", _parse_bool)
    rids = _parse_rids(body.get("rid"), batch_size, is_batch, n)
    routes = _per_prompt(body.get("return_routed_experts"), batch_size, is_batch, "return_routed_experts", _parse_bool)
    if any(routes) and not routes_enabled:
        raise ProtocolError("return_routed_experts", "the engine was started without --enable-return-routed-experts")
    for adapter in _per_prompt(body.get("lora_path"), batch_size, is_batch, "lora_path", _parse_optional_name):
        if adapter != served_adapter:
            raise ProtocolError("lora_path", f"asks for {adapter!r}, but this engine serves "
                                + (f"the LoRA adapter {served_adapter!r} merged into its weights; name it"
                                   if served_adapter else "no LoRA adapter (load one with /load_lora_adapter)"))

    items = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            items.append(
                GenerateItem(
                    rid=rids[i * n + j],
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=None if isinstance(prompt, str) else prompt,
                    sampling=sampling[i],
                    return_logprob=return_logprob[i],
                    sample_index=j,
                    return_routed_experts=routes[i],
                )
            )
    return GenerateRequest(items=tuple(items), is_single=not is_batch and n == 1)


def parse_abort(body: Any) -> tuple[str | None, bool]:
    """`{rid, abort_all}` → (rid prefix or None, abort_all)."""
    body = _require_object(body, "body")
    abort_all = _parse_bool(body.get("abort_all", False), "abort_all")
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ProtocolError("rid", f"must be a non-empty string (a rid prefix), got {rid!r}")
    if rid is None and not abort_all:
        raise ProtocolError("rid", "give a rid prefix to abort, or abort_all: true")
    return rid, abort_all


def parse_pause(body: Any) -> str:
    body = _require_object(body or {}, "body")
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise ProtocolError("mode", f"must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def parse_memory_tags(body: Any) -> tuple[str, ...]:
    """`{tags: [...]}`; no tags means all of them, as in SGLang."""
    body = _require_object(body or {}, "body")
    tags = body.get("tags")
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not tags:
        raise ProtocolError("tags", f"must be a non-empty list drawn from {list(MEMORY_TAGS)}, got {tags!r}")
    for i, tag in enumerate(tags):
        if tag not in MEMORY_TAGS:
            raise ProtocolError(f"tags[{i}]", f"must be one of {list(MEMORY_TAGS)}, got {tag!r}")
    return tuple(dict.fromkeys(tags))


@dataclasses.dataclass(frozen=True)
class TensorUpdate:
    serialized: str
    load_format: str | None  # RLKUBE_LOAD_FORMAT, or one of SHARED_LOAD_FORMATS
    flush_cache: bool
    weight_version: str | None


def parse_update_from_tensor(body: Any) -> TensorUpdate:
    body = _require_object(body, "body")
    load_format = body.get("load_format")
    if load_format != RLKUBE_LOAD_FORMAT and load_format not in SHARED_LOAD_FORMATS:
        raise ProtocolError(
            "load_format",
            f"the built-in engine reads {RLKUBE_LOAD_FORMAT!r} (base64 safetensors bytes, made by "
            "rlkube_runtime.engine.weights.encode_named_tensors) or SGLang's default, null or 'direct' (pickled "
            f"(name, tensor) handles on this machine), got {load_format!r}",
        )
    _check_neutral_fields(body, {"abort_all_requests": False},
                          known={"serialized_named_tensors", "load_format", "flush_cache", "weight_version"})
    tensors = body.get("serialized_named_tensors")
    if not isinstance(tensors, list) or len(tensors) != 1 or not isinstance(tensors[0], str):
        shape = f"a list of {len(tensors)}" if isinstance(tensors, list) else type(tensors).__name__
        raise ProtocolError(
            "serialized_named_tensors",
            f"must be a list with one string (the built-in engine has one tensor-parallel rank), got {shape}",
        )
    return TensorUpdate(
        serialized=tensors[0],
        load_format=load_format,
        flush_cache=_parse_bool(body.get("flush_cache", True), "flush_cache"),
        weight_version=_parse_optional_version(body.get("weight_version")),
    )


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """/init_weights_update_group: join rank 0's group as rank `rank_offset`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclasses.dataclass(frozen=True)
class DistributedUpdate:
    """/update_weights_from_distributed: the tensors rank 0 broadcasts, in this order."""

    names: tuple[str, ...]
    dtypes: tuple[Any, ...]  # torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    weight_version: str | None


def parse_init_weights_update_group(body: Any) -> GroupSpec:
    body = _require_object(body, "body")
    _check_neutral_fields(body, {}, known={"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"})
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise ProtocolError("master_address", f"must be the host name or IP of rank 0, got {address!r}")
    port = _integer(body.get("master_port"), "master_port", low=1)
    world_size = _integer(body.get("world_size"), "world_size", low=2)
    rank_offset = _integer(body.get("rank_offset"), "rank_offset", low=1)
    if rank_offset >= world_size:
        raise ProtocolError("rank_offset", f"must be below world_size ({world_size}): this engine has one rank, got {rank_offset}")
    backend = body.get("backend") or "nccl"
    if backend not in GROUP_BACKENDS:
        raise ProtocolError("backend", f"must be one of {list(GROUP_BACKENDS)}, got {backend!r}")
    return GroupSpec(master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size,
                     group_name=_group_name(body), backend=backend)


def parse_update_from_distributed(body: Any) -> DistributedUpdate:
    import torch  # dtype names resolve against torch; the rest of this module needs no torch

    body = _require_object(body, "body")
    _check_neutral_fields(body, {"abort_all_requests": False, "load_format": None},
                          known={"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"})
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ProtocolError("names", f"must be a non-empty list of tensor names, got {_describe(names)}")
    for field, value in (("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list) or len(value) != len(names):
            raise ProtocolError(field, f"must be a list with one entry per name ({len(names)}), got {_describe(value)}")
    parsed_dtypes = []
    for i, dtype in enumerate(dtypes):
        found = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
        if not isinstance(found, torch.dtype):
            raise ProtocolError(f"dtypes[{i}]", f"must name a torch dtype such as 'bfloat16', got {dtype!r}")
        parsed_dtypes.append(found)
    for i, shape in enumerate(shapes):
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ProtocolError(f"shapes[{i}]", f"must be a list of sizes, got {_describe(shape)}")
    return DistributedUpdate(names=tuple(names), dtypes=tuple(parsed_dtypes), shapes=tuple(tuple(s) for s in shapes),
                             group_name=_group_name(body), weight_version=_parse_optional_version(body.get("weight_version")))


def parse_group_name(body: Any) -> str:
    return _group_name(_require_object(body or {}, "body"))


def _group_name(body: dict[str, Any]) -> str:
    name = body.get("group_name") or DEFAULT_GROUP_NAME
    if not isinstance(name, str):
        raise ProtocolError("group_name", f"must be a string, got {name!r}")
    return name


def parse_update_from_disk(body: Any) -> tuple[str, str | None]:
    body = _require_object(body, "body")
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise ProtocolError("model_path", f"must be a directory path string, got {model_path!r}")
    load_format = body.get("load_format")
    if load_format not in (None, "auto", "safetensors"):
        raise ProtocolError("load_format", f"the built-in engine loads safetensors checkpoints only, got {load_format!r}")
    return model_path, _parse_optional_version(body.get("weight_version"))


# ---- responses -------------------------------------------------------------------------------


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


def new_rid() -> str:
    return uuid.uuid4().hex


# ---- helpers ---------------------------------------------------------------------------------


def _require_object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def _check_neutral_fields(body: dict[str, Any], neutral: dict[str, Any], *, known: set[str], prefix: str = "") -> None:
    for key, value in body.items():
        if key in known:
            continue
        if key not in neutral:
            # sglang-router re-serialises requests and adds its own fields at their "off" value
            # (model: null, background: false, ...); those are harmless, anything else is a typo.
            if value is None or value is False:
                continue
            allowed = sorted(known | set(neutral))
            raise ProtocolError(f"{prefix}{key}", f"unknown field; known fields are {allowed}")
        if value is not None and value != neutral[key] and value not in ([], {}, ""):
            raise ProtocolError(
                f"{prefix}{key}",
                f"not supported by the built-in engine except at {neutral[key]!r}, got {value!r}",
            )


def _parse_texts(text: Any) -> tuple[list[str], bool]:
    if isinstance(text, str):
        prompts, is_batch = [text], False
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts, is_batch = list(text), True
    else:
        raise ProtocolError("text", f"must be a string or a non-empty list of strings, got {_describe(text)}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ProtocolError("text" if not is_batch else f"text[{i}]", "must not be empty")
    return prompts, is_batch


def _parse_input_ids(input_ids: Any, vocab_size: int) -> tuple[list[tuple[int, ...]], bool]:
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        rows, is_batch = input_ids, True
    elif isinstance(input_ids, list):
        rows, is_batch = [input_ids], False
    else:
        raise ProtocolError("input_ids", f"must be a list of token ids or a list of such lists, got {_describe(input_ids)}")
    prompts = []
    for i, row in enumerate(rows):
        field = f"input_ids[{i}]" if is_batch else "input_ids"
        if not row:
            raise ProtocolError(field, "must not be empty")
        for j, token in enumerate(row):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ProtocolError(f"{field}[{j}]", f"must be a token id in [0, {vocab_size}), got {token!r}")
        prompts.append(tuple(row))
    return prompts, is_batch


def _per_prompt(value: Any, batch_size: int, is_batch: bool, field: str, parse) -> list:
    if isinstance(value, list):
        if not is_batch:
            raise ProtocolError(field, f"is a list but the prompt is single; give one value, got {_describe(value)}")
        if len(value) != batch_size:
            raise ProtocolError(field, f"has {len(value)} entries but the batch has {batch_size} prompts")
        return [parse(v, f"{field}[{i}]") for i, v in enumerate(value)]
    parsed = parse(value, field)
    return [parsed] * batch_size


def _parse_rids(rid: Any, batch_size: int, is_batch: bool, n: int) -> list[str]:
    total = batch_size * n
    if rid is None:
        return [new_rid() for _ in range(total)]
    if isinstance(rid, str):
        if not rid:
            raise ProtocolError("rid", "must not be empty")
        if total == 1:
            return [rid]
        # SGLang numbers the expanded requests of one rid as rid_0, rid_1, ...
        return [f"{rid}_{k}" for k in range(total)]
    if isinstance(rid, list) and is_batch:
        if len(rid) != batch_size or not all(isinstance(r, str) and r for r in rid):
            raise ProtocolError("rid", f"must list one non-empty string per prompt ({batch_size}), got {_describe(rid)}")
        if len(set(rid)) != len(rid):
            raise ProtocolError("rid", "must not repeat a rid within a batch")
        return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    raise ProtocolError("rid", f"must be a string (or, for a batch, a list of strings), got {_describe(rid)}")


def _parse_bool(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(field, f"must be true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LoadLoraAdapter:
    """A /load_lora_adapter body (SGLang's LoadLoRAAdapterReqInput): a peft directory the engine reads."""

    lora_name: str
    lora_path: str


def parse_load_lora_adapter(body: Any) -> LoadLoraAdapter:
    body = _require_object(body, "body")
    _check_neutral_fields(body, {"pinned": False, "lora_id": None}, known={"lora_name", "lora_path"})
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise ProtocolError("lora_name", f"must be a non-empty string, got {name!r}")
    if not isinstance(path, str) or not path:
        raise ProtocolError("lora_path", f"must be a directory path string, got {path!r}")
    return LoadLoraAdapter(name, path)


def parse_unload_lora_adapter(body: Any) -> str:
    body = _require_object(body, "body")
    _check_neutral_fields(body, {"lora_id": None}, known={"lora_name"})
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ProtocolError("lora_name", f"must be a non-empty string, got {name!r}")
    return name


def parse_update_weight_version(body: Any) -> str:
    """A /update_weight_version body (SGLang's UpdateWeightVersionReqInput); aborting is not built."""
    body = _require_object(body, "body")
    _check_neutral_fields(body, {"abort_all_requests": False}, known={"new_version"})
    version = _parse_optional_version(body.get("new_version"))
    if version is None:
        raise ProtocolError("new_version", "is required")
    return version


def _parse_optional_name(value: Any, field: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ProtocolError(field, f"must be an adapter name (a non-empty string) or null, got {value!r}")
    return value


def _parse_optional_version(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProtocolError("weight_version", f"must be a string, got {value!r}")
    return str(value)


def _parse_sampling(value: Any, field: str) -> SamplingParams:
    if value is None:
        return SamplingParams()
    params = _require_object(value, field)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    _check_neutral_fields(params, _NEUTRAL_SAMPLING_FIELDS, known=known, prefix=f"{field}.")

    def get(key: str, default: Any) -> Any:
        return default if params.get(key) is None else params[key]

    temperature = _number(get("temperature", 1.0), f"{field}.temperature", low=0.0)
    top_p = _number(get("top_p", 1.0), f"{field}.top_p", low=0.0, high=1.0)
    if top_p == 0.0:
        raise ProtocolError(f"{field}.top_p", "must be in (0, 1], got 0")
    top_k = _integer(get("top_k", -1), f"{field}.top_k", low=-1)
    if top_k == 0:
        raise ProtocolError(f"{field}.top_k", "must be -1 (whole vocabulary) or at least 1, got 0")
    max_new_tokens = _integer(get("max_new_tokens", 128), f"{field}.max_new_tokens", low=0)
    n = _integer(get("n", 1), f"{field}.n", low=1)
    seed = params.get("sampling_seed")
    if seed is not None:
        seed = _integer(seed, f"{field}.sampling_seed", low=0)

    stop = get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(f"{field}.stop", f"must be a non-empty string or a list of them, got {_describe(stop)}")
    stop_token_ids = get("stop_token_ids", [])
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise ProtocolError(f"{field}.stop_token_ids", f"must be a list of token ids, got {_describe(stop_token_ids)}")

    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_parse_bool(params.get("ignore_eos"), f"{field}.ignore_eos"),
        skip_special_tokens=_parse_bool(get("skip_special_tokens", True), f"{field}.skip_special_tokens"),
        no_stop_trim=_parse_bool(params.get("no_stop_trim"), f"{field}.no_stop_trim"),
        n=n,
        sampling_seed=seed,
    )


def _number(value: Any, field: str, *, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(field, f"must be a number, got {value!r}")
    if not low <= value <= high:
        bound = f"at least {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ProtocolError(field, f"must be {bound}, got {value!r}")
    return float(value)


def _integer(value: Any, field: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise ProtocolError(field, f"must be at least {low}, got {value}")
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

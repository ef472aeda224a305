"""The engine object the HTTP routes hand off to: model, tokenizer, scheduler and server state.

Every method is a coroutine that validates its input, runs the work in the scheduler thread and
returns the JSON-ready answer; routes only parse the body and serialise the result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from typing import Any

import torch

from rlkube_runtime import failpoints, fp8_checkpoint
from rlkube_runtime.engine import protocol, weight_groups, weights
from rlkube_runtime.engine.hf_runner import HFRunner
from rlkube_runtime.engine.protocol import GenerateItem, ProtocolError
from rlkube_runtime.engine.sampling import uniform_stream
from rlkube_runtime.engine.scheduler import Scheduler
from rlkube_runtime.engine.sequence import Sequence
from rlkube_runtime.engine.slot_runner import SlotRunner, unsupported_reason

log = logging.getLogger(__name__)

ENGINE_NAME = "rlkube-builtin"
HEALTH_CHECK_TIMEOUT_S = 20.0
RUNNERS = ("auto", "slot", "hf")
CPU_KV_BUDGET_BYTES = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What `python -m rlkube_runtime.engine` is started with."""

    model_path: str
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 64
    context_length: int | None = None  # default: the model's max_position_embeddings
    host: str = "127.0.0.1"  # local only; the launcher passes the node's IP
    port: int = 30000
    weight_version: str = "default"
    runner: str = "auto"  # slot: static KV cache (+ CUDA graphs); hf: transformers' forward; auto: slot when it can
    cuda_graphs: bool = True
    # torch.compile the decode step's elementwise kernels (GPU, slot runner; SGLang's --enable-torch-compile)
    torch_compile: bool = False
    # Share of the GPU's memory the engine may hold (weights + KV cache), as SGLang's option.
    mem_fraction_static: float = 0.8
    max_total_tokens: int | None = None  # KV cache slots at most (default: what the memory share allows)
    trust_remote_code: bool = False  # run the checkpoint's own model/tokenizer code
    api_key: str | None = None  # required of every request but health and metrics (SGLang's --api-key)
    # "fp8": serve block-quantized e4m3 weights (spec.model.rolloutDtype fp8); implied by a
    # block-fp8 checkpoint (rlkube_runtime/fp8_checkpoint.py), else the checkpoint's weights are
    # quantized at start. The engine keeps its weights in `dtype`, dequantized: this models the
    # weights' quantization error, not SGLang's fp8 GEMMs (which also quantize the activations).
    quantization: str | None = None
    # Report every token's routed experts to requests that ask (SGLang's --enable-return-routed-experts):
    # mixture-of-experts models on the generic runner, for rollout routing replay.
    return_routed_experts: bool = False
    # LoRA adapters may be loaded (SGLang's --enable-lora), of rank at most max_lora_rank and on
    # these layers only (None: any), as SGLang sizes its adapter memory pool from both.
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None


class Engine:
    """Serves SGLang's native API over a transformers causal LM; create with `Engine.load`."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer):
        self.config = config
        self.model_path = config.model_path
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        self.vocab_size = int(model_config.vocab_size)
        self.context_length = int(config.context_length or getattr(model_config, "max_position_embeddings", 4096))
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_token_ids, default=0)
        self.runner = _make_runner(model, config, pad)
        self.scheduler = Scheduler(
            self.runner, tokenizer, max_running_requests=config.max_running_requests, vocab_size=self.vocab_size
        )
        self.scheduler.weight_version = config.weight_version
        self._offload = weights.WeightOffload()
        self._groups: dict[str, Any] = {}  # /init_weights_update_group's process groups by name
        # The LoRA adapter merged into the weights, and the base weights of the layers it changed.
        self.lora_name: str | None = None
        self._lora_base: dict[str, torch.Tensor] = {}
        self._started_at = time.time()

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if config.dtype not in dtypes:
            raise ValueError(f"dtype must be one of {list(dtypes)}, got {config.dtype!r}")
        dtype = dtypes[config.dtype]
        remote = {"trust_remote_code": True} if config.trust_remote_code else {}
        if config.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {config.quantization!r}")
        tokenizer = AutoTokenizer.from_pretrained(config.model_path, **remote)
        if fp8_checkpoint.is_fp8_checkpoint(config.model_path):  # as SGLang: fp8 because config.json says so
            model = _load_fp8_checkpoint(config.model_path, dtype, remote)
            config = dataclasses.replace(config, quantization="fp8")
        else:
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype, **remote)
            if config.quantization == "fp8":
                _quantize_dequantize(model)
        model.to(config.device).eval()
        return cls(config, model, tokenizer)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, body: Any) -> dict[str, Any] | list[dict[str, Any]]:
        request = protocol.parse_generate(body, vocab_size=self.vocab_size, routes_enabled=self.config.return_routed_experts,
                                          served_adapter=self.lora_name)
        sequences = [self._sequence(item) for item in request.items]
        for seq in sequences:
            self.scheduler.submit(seq)
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(seq.future) for seq in sequences))
        except asyncio.CancelledError:
            # The client went away: stop spending compute on its tokens.
            self.scheduler.call(lambda: self.scheduler.cancel(sequences, "client disconnected"))
            raise
        return results[0] if request.is_single else list(results)

    def _sequence(self, item: GenerateItem) -> Sequence:
        prompt = list(item.input_ids) if item.input_ids is not None else self.tokenizer.encode(item.text)
        field = "input_ids" if item.input_ids is not None else "text"
        if not prompt:
            raise ProtocolError(field, "tokenizes to no tokens")
        if len(prompt) >= self.context_length:
            raise ProtocolError(
                field, f"prompt has {len(prompt)} tokens; the context length is {self.context_length}, so at most "
                f"{self.context_length - 1} fit"
            )
        params = item.sampling
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        max_new_tokens = min(params.max_new_tokens, self.context_length - len(prompt))
        return Sequence(
            item=item,
            prompt_ids=prompt,
            stop_token_ids=frozenset(stop_ids),
            max_new_tokens=max_new_tokens,
            uniforms=uniform_stream(self.config.seed, params, item.rid, item.sample_index, max_new_tokens),
        )

    async def health_generate(self) -> bool:
        """Healthy when a 1-token greedy generation completes, or (as in SGLang) when the loop
        makes progress on other work meanwhile; while paused or released, when the loop answers."""
        if self.scheduler.paused_mode is not None or self.scheduler.released_tags:
            try:
                await asyncio.wait_for(self._run(lambda: None), HEALTH_CHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                return False
            return True
        steps_before = self.scheduler.steps
        body = {"input_ids": [0], "rid": f"HEALTH_CHECK_{time.time_ns()}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "lora_path": self.lora_name}
        probe = asyncio.ensure_future(self.generate(body))
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                done, _ = await asyncio.wait({probe}, timeout=0.05)
                if done:
                    return probe.exception() is None
                if self.scheduler.steps > steps_before + 1:  # a full step ran since the check began
                    return True
            return False
        finally:
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)

    # ---- control ---------------------------------------------------------------------------

    async def abort(self, body: Any) -> int:
        rid, abort_all = protocol.parse_abort(body)
        return await self._run(lambda: self.scheduler.abort(None if abort_all else rid))

    async def pause(self, body: Any) -> dict[str, Any]:
        mode = protocol.parse_pause(body)
        await self._run(lambda: self.scheduler.pause(mode))
        return {"status": "ok", "message": f"Generation paused (mode {mode}).", "mode": mode}

    async def resume(self) -> dict[str, Any]:
        await self._run(self.scheduler.resume)
        return {"status": "ok", "message": "Generation continued."}

    async def flush_cache(self) -> bool:
        """SGLang refuses to flush while requests run; so does this engine (there is no prefix
        cache to drop, so an idle flush returns the allocator's cached blocks)."""

        def flush() -> bool:
            if not self.scheduler.idle():
                return False
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return True

        return await self._run(flush)

    async def update_weights_from_tensor(self, body: Any) -> dict[str, Any]:
        update = protocol.parse_update_from_tensor(body)
        failpoints.reach(f"engine.update_weights:{update.weight_version}")
        field = "serialized_named_tensors"
        if update.load_format == protocol.RLKUBE_LOAD_FORMAT:
            tensors, offsets = await asyncio.to_thread(weights.decode_named_tensors, update.serialized)
            count = await self._run(lambda: self._apply(tensors, field, update.weight_version, offsets))
        else:
            # Handles to the sender's memory: opened, copied from and dropped in the loop thread.
            def load_shared() -> int:
                pairs = weights.decode_shared_named_tensors(update.serialized)
                return self._apply(dict(pairs), field, update.weight_version)

            count = await self._run(load_shared)
        return {"success": True, "message": f"Updated {count} tensors. Weight version {self.weight_version}."}

    async def init_weights_update_group(self, body: Any) -> dict[str, Any]:
        spec = protocol.parse_init_weights_update_group(body)
        group = await asyncio.to_thread(weight_groups.open_group, spec, self.scheduler.device, self.config.host)
        self._groups[spec.group_name] = group
        return {"success": True, "message": f"Joined weight update group {spec.group_name!r} as rank {spec.rank_offset}."}

    async def update_weights_from_distributed(self, body: Any) -> dict[str, Any]:
        update = protocol.parse_update_from_distributed(body)
        failpoints.reach(f"engine.update_weights:{update.weight_version}")
        group = self._groups.get(update.group_name)
        if group is None:
            raise ProtocolError("group_name", f"no weight update group {update.group_name!r}; call /init_weights_update_group first")

        def receive() -> int:
            self._check_weights_resident("names")
            count = weight_groups.receive_into_model(self.model, group, update)
            if update.weight_version is not None:
                self.scheduler.weight_version = update.weight_version
            return count

        count = await self._run(receive)
        return {"success": True, "message": f"Updated {count} tensors. Weight version {self.weight_version}."}

    async def destroy_weights_update_group(self, body: Any) -> dict[str, Any]:
        name = protocol.parse_group_name(body)
        if self._groups.pop(name, None) is None:
            raise ProtocolError("group_name", f"no weight update group {name!r}")
        return {"success": True, "message": f"Left weight update group {name!r}."}

    async def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        model_path, version = protocol.parse_update_from_disk(body)
        tensors = await asyncio.to_thread(weights.load_checkpoint_tensors, model_path)
        count = await self._run(lambda: self._apply(tensors, "model_path", version))
        self.model_path = model_path
        return {
            "success": True,
            "message": f"Loaded {count} tensors from {model_path}. Weight version {self.weight_version}.",
            "num_paused_requests": 0,
        }

    async def load_lora_adapter(self, body: Any) -> dict[str, Any]:
        """Merge a peft adapter into the weights (W + scaling * B @ A), keeping the base of every
        layer it changes so an unload or the next adapter starts from the base again."""
        from rlkube_runtime import lora

        request = protocol.parse_load_lora_adapter(body)
        if not self.config.enable_lora:
            raise ProtocolError("lora_name", "the engine was started without --enable-lora")
        if self.lora_name is not None:
            raise ProtocolError("lora_name", f"the adapter {self.lora_name!r} is loaded and the weights serve one at a "
                                "time; call /unload_lora_adapter first")
        try:
            config, tensors = await asyncio.to_thread(lora.read_adapter, request.lora_path)
        except (OSError, ValueError) as err:
            raise ProtocolError("lora_path", str(err)) from err
        self._check_adapter_fits(config)

        def merge() -> int:
            self._check_weights_resident("lora_path")
            params = dict(self.model.named_parameters())
            try:
                merged = lora.merged_weights(params, tensors, lora.scaling_of(config))
            except ValueError as err:
                raise ProtocolError("lora_path", str(err)) from err
            with torch.no_grad():
                for name, weight in merged.items():
                    self._lora_base[name] = params[name].detach().clone()
                    params[name].copy_(weight)
            self.lora_name = request.lora_name
            return len(merged)

        count = await self._run(merge)
        return {"success": True, "error_message": None, "loaded_adapters": {request.lora_name: request.lora_path},
                "message": f"Merged {count} layers of {request.lora_path}."}

    async def unload_lora_adapter(self, body: Any) -> dict[str, Any]:
        name = protocol.parse_unload_lora_adapter(body)
        if name != self.lora_name:
            raise ProtocolError("lora_name", f"no LoRA adapter {name!r} is loaded")

        def restore() -> None:
            self._check_weights_resident("lora_name")
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for layer, base in self._lora_base.items():
                    params[layer].copy_(base)
            self._lora_base, self.lora_name = {}, None

        await self._run(restore)
        return {"success": True, "error_message": None, "loaded_adapters": {}}

    async def update_weight_version(self, body: Any) -> dict[str, Any]:
        version = protocol.parse_update_weight_version(body)

        def set_version() -> None:
            self.scheduler.weight_version = version

        await self._run(set_version)
        return {"success": True, "message": f"Weight version {version}."}

    def _check_adapter_fits(self, config: dict[str, Any]) -> None:
        rank, limit = int(config.get("r", 0)), self.config.max_lora_rank
        if limit is not None and rank > limit:
            raise ProtocolError("lora_path", f"the adapter's rank {rank} is above --max-lora-rank {limit}")
        targets, allowed = config.get("target_modules") or [], self.config.lora_target_modules
        if allowed is not None and not set(targets) <= set(allowed):
            raise ProtocolError("lora_path", f"the adapter adapts {sorted(set(targets) - set(allowed))}, which are not "
                                f"among --lora-target-modules {list(allowed)}")

    def _apply(self, tensors: dict[str, torch.Tensor], field: str, version: str | None, row_offsets=None) -> int:
        self._check_weights_resident(field)
        if self.lora_name is not None:
            raise ProtocolError(field, f"the LoRA adapter {self.lora_name!r} is merged into the weights; "
                                "call /unload_lora_adapter before replacing them")
        count = weights.copy_into_model(self.model, tensors, field=field, row_offsets=row_offsets)
        if version is not None:
            self.scheduler.weight_version = version
        return count

    def _check_weights_resident(self, field: str) -> None:
        if "weights" in self.scheduler.released_tags:
            raise ProtocolError(field, "the weights are released; call /resume_memory_occupation with tags ['weights'] first")

    async def release_memory(self, body: Any) -> dict[str, Any]:
        tags = protocol.parse_memory_tags(body)
        await self._run(lambda: self.scheduler.release(tags, self._offload))
        return {"success": True, "message": f"Released {list(tags)}.", "released_tags": sorted(self.scheduler.released_tags)}

    async def resume_memory(self, body: Any) -> dict[str, Any]:
        tags = protocol.parse_memory_tags(body)
        await self._run(lambda: self.scheduler.resume_memory(tags, self._offload))
        return {"success": True, "message": f"Resumed {list(tags)}.", "released_tags": sorted(self.scheduler.released_tags)}

    async def _run(self, command):
        return await asyncio.wrap_future(self.scheduler.call(command))

    # ---- information -----------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    def server_info(self) -> dict[str, Any]:
        load = self.scheduler.load()
        return {
            "engine": ENGINE_NAME,
            "version": _package_version(),
            "model_path": self.model_path,
            "tokenizer_path": self.config.model_path,
            "served_model_name": self.config.model_path,
            "host": self.config.host,
            "port": self.config.port,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "quantization": self.config.quantization,
            "random_seed": self.config.seed,
            "max_running_requests": self.config.max_running_requests,
            "context_length": self.context_length,
            "runner": type(self.runner).__name__,
            "kv_cache_bytes": self.runner.kv_bytes(),
            "cuda_graph_captures": self.runner.graph_captures,
            "tp_size": 1,
            "dp_size": 1,
            "weight_version": self.weight_version,
            "paused": self.scheduler.paused_mode,
            "memory_released": sorted(self.scheduler.released_tags),
            "internal_states": [{
                "num_running_reqs": load["running"],
                "num_waiting_reqs": load["waiting"],
                "num_finished_reqs": self.scheduler.finished_requests,
                "num_generated_tokens": self.scheduler.generated_tokens,
            }],
        }

    def get_load(self) -> list[dict[str, int]]:
        """The shape sglang-router sums over: one entry per data-parallel rank with `num_tokens`."""
        load = self.scheduler.load()
        return [{"dp_rank": 0, "num_reqs": load["running"] + load["waiting"], "num_waiting_reqs": load["waiting"],
                 "num_tokens": load["kv_tokens"]}]

    def loads(self) -> dict[str, Any]:
        load = self.scheduler.load()
        now = time.time()
        rank = {
            "dp_rank": 0,
            "timestamp": now,
            "num_running_reqs": load["running"],
            "num_waiting_reqs": load["waiting"],
            "num_used_tokens": load["kv_tokens"],
            "num_total_tokens": load["kv_tokens"],
            "max_running_requests": self.config.max_running_requests,
            "gen_throughput": self.scheduler.generated_tokens / max(now - self._started_at, 1e-9),
        }
        return {"timestamp": now, "version": _package_version(), "dp_rank_count": 1, "loads": [rank]}


def _load_fp8_checkpoint(path: str, dtype: torch.dtype, remote: dict) -> torch.nn.Module:
    """The model of a block-fp8 checkpoint (rlkube_runtime/fp8_checkpoint.py) with its weights
    dequantized into `dtype`: transformers' own fp8 loader needs a GPU and fp8 kernels."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(path, **remote)
    del hf_config.quantization_config
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **remote)
    missing, unexpected = model.load_state_dict(fp8_checkpoint.read_dequantized(path), strict=False)
    model.tie_weights()
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise fp8_checkpoint.Fp8CheckpointError(
            f"{path}: its weights do not fit its config.json's model (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})")
    return model


def _quantize_dequantize(model: torch.nn.Module) -> int:
    """The checkpoint's weights as fp8 serves them: each quantized name's weight replaced by its
    blockwise e4m3 quantize-dequantize (rlkube_runtime/fp8.py), so the first rollout (weight
    version 0) is generated at the precision of every later one. Returns how many changed."""
    from rlkube_runtime.expert_names import per_expert_views
    from rlkube_runtime.memory import unique_named_tensors
    from rlkube_runtime import fp8

    changed = 0
    with torch.no_grad():
        for name, tensor in per_expert_views(unique_named_tensors(model)):
            if tensor.is_floating_point() and fp8.is_quantized_name(name, tensor.shape):
                tensor.copy_(fp8.quantize_dequantize(tensor))
                changed += 1
    return changed


def _make_runner(model: torch.nn.Module, config: EngineConfig, pad_token_id: int):
    """SlotRunner where it can run the model (or where asked), else the generic HFRunner."""
    if config.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {config.runner!r}")
    reason = unsupported_reason(model)
    if config.return_routed_experts and config.runner == "slot":
        raise ValueError("--enable-return-routed-experts reads a mixture of experts' routers, which the generic "
                         "runner runs; use runner 'hf' or 'auto'")
    if config.runner == "hf" or (config.runner == "auto" and reason is not None) or config.return_routed_experts:
        if reason is not None:
            log.info("generic runner (transformers forward, no CUDA graphs): %s", reason)
        return HFRunner(model, max_rows=config.max_running_requests, pad_token_id=pad_token_id,
                        record_routes=config.return_routed_experts)
    if reason is not None:
        raise ValueError(f"runner 'slot' cannot run {config.model_path}: {reason}; use runner 'hf' or 'auto'")
    runner = SlotRunner(
        model,
        max_rows=config.max_running_requests,
        kv_budget_bytes=0,
        cuda_graphs=config.cuda_graphs,
        compile_kernels=config.torch_compile,
    )
    runner.kv_budget_bytes = _kv_budget_bytes(config, runner.bytes_per_slot, runner.device)
    return runner


def _kv_budget_bytes(config: EngineConfig, bytes_per_slot: int, device: torch.device) -> int:
    """The KV cache's memory limit: max_total_tokens slots if given; on a GPU, the memory share
    minus what the weights already hold; on a CPU, a fixed 4 GiB."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens * bytes_per_slot
    if device.type != "cuda":
        return CPU_KV_BUDGET_BYTES
    if not 0.0 < config.mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {config.mem_fraction_static}")
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(config.mem_fraction_static * total) - torch.cuda.memory_allocated(device))


def _eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _package_version() -> str:
    from rlkube_runtime import __version__

    return __version__

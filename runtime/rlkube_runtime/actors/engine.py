"""A Ray actor that owns one rollout engine process on the node (and GPUs) of its bundle.

The actor exists for placement: Ray puts it in the engine's bundle, so the server it starts (a
SGLang server or the built-in engine) runs on that pod with that bundle's GPUs. Restarting an
engine is killing the process and starting a new one here, on a fresh port. An engine over
several nodes has one actor per node, each running that node's SGLang server (actors/engine_group.py).
"""

from __future__ import annotations

import os
from typing import Any

from rlkube_runtime.serving.sglang_args import EngineNode
from rlkube_runtime.spec import RLJobSpec
from rlkube_runtime.weight_sync.plan import engine_dtype, rollout_quantization


def engine_actor_options(
    spec: RLJobSpec, index: int, *, model_path: str, log_dir: str, device: str, gpu_ids: tuple[int, ...] = (),
    fp8_model_dir: str | None = None, node_rank: int = 0,
) -> dict[str, Any]:
    """The `EngineActor` arguments of engine `index` of a job (of its node `node_rank` when the
    engine spans rollout.nodesPerEngine nodes), read from its spec in one place:
    the rollout manager starts its engines with them, and the README's and the conformance
    test's SGLang lines come from them too, so those show what production runs. `fp8_model_dir`:
    where an fp8 rollout's engines find (the first to start writes) their block-fp8 checkpoint."""
    rollout = spec.rollout
    quantization = rollout_quantization(spec.model.rollout_dtype)
    if quantization == "fp8" and not fp8_model_dir:
        raise ValueError("model.rolloutDtype fp8: the engines start from a block-fp8 copy of the model, "
                         "and no directory for it (fp8_model_dir) was given")
    return {
        "engine": rollout.engine,
        "model_path": model_path,
        "log_dir": log_dir,
        "name": f"engine-{index}" if node_rank == 0 else f"engine-{index}-node-{node_rank}",
        "seed": spec.training.seed + index,  # each engine its own sampling streams, as slime's seed + rank
        "device": device,
        "gpus_per_engine": rollout.gpus_per_engine,  # the tensor-parallel size, over all of its nodes
        "dtype": engine_dtype(spec.model.dtype, device),
        "colocated": spec.resources.placement == "colocated",
        "trust_remote_code": spec.model.trust_remote_code,
        "sglang_args": dict(rollout.sglang_args),
        "quantization": quantization,
        "fp8_model_dir": fp8_model_dir if quantization == "fp8" else None,
        "gpu_ids": tuple(gpu_ids),  # empty: the GPUs Ray gives the actor
        "return_routed_experts": spec.training.routing_replay,
        "lora_rank": spec.training.lora.rank if spec.training.lora else None,
        "lora_target_modules": tuple(spec.training.lora.target_modules) if spec.training.lora else (),
    }


class EngineActor:
    def __init__(
        self,
        *,
        engine: str,
        model_path: str,
        log_dir: str,
        name: str,
        seed: int,
        device: str,
        gpus_per_engine: int = 1,
        dtype: str = "float32",
        colocated: bool = False,
        trust_remote_code: bool = False,
        sglang_args: dict[str, Any] | None = None,
        host: str | None = None,
        gpu_ids: tuple[int, ...] = (),
        quantization: str | None = None,
        fp8_model_dir: str | None = None,
        return_routed_experts: bool = False,
        lora_rank: int | None = None,
        lora_target_modules: tuple[str, ...] = (),
    ):
        self.engine = engine
        self.model_path = model_path
        self.log_dir = log_dir
        self.name = name
        self.seed = seed
        self.device = device
        self.gpus_per_engine = gpus_per_engine
        self.dtype = dtype
        self.colocated = colocated
        self.trust_remote_code = trust_remote_code
        self.sglang_args = sglang_args or {}
        self.host = host  # None: this node's IP, found when the engine starts
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        if quantization == "fp8" and not fp8_model_dir:
            raise ValueError("quantization fp8 needs fp8_model_dir (where the block-fp8 checkpoint is written)")
        # "fp8": both engines start from a block-fp8 copy of model_path (rlkube_runtime/fp8_checkpoint.py),
        # which the first engine to start writes into fp8_model_dir.
        self.quantization, self.fp8_model_dir = quantization, fp8_model_dir
        self.gpu_ids = tuple(gpu_ids)  # colocated engines over several GPUs: all of them, by id
        self.return_routed_experts = return_routed_experts  # rollout routing replay
        self.lora_rank, self.lora_target_modules = lora_rank, tuple(lora_target_modules)  # spec.training.lora
        self._process = None
        self._restarts = 0

    def launch_options(self, node: EngineNode = EngineNode()) -> dict[str, Any]:
        """The `start_engine` arguments of this engine's next start (no process is started), as
        `node` of its engine (the default: an engine of one node)."""
        from rlkube_runtime.serving.launch import node_ip

        engine_args: dict[str, Any] = {}
        if self.engine == "builtin" and self.device == "cpu":
            # The engine shares the machine with the trainer: one thread each keeps them from
            # fighting over the cores.
            engine_args["num-threads"] = 1
        return {
            "kind": self.engine,
            "model_path": self.served_model_path,
            "log_dir": self.log_dir,
            "name": f"{self.name}-{self._restarts}",
            "seed": self.seed,
            "device": self.device,
            "tp_size": self.gpus_per_engine,
            "host": self.host or node_ip(),
            "dtype": self.dtype,
            "colocated": self.colocated,
            "trust_remote_code": self.trust_remote_code,
            "sglang_args": self.sglang_args,
            "engine_args": engine_args,
            "gpu_ids": self.gpu_ids or _ray_gpu_ids(),
            "return_routed_experts": self.return_routed_experts,
            "lora_rank": self.lora_rank,
            "lora_target_modules": self.lora_target_modules,
            "node": node,
        }

    @property
    def served_model_path(self) -> str:
        """The directory the engine loads: the block-fp8 copy for an fp8 rollout (SGLang and the
        built-in engine both read its quantization from its config.json), else the model."""
        return self.fp8_model_dir if self.quantization == "fp8" else self.model_path

    def start(self, node: EngineNode = EngineNode()) -> str:
        """Start the engine's process (as `node` of a multi-node engine) and return its URL once
        it is ready: the engine's for node 0, a health-only one for the other nodes."""
        from rlkube_runtime.serving.launch import start_engine

        if self.quantization == "fp8":
            from rlkube_runtime.fp8_checkpoint import write_fp8_checkpoint

            write_fp8_checkpoint(self.model_path, self.fp8_model_dir)  # kept when already made from it
        self._process = start_engine(**self.launch_options(node))
        return self._process.url

    def restart(self, node: EngineNode = EngineNode()) -> str:
        self.stop()
        self._restarts += 1
        return self.start(node)

    def dist_init_address(self) -> str:
        """`host:port` where the nodes of this actor's engine meet (SGLang's --dist-init-addr):
        this node's IP and a port free on it; asked of node 0 before each start of the engine."""
        from rlkube_runtime.serving.launch import free_port, node_ip

        host = self.host or node_ip()
        return f"{host}:{free_port(host)}"

    def alive(self) -> bool:
        """Whether the engine process is running (a node other than 0 has no health check of its
        own that covers the engine; its process ending means the engine is broken)."""
        return self._process is not None and self._process.alive()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid


def _ray_gpu_ids() -> list[int]:
    """The GPUs Ray gave this actor; outside Ray (tests), those CUDA_VISIBLE_DEVICES names.

    `ray.get_gpu_ids()` would start a whole local Ray when none is running: ask only inside one."""
    try:
        import ray

        if ray.is_initialized():
            return [int(i) for i in ray.get_gpu_ids()]
    except Exception:  # a worker without GPU bookkeeping: fall back to the environment
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(i) for i in visible.split(",") if i.strip().isdigit()]


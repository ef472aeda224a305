"""The SGLang server's command-line arguments, derived from the job the way slime derives them.

Pure: typed values in, a flag list out; no I/O, no Ray, no ports picked here (the launcher picks
them and passes them in). One function builds the line so the rollout manager, the README's
examples and the conformance test against SGLang's own argument parser
(tests/unit/engine/test_sglang_conformance.py) all see the very same flags.

The pinned pair lives here too: `SGLANG_VERSION` is the server whose flags and HTTP API rlkube
speaks (the rollout image's base tag and the `sglang` extra), `SGLANG_ROUTER_VERSION` the router
whose `/workers` API the launcher drives. tests/unit/engine/test_sglang_pins.py fails when
pyproject.toml or Dockerfile.rollout says otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from rlkube_runtime.spec.rollout import MANAGED_SGLANG_FLAGS as MANAGED_FLAGS

# SGLang 0.5.8 (2026-01-23) is the first release after sglang-router 0.3.2 (built 2026-01-15), so
# its image carries that router; its server_args has every flag below and its HTTP server the
# endpoints the runtime calls (/health_generate, /flush_cache, /update_weights_from_distributed,
# /update_weights_from_tensor, /pause_generation, /get_weight_version, ...).
SGLANG_VERSION = "0.5.8"
SGLANG_ROUTER_VERSION = "0.3.2"

# Colocated engines share each GPU with a trainer rank: leave it room (slime's colocated scripts
# use 0.7 too). Separate engines keep SGLang's own default, sized for a GPU of their own.
COLOCATED_MEM_FRACTION_STATIC = 0.7

# `--dtype` values SGLang 0.5.8 accepts.
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# Other spellings SGLang's parser takes for the same field: folded so a flag appears once.
FLAG_ALIASES = {"tensor-parallel-size": "tp-size", "nccl-init-addr": "dist-init-addr"}

ArgValue = str | int | float | bool | None | Sequence[str | int | float]


@dataclasses.dataclass(frozen=True)
class EngineNode:
    """Which node of its engine one SGLang server process is (one process per node).

    An engine of more GPUs than one pod has runs as `nnodes` servers, one per pod, that meet at
    `dist_init_addr` (host:port of node 0); only node 0 serves HTTP for the whole engine.
    """

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None


@dataclasses.dataclass(frozen=True)
class SGLangServerConfig:
    """What the SGLang line depends on; each field comes from the spec, the topology or the launcher."""

    model_path: str
    host: str
    port: int
    tp_size: int  # rollout.gpusPerEngine
    seed: int  # training.seed + the engine's index
    dtype: str  # the engine dtype (weight_sync.plan.engine_dtype of model.dtype)
    colocated: bool = False  # resources.placement == colocated
    trust_remote_code: bool = False  # rollout.trustRemoteCode
    nccl_port: int | None = None  # None: SGLang picks one itself
    node: EngineNode = EngineNode()
    base_gpu_id: int | None = None  # None: the first GPU the process sees (CUDA_VISIBLE_DEVICES is narrowed)
    user_args: Mapping[str, ArgValue] = dataclasses.field(default_factory=dict)  # rollout.sglangArgs
    api_key: str | None = None  # the job's API key (RLKUBE_API_KEY): required of every caller but health checks
    return_routed_experts: bool = False  # spec.training.routingReplay: generate responses carry every token's experts
    lora_rank: int | None = None  # spec.training.lora.rank: adapters may be loaded (None: LoRA off)
    lora_target_modules: tuple[str, ...] = ()  # spec.training.lora.targetModules


def sglang_server_args(config: SGLangServerConfig) -> list[str]:
    """The arguments of `python -m sglang.launch_server`: rlkube's derived flags, then the user's
    `sglangArgs` last. Each flag appears once: a user value replaces a derived flag of the same
    name (`false` drops a derived bare flag such as `skip-server-warmup`), since argparse would
    otherwise keep whichever came last without a word."""
    user = _normalised_user_args(config.user_args)
    derived = {name: value for name, value in derived_flags(config).items() if name not in user}
    return cli_flags({**derived, **user})


def derived_flags(config: SGLangServerConfig) -> dict[str, ArgValue]:
    """rlkube's own flags, in the order they appear on the line."""
    _check_config(config)
    flags: dict[str, ArgValue] = {
        "model-path": config.model_path,
        "host": config.host,
        "port": config.port,
        "nccl-port": config.nccl_port,
        "tp-size": config.tp_size,
        "random-seed": config.seed,
        "dtype": config.dtype,
        "trust-remote-code": config.trust_remote_code,
        # Readiness is /health_generate (a real one-token generation) followed by /flush_cache;
        # SGLang's own warm-up only delays start-up and can time out on a large model.
        "skip-server-warmup": True,
        # SGLang's own series on /metrics (queue, running requests, tokens), which the driver
        # passes through to Prometheus beside rlkube's (serving/engine_metrics.py).
        "enable-metrics": True,
        # Generation and every weight and admin endpoint then need `Authorization: Bearer <key>`.
        "api-key": config.api_key,
        # Rollout routing replay: meta_info.routed_experts for requests with return_routed_experts.
        "enable-return-routed-experts": config.return_routed_experts,
        **lora_flags(config.lora_rank, config.lora_target_modules),
    }
    if config.colocated:
        # Colocated engines hand their GPU memory to the trainer between rollouts
        # (/release_memory_occupation), which needs SGLang's memory saver.
        flags["enable-memory-saver"] = True
        flags["mem-fraction-static"] = COLOCATED_MEM_FRACTION_STATIC
    if config.base_gpu_id is not None:
        flags["base-gpu-id"] = config.base_gpu_id
    flags.update(_node_flags(config.node))
    return flags


def lora_flags(rank: int | None, target_modules: Sequence[str]) -> dict[str, ArgValue]:
    """The flags that let an engine load spec.training.lora's adapter (SGLang's, which the
    built-in engine takes too): SGLang sizes its adapter memory pool from the rank and layers."""
    if rank is None:
        return {}
    return {"enable-lora": True, "max-lora-rank": rank, "lora-target-modules": list(target_modules)}


def engine_nodes(nnodes: int, dist_init_addr: str) -> list[EngineNode]:
    """One `EngineNode` per node of an engine over `nnodes` nodes (spec.rollout.nodesPerEngine),
    meeting at `dist_init_addr` (node 0's IP and a free port there: SGLang's torch.distributed
    rendezvous); a single node without multi-node flags when `nnodes` is 1."""
    if nnodes < 1:
        raise ValueError(f"spec.rollout.nodesPerEngine must be at least 1, got {nnodes}")
    if nnodes == 1:
        return [EngineNode()]
    return [EngineNode(nnodes=nnodes, node_rank=rank, dist_init_addr=dist_init_addr) for rank in range(nnodes)]


def cli_flags(args: Mapping[str, ArgValue]) -> list[str]:
    """`{"tp_size": 2, "enable-x": True, "off": False, "urls": ["a", "b"]}` →
    `--tp-size 2 --enable-x --urls a b` (underscores become dashes; False/None are left out).
    A value that starts with a dash is joined to its flag (`--api-key=-k3y`): argparse takes a
    separate one for the next option and fails with "expected one argument" (a generated key
    starts with one once in 64)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + flag_name(key)
        if value is True:
            flags.append(flag)
        elif value is None or value is False:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif str(value).startswith("-"):
            flags.append(f"{flag}={value}")
        else:
            flags += [flag, str(value)]
    return flags


def flag_name(key: str) -> str:
    """A flag's canonical spelling: no leading dashes, dashes for underscores."""
    return key.lstrip("-").replace("_", "-")


# ---- helpers -------------------------------------------------------------------------------


def _check_config(config: SGLangServerConfig) -> None:
    if config.tp_size < 1:
        raise ValueError(f"spec.rollout.gpusPerEngine must be at least 1 for an SGLang engine, got {config.tp_size}")
    if config.dtype not in SGLANG_DTYPES:
        raise ValueError(f"engine dtype {config.dtype!r} is not one SGLang takes; it takes {list(SGLANG_DTYPES)}")
    node = config.node
    if not 0 <= node.node_rank < node.nnodes:
        raise ValueError(f"node_rank {node.node_rank} must be in [0, nnodes={node.nnodes})")
    if node.nnodes > 1 and not node.dist_init_addr:
        raise ValueError(f"an engine over {node.nnodes} nodes needs dist_init_addr (host:port of node 0)")
    if node.nnodes > 1 and config.tp_size % node.nnodes:
        raise ValueError(f"spec.rollout.gpusPerEngine({config.tp_size}) must split evenly over {node.nnodes} nodes")


def _node_flags(node: EngineNode) -> dict[str, ArgValue]:
    if node.nnodes == 1:
        return {}
    return {"nnodes": node.nnodes, "node-rank": node.node_rank, "dist-init-addr": node.dist_init_addr}


def _normalised_user_args(user_args: Mapping[str, ArgValue]) -> dict[str, ArgValue]:
    """`sglangArgs` under canonical flag names; refuses managed flags and a flag given twice."""
    normalised: dict[str, ArgValue] = {}
    for key, value in user_args.items():
        name = flag_name(key)
        name = FLAG_ALIASES.get(name, name)
        if name in MANAGED_FLAGS:
            raise ValueError(
                f"spec.rollout.sglangArgs.{key}: rlkube sets --{name} itself (from {MANAGED_FLAGS[name]}); "
                "remove it from sglangArgs"
            )
        if name in normalised:
            raise ValueError(f"spec.rollout.sglangArgs.{key}: --{name} is given twice (spelled differently); keep one")
        normalised[name] = value
    return normalised

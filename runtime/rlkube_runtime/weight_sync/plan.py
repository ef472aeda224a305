"""Which trainer rank sends the weights to which engine, by which transport, in which dtype and
buckets: decided once, from the spec and the topology, before any actor starts."""

from __future__ import annotations

from dataclasses import dataclass

# "adapter": spec.training.lora's adapter alone, a peft directory where `disk` writes its HF
# directories, loaded with /load_lora_adapter (what auto and disk resolve to under LoRA).
TRANSPORTS = ("tensor", "distributed", "http", "disk", "adapter")


@dataclass(frozen=True)
class SyncPlan:
    """pusher_of_engine[j]: the trainer rank that pushes to engine j (for `tensor` the rank on
    the engine's first GPU, otherwise rank 0). disk_dir: where the `disk` transport writes its
    HF directories (storage every engine reads). dtype: what the engines hold and the tensors
    travel in (`engine_dtype`). bucket_bytes: the most tensor bytes of one bucket
    (spec.training.updateWeightBufferMb). engine_ranks: an engine's GPUs (tensor-parallel
    ranks), each a member of a `distributed` group. handle_ranks[j]: for `tensor` into engines
    over several GPUs, the trainer ranks on engine j's GPUs in its tensor-parallel order (the
    first is its pusher); each stages its GPU's payload (`handle_group.HandleGroup`).
    quantization: None, or "fp8" (spec.model.rolloutDtype fp8): the decoder layers' linear weights
    travel as block-quantized e4m3 with their scales (rlkube_runtime/fp8.py)."""

    pusher_of_engine: tuple[int, ...] = ()
    transport: str = "http"
    disk_dir: str | None = None
    dtype: str = "float32"
    bucket_bytes: int = 128 << 20
    engine_ranks: int = 1
    handle_ranks: tuple[tuple[int, ...], ...] = ()
    quantization: str | None = None

    @property
    def pushing_ranks(self) -> frozenset[int]:
        """Every rank that takes part in a push (and so needs the whole model staged)."""
        return frozenset(self.pusher_of_engine).union(*self.handle_ranks)

    def by_pusher(self, engines: list[int]) -> dict[int, list[int]]:
        """{trainer rank: the engines among `engines` it pushes to (or stages payloads for)}, in
        engine order."""
        groups: dict[int, list[int]] = {}
        for j in engines:
            for rank in self.handle_ranks[j] if self.handle_ranks else (self.pusher_of_engine[j],):
                groups.setdefault(rank, []).append(j)
        return groups

    def handle_group_of(self, rank: int) -> tuple[int, int, int] | None:
        """(engine, position, size) of `rank` among the ranks staging payloads for one engine,
        or None where each engine takes one rank's payload."""
        for j, ranks in enumerate(self.handle_ranks):
            if rank in ranks:
                return j, ranks.index(rank), len(ranks)
        return None


def plan_sync(spec, topology, *, disk_dir: str | None = None) -> SyncPlan:
    """The plan for `spec` (an RLJobSpec) on `topology` (a topology.Topology): the transport
    `spec.training.updateWeightsTransport` resolves to there, and each engine's pushing rank."""
    transport = "adapter" if spec.training.lora is not None else weight_sync_transport(
        spec.training.update_weights_transport,
        placement=topology.placement,
        device=topology.device,
        engine=spec.rollout.engine,
        gpus_per_engine=spec.rollout.gpus_per_engine,
    )
    engine_ranks = spec.rollout.gpus_per_engine if topology.device == "cuda" else 1
    owners = []
    for bundle in topology.engine_bundles:
        shares = transport == "tensor" and bundle in topology.trainer_bundles
        owners.append(topology.trainer_bundles.index(bundle) if shares else 0)
    handle_ranks = ()
    if transport == "tensor" and engine_ranks > 1:
        # topology.colocated_engine_gpus: engine j is on the GPUs of the ranks from its first on.
        handle_ranks = tuple(tuple(range(first, first + engine_ranks)) for first in owners)
    return SyncPlan(
        tuple(owners), transport, disk_dir,
        dtype=engine_dtype(spec.model.dtype, topology.device),
        bucket_bytes=spec.training.update_weight_buffer_mb << 20,
        engine_ranks=engine_ranks,
        handle_ranks=handle_ranks,
        quantization=rollout_quantization(spec.model.rollout_dtype),
    )


def rollout_quantization(rollout_dtype: str) -> str | None:
    """What the engines' weights are quantized to for spec.model.rolloutDtype: None (bf16: the
    engine dtype itself) or "fp8"."""
    return "fp8" if rollout_dtype == "fp8" else None


def engine_dtype(model_dtype: str, device: str) -> str:
    """The dtype rollout engines hold the weights in (and weight syncs send): the training dtype
    on a GPU; float32 on a CPU, where bf16 kernels are slow and the trainer computes in float32."""
    return model_dtype if device == "cuda" else "float32"


def weight_sync_transport(requested: str, *, placement: str, device: str, engine: str, gpus_per_engine: int) -> str:
    """The transport `spec.training.updateWeightsTransport` resolves to on this topology; raises
    ValueError naming the field when the requested one cannot work here."""
    field = "spec.training.updateWeightsTransport"
    if requested == "auto":
        # Colocated: the trainer ranks share the engines' GPUs (an engine over several takes a
        # payload from each of its GPUs' ranks), so the weights stay in GPU memory.
        return "tensor" if placement == "colocated" else "distributed"
    if requested == "http" and engine != "builtin":
        raise ValueError(f"{field}: 'http' sends rlkube_safetensors bytes, which only the built-in engine reads; "
                         f"rollout.engine is {engine!r}: use 'distributed', 'tensor' or 'disk'")
    if requested == "tensor" and placement != "colocated" and (device == "cuda" or gpus_per_engine > 1):
        raise ValueError(f"{field}: 'tensor' passes CUDA IPC handles, so each engine must share its GPUs with "
                         f"trainer ranks (placement colocated); this job has placement {placement!r}: use "
                         "'distributed' or 'disk'")
    if requested == "distributed" and device == "cuda" and placement == "colocated":
        raise ValueError(f"{field}: 'distributed' needs the engines on GPUs of their own (NCCL cannot pair two ranks "
                         "on one GPU); with placement colocated use 'tensor' or 'disk'")
    return requested

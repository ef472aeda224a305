"""Which trainer rank sends the weights to which engine, by which transport, in which dtype and
buckets: decided once, from the spec and the topology, before any actor starts."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("tensor", "distributed", "http", "disk")


@dataclass(frozen=True)
class SyncPlan:
    """pusher_of_engine[j]: the trainer rank that pushes to engine j (for `tensor` the rank on
    the engine's GPU, otherwise rank 0). disk_dir: where the `disk` transport writes its HF
    directories (storage every engine reads). dtype: what the engines hold and the tensors
    travel in (`engine_dtype`). bucket_bytes: the most tensor bytes of one bucket
    (spec.training.updateWeightBufferMb). engine_ranks: an engine's GPUs (tensor-parallel
    ranks), each a member of a `distributed` group."""

    pusher_of_engine: tuple[int, ...] = ()
    transport: str = "http"
    disk_dir: str | None = None
    dtype: str = "float32"
    bucket_bytes: int = 128 << 20
    engine_ranks: int = 1

    @property
    def pushing_ranks(self) -> frozenset[int]:
        return frozenset(self.pusher_of_engine)

    def by_pusher(self, engines: list[int]) -> dict[int, list[int]]:
        """{trainer rank: the engines among `engines` it pushes to}, in engine order."""
        groups: dict[int, list[int]] = {}
        for j in engines:
            groups.setdefault(self.pusher_of_engine[j], []).append(j)
        return groups


def plan_sync(spec, topology, *, disk_dir: str | None = None) -> SyncPlan:
    """The plan for `spec` (an RLJobSpec) on `topology` (a topology.Topology): the transport
    `spec.training.updateWeightsTransport` resolves to there, and each engine's pushing rank."""
    transport = weight_sync_transport(
        spec.training.update_weights_transport,
        placement=topology.placement,
        device=topology.device,
        engine=spec.rollout.engine,
        gpus_per_engine=spec.rollout.gpus_per_engine,
    )
    owners = []
    for bundle in topology.engine_bundles:
        shares = transport == "tensor" and bundle in topology.trainer_bundles
        owners.append(topology.trainer_bundles.index(bundle) if shares else 0)
    return SyncPlan(
        tuple(owners), transport, disk_dir,
        dtype=engine_dtype(spec.model.dtype, topology.device),
        bucket_bytes=spec.training.update_weight_buffer_mb << 20,
        engine_ranks=spec.rollout.gpus_per_engine if topology.device == "cuda" else 1,
    )


def engine_dtype(model_dtype: str, device: str) -> str:
    """The dtype rollout engines hold the weights in (and weight syncs send): the training dtype
    on a GPU; float32 on a CPU, where bf16 kernels are slow and the trainer computes in float32."""
    return model_dtype if device == "cuda" else "float32"


def weight_sync_transport(requested: str, *, placement: str, device: str, engine: str, gpus_per_engine: int) -> str:
    """The transport `spec.training.updateWeightsTransport` resolves to on this topology; raises
    ValueError naming the field when the requested one cannot work here."""
    field = "spec.training.updateWeightsTransport"
    if requested == "auto":
        if placement == "colocated":
            # One trainer rank shares each engine's GPU; an engine over several GPUs needs each
            # GPU's handles, which a single rank cannot give: it loads from disk instead.
            return "tensor" if gpus_per_engine <= 1 else "disk"
        return "distributed"
    if requested == "http" and engine != "builtin":
        raise ValueError(f"{field}: 'http' sends rlkube_safetensors bytes, which only the built-in engine reads; "
                         f"rollout.engine is {engine!r}: use 'distributed', 'tensor' or 'disk'")
    if requested == "tensor" and (gpus_per_engine > 1 or (device == "cuda" and placement != "colocated")):
        raise ValueError(f"{field}: 'tensor' passes CUDA IPC handles, so each engine must sit on one GPU it shares "
                         f"with a trainer rank (placement colocated, gpusPerEngine 1); this job has placement "
                         f"{placement!r} and gpusPerEngine {gpus_per_engine}: use 'distributed' or 'disk'")
    if requested == "distributed" and device == "cuda" and placement == "colocated":
        raise ValueError(f"{field}: 'distributed' needs the engines on GPUs of their own (NCCL cannot pair two ranks "
                         "on one GPU); with placement colocated use 'tensor' or 'disk'")
    return requested

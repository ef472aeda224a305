"""How many trainer ranks and rollout engines a job gets, and which Ray bundle each one lands in.

Pure: the same spec and the same visible devices always give the same plan, so the operator's
rendering (how many GPUs each pod asks for) and the runtime's placement agree by construction.

- separate:  trainer ranks own `nodes x gpusPerNode` GPUs; engines own `rollout.gpus` others, an
             engine over `rollout.nodesPerEngine` nodes a bundle per node (one SGLang server each).
- colocated: engines share the trainer's GPUs; the trainer and the engines release memory in turn.
On a machine without GPUs (the embedded default) the job runs one trainer rank and one engine,
each with a share of the CPUs, whatever the GPU counts in the spec say. A cluster of CPU pods
(the operator's layout, `pod_resources`) gets one trainer rank per trainer pod and the engines the
spec's rollout GPUs would make.

Inside a KubeRay cluster the operator labels pods with Ray custom resources (`rlkube_trainer` on
trainer pods, `rlkube_rollout` on rollout pods and `rlkube_router` on the head; all three on
colocated trainer pods);
with `pod_resources` the bundles ask for them, so each actor lands on a pod of its own group.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkube_runtime.spec.contract import ROLLOUT_RESOURCE, ROUTER_RESOURCE, TRAINER_RESOURCE  # the operator's pod groups


@dataclass(frozen=True)
class Topology:
    device: str  # "cuda" or "cpu"
    placement: str  # "separate" or "colocated"
    trainer_world_size: int
    num_engines: int
    gpus_per_engine: int
    # One Ray bundle per entry; trainer rank i sits in bundle trainer_bundles[i],
    # engine j in engine_bundles[j] (the same bundles as the trainer when colocated).
    bundles: tuple[dict[str, float], ...]
    trainer_bundles: tuple[int, ...]
    engine_bundles: tuple[int, ...]
    # Engine j's bundle per node, node 0 (engine_bundles[j], the one serving HTTP) first; one each
    # unless an engine spans nodes.
    engine_node_bundles: tuple[tuple[int, ...], ...]
    # Resources each actor asks for inside its bundle.
    trainer_actor_resources: dict[str, float]
    engine_actor_resources: dict[str, float]


def plan_topology(
    *,
    placement: str,
    trainer_nodes: int,
    trainer_gpus_per_node: int,
    rollout_gpus: int,
    gpus_per_engine: int,
    visible_gpus: int,
    cpus: int,
    pod_resources: bool = False,
    nodes_per_engine: int = 1,
) -> Topology:
    if visible_gpus == 0:
        if pod_resources:
            return _cpu_pod_plan(placement, trainer_nodes, max(1, rollout_gpus // max(gpus_per_engine, 1)))
        return _cpu_plan(placement, cpus)
    trainer_gpus = trainer_nodes * trainer_gpus_per_node
    if trainer_gpus < 1:
        raise ValueError(
            "spec.resources.trainer: nodes x gpusPerNode must be at least 1 on a machine with GPUs, "
            f"got {trainer_nodes} x {trainer_gpus_per_node}"
        )
    if placement == "colocated":
        engine_gpus = trainer_gpus
    else:
        engine_gpus = rollout_gpus
    if engine_gpus < gpus_per_engine or engine_gpus % gpus_per_engine:
        raise ValueError(
            f"spec.rollout.gpusPerEngine: {engine_gpus} rollout GPUs cannot be split into engines of "
            f"{gpus_per_engine} GPUs each; make the GPU count a multiple of gpusPerEngine"
        )
    needed = trainer_gpus if placement == "colocated" else trainer_gpus + engine_gpus
    if needed > visible_gpus:
        raise ValueError(
            f"spec.resources: the job needs {needed} GPUs ({placement} placement) but Ray sees {visible_gpus}"
        )
    num_engines = engine_gpus // gpus_per_engine
    if nodes_per_engine > 1 and (placement == "colocated" or gpus_per_engine % nodes_per_engine):
        raise ValueError(
            f"spec.rollout.nodesPerEngine({nodes_per_engine}): an engine spans nodes only in separate placement and "
            f"with gpusPerEngine({gpus_per_engine}) a multiple of it"
        )
    trainer_tag = {TRAINER_RESOURCE: 1.0} if pod_resources else {}
    if placement == "colocated":
        bundles = tuple({"GPU": 1.0, "CPU": 1.0, **trainer_tag} for _ in range(trainer_gpus))
        trainer_bundles = tuple(range(trainer_gpus))
        engine_bundles = tuple(j * gpus_per_engine for j in range(num_engines))
        node_bundles = tuple((b,) for b in engine_bundles)
        # Fractions so a trainer rank and an engine fit on the same GPU bundle.
        trainer_res = {"GPU": 0.4, "CPU": 0.4}
        engine_res = {"GPU": 0.2, "CPU": 0.2}
    else:
        per_node = gpus_per_engine // nodes_per_engine
        rollout_tag = {ROLLOUT_RESOURCE: float(per_node)} if pod_resources else {}
        bundles = tuple({"GPU": 1.0, "CPU": 1.0, **trainer_tag} for _ in range(trainer_gpus)) + tuple(
            {"GPU": float(per_node), "CPU": 1.0, **rollout_tag} for _ in range(num_engines * nodes_per_engine)
        )
        trainer_bundles = tuple(range(trainer_gpus))
        node_bundles = tuple(
            tuple(trainer_gpus + j * nodes_per_engine + k for k in range(nodes_per_engine)) for j in range(num_engines)
        )
        engine_bundles = tuple(nodes[0] for nodes in node_bundles)
        trainer_res = {"GPU": 1.0, "CPU": 1.0}
        # The engine actor only launches the SGLang server process; the server takes the GPUs
        # of its bundle through CUDA_VISIBLE_DEVICES.
        engine_res = {"GPU": float(per_node), "CPU": 1.0}
    return Topology(
        device="cuda",
        placement=placement,
        trainer_world_size=trainer_gpus,
        num_engines=num_engines,
        gpus_per_engine=gpus_per_engine,
        bundles=bundles,
        trainer_bundles=trainer_bundles,
        engine_bundles=engine_bundles,
        engine_node_bundles=node_bundles,
        trainer_actor_resources=trainer_res,
        engine_actor_resources=engine_res,
    )


def _cpu_pod_plan(placement: str, trainer_nodes: int, rollout_engines: int) -> Topology:
    """CPU pods laid out as the operator renders them: one trainer rank per trainer pod (gloo),
    and (separate) one engine per rollout pod's worth of `rollout.gpus / gpusPerEngine`, or
    (colocated) one engine beside each rank. Each bundle asks for its pod group's resource."""
    trainer = tuple({"CPU": 1.0, TRAINER_RESOURCE: 1.0} for _ in range(trainer_nodes))
    if placement == "colocated":
        bundles, engine_bundles = trainer, tuple(range(trainer_nodes))
    else:
        bundles = trainer + tuple({"CPU": 1.0, ROLLOUT_RESOURCE: 1.0} for _ in range(rollout_engines))
        engine_bundles = tuple(trainer_nodes + j for j in range(rollout_engines))
    return Topology(
        device="cpu",
        placement=placement,
        trainer_world_size=trainer_nodes,
        num_engines=len(engine_bundles),
        gpus_per_engine=0,
        bundles=bundles,
        trainer_bundles=tuple(range(trainer_nodes)),
        engine_bundles=engine_bundles,
        engine_node_bundles=tuple((b,) for b in engine_bundles),
        trainer_actor_resources={"CPU": 0.5},
        engine_actor_resources={"CPU": 0.5},
    )


def _cpu_plan(placement: str, cpus: int) -> Topology:
    if cpus < 1:
        raise ValueError(f"need at least one CPU, Ray sees {cpus}")
    if placement == "colocated":
        bundles: tuple[dict[str, float], ...] = ({"CPU": 1.0},)
        engine_bundles = (0,)
        trainer_res = {"CPU": 0.5}
        engine_res = {"CPU": 0.5}
    else:
        bundles = ({"CPU": 0.5}, {"CPU": 0.5})
        engine_bundles = (1,)
        trainer_res = {"CPU": 0.5}
        engine_res = {"CPU": 0.5}
    return Topology(
        device="cpu",
        placement=placement,
        trainer_world_size=1,
        num_engines=1,
        gpus_per_engine=0,
        bundles=bundles,
        trainer_bundles=(0,),
        engine_bundles=engine_bundles,
        engine_node_bundles=tuple((b,) for b in engine_bundles),
        trainer_actor_resources=trainer_res,
        engine_actor_resources=engine_res,
    )


def colocated_engine_gpus(trainer_gpus: list[tuple[str, list[int]]], gpus_per_engine: int) -> list[tuple[int, ...]]:
    """The GPUs of each colocated engine: engine j shares the GPUs of trainer ranks
    j*gpusPerEngine .. (j+1)*gpusPerEngine - 1 (one bundle each), given each rank's (node IP,
    Ray GPU ids). Ray shows an actor only its own bundle's GPU, so an engine over several GPUs
    must be given the others by id; they must be on one node."""
    engines = []
    for first in range(0, len(trainer_gpus), gpus_per_engine):
        ranks = trainer_gpus[first : first + gpus_per_engine]
        nodes = sorted({node for node, _ in ranks})
        if len(nodes) > 1:
            raise ValueError(
                f"spec.rollout.gpusPerEngine: colocated engine {first // gpus_per_engine} would share the GPUs of trainer "
                f"ranks {first}..{first + gpus_per_engine - 1}, which Ray placed on different nodes {nodes}; make "
                "resources.trainer.gpusPerNode a multiple of gpusPerEngine"
            )
        engines.append(tuple(gpu for _, gpus in ranks for gpu in gpus))
    return engines

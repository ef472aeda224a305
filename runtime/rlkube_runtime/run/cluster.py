"""Ray and the job's actors: join the KubeRay cluster or start a private Ray, plan the topology
from what Ray sees, and place the trainer ranks and the rollout manager (with its engines) on it."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_fixed

from rlkube_runtime.run.handoff import Handoff
from rlkube_runtime.run.plan import RunError, RunPlan
from rlkube_runtime.run.report import Report


@dataclass
class Job:
    """The running job: its actors, the colocated hand-off between them, and where it reports."""

    plan: RunPlan
    trainers: Any  # TrainerGroup (None when rollout-only)
    rollouts: Any  # RolloutGroup (None when train-only)
    handoff: Handoff
    report: Report
    last_saved: int | None = None  # the rollout of the newest checkpoint this job holds
    last_saved_path: str | None = None  # and its directory

    @property
    def spec(self):
        return self.plan.job.spec


def init_ray() -> str:
    """Join the KubeRay cluster when there is one ("cluster"), else start a private local Ray ("local")."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return "cluster"
    for attempt in Retrying(retry=retry_if_exception(_ray_start_timed_out), stop=stop_after_attempt(LOCAL_RAY_STARTS),
                            wait=wait_fixed(LOCAL_RAY_RETRY_WAIT_S), before_sleep=_shut_down_half_started_ray, reraise=True):
        with attempt:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)
    return "local"


# An fp8 rollout's engines start from this block-fp8 copy of the model, in the job's output
# directory (which the engines' pods share with the trainer's, as the disk transport's weights/).
FP8_MODEL_DIR = "rollout-model-fp8"

# Ray gives its raylet a fixed 30 s to register with the GCS; on a busy machine (two cores, other
# jobs starting) that can pass although nothing is wrong, so a private Ray gets a few tries.
LOCAL_RAY_STARTS = 3
LOCAL_RAY_RETRY_WAIT_S = 2.0


def _ray_start_timed_out(error: BaseException) -> bool:
    return "timed out during startup" in str(error)


def _shut_down_half_started_ray(state) -> None:
    """Ray does not stop the GCS and raylet of a start that timed out (ray.shutdown() knows no node
    then): this process's children that run from Ray's package, with their workers, are stopped."""
    import psutil
    import ray

    print(f"rlkube run: the local Ray did not start within Ray's 30 s (a busy machine?); starting it again "
          f"(try {state.attempt_number + 1} of {LOCAL_RAY_STARTS})", file=sys.stderr, flush=True)
    ray.shutdown()
    package = os.path.dirname(ray.__file__)
    started = [child for child in psutil.Process().children(recursive=True)
               if _runs_from(child, package) or child.name().startswith("ray::")]
    for child in started:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(started, timeout=10)


def _runs_from(process, package: str) -> bool:
    import psutil

    try:
        return any(part.startswith(package) for part in process.cmdline()[:2])
    except psutil.Error:
        return False


def start_job(plan: RunPlan, report: Report) -> Job:
    """Actors placed on the topology, told who pushes weights to which engine; colocated trainers
    start offloaded (the engines generate first)."""
    from rlkube_runtime.weight_sync import plan_sync

    topology = _plan_topology(plan.spec)
    sync = plan_sync(plan.spec, topology, disk_dir=str(plan.output_dir / "weights"))
    trainers, rollouts = _start_actors(plan, topology, sync)
    takes_turns = topology.placement == "colocated" and plan.trains and plan.generates
    job = Job(plan, trainers, rollouts, Handoff(trainers, rollouts, takes_turns=takes_turns), report)
    job.handoff.start()
    if rollouts is not None and trainers is not None:
        rollouts.set_weight_pushers(trainers.handles, sync)
    return job


def _plan_topology(spec):
    import ray

    from rlkube_runtime.spec.contract import TRAINER_RESOURCE
    from rlkube_runtime.topology import plan_topology

    resources = ray.cluster_resources()
    return plan_topology(
        placement=spec.resources.placement,
        trainer_nodes=spec.resources.trainer.nodes,
        trainer_gpus_per_node=spec.resources.trainer.gpus_per_node,
        rollout_gpus=spec.resources.rollout.gpus,
        gpus_per_engine=spec.rollout.gpus_per_engine,
        visible_gpus=int(resources.get("GPU", 0)),
        cpus=int(resources.get("CPU", 1)),
        pod_resources=TRAINER_RESOURCE in resources,
        nodes_per_engine=spec.rollout.nodes_per_engine,
    )


def _start_actors(plan: RunPlan, topology, sync):
    """(TrainerGroup or None, RolloutGroup or None), both ready."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlkube_runtime.actors.engine_pool import PoolConfig
    from rlkube_runtime.actors.rollout_group import RolloutGroup
    from rlkube_runtime.actors.trainer_group import TrainerGroup
    from rlkube_runtime.spec.contract import ROUTER_RESOURCE

    spec_dict = plan.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    group = placement_group(list(topology.bundles), strategy="PACK")
    ray.get(group.ready(), timeout=600)

    def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    trainers = None
    if plan.trains:
        trainers = TrainerGroup.start(spec_dict, model_path=plan.model_path, topology=topology, in_bundle=in_bundle,
                                      sync=sync)
    if not plan.generates:
        trainers.wait_ready()
        return trainers, None
    # The router runs inside the manager's process: on a rollout pod when the operator made some.
    router_pod = {ROUTER_RESOURCE: 0.01} if ROUTER_RESOURCE in ray.cluster_resources() else {}
    engine_gpus = None
    if topology.placement == "colocated" and topology.device == "cuda" and topology.gpus_per_engine > 1:
        # Ray shows each actor its own bundle's GPU only: an engine over several GPUs is given
        # those of the trainer ranks it shares by id (waiting for the ranks to exist).
        from rlkube_runtime.topology import colocated_engine_gpus

        if trainers is None:
            raise RunError(
                "--debug-rollout-only: colocated engines over several GPUs (rollout.gpusPerEngine > 1) take the GPUs "
                "of the trainer ranks they share, and rollout-only starts none; use resources.placement: separate"
            )
        engine_gpus = colocated_engine_gpus(trainers.gpus(), topology.gpus_per_engine)
    pool = PoolConfig(
        model_path=plan.model_path,
        log_dir=str(plan.output_dir / "logs"),
        placement_group=group,
        engine_bundles=tuple(topology.engine_node_bundles),
        engine_resources=dict(topology.engine_actor_resources),
        device=topology.device,
        engine_gpu_ids=tuple(engine_gpus or ()),
        fp8_model_dir=str(plan.output_dir / FP8_MODEL_DIR) if plan.spec.model.rollout_dtype == "fp8" else None,
    )
    rollouts = RolloutGroup.start(spec_dict, pool, resources=router_pod)
    # Engines and trainer ranks load their models at the same time.
    started = rollouts.start_ref()
    if trainers is not None:
        trainers.wait_ready(also=[started])
    else:
        rollouts.wait_started(started)
    return trainers, rollouts

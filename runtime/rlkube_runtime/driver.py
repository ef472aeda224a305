"""`rlkube run`: the training driver. Read top to bottom, it is the loop of DESIGN.md:

    generate -> reward -> filter (rollout manager) -> advantages -> train (trainer ranks)
    -> sync weights -> eval -> checkpoint -> metrics and status

Each phase is one actor call. Locally `ray.init()` starts a private Ray; inside a KubeRay cluster
(RAY_ADDRESS set by the RayJob) the same code joins the existing cluster.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlkube_runtime.spec import RLJob
from rlkube_runtime.spec.load import SpecError, load_rljobs

log = logging.getLogger("rlkube.driver")


# `rlkube run`'s exit code after a SIGTERM (preemption, suspend, node drain) was honoured with a
# checkpoint: 128 + SIGTERM, as a process the signal had ended; the next start resumes.
PREEMPTED_EXIT_CODE = 143


class Preempted(Exception):
    """The run stopped on SIGTERM after saving what it had done."""

    def __init__(self, message: str):
        super().__init__(message)


class RunError(Exception):
    """A problem found before training starts; the message names the field or the file."""


@dataclass(frozen=True)
class RunPlan:
    job: RLJob
    output_dir: Path
    checkpoint_root: Path
    resume_roots: tuple[Path, ...]  # where to look for a checkpoint, newest first
    model_path: str  # HF directory (or hub id) the trainer and the engines start from


def run_from_file(path: str, *, output_dir: str | None = None, resume: bool = True) -> int:
    """The CLI entry: exit 0 on success; a spec or data problem prints one clear error, exit 2."""
    logging.basicConfig(level=os.environ.get("RLKUBE_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    # This process and the actors (they inherit the environment) print one progress line per
    # rollout instead of model-loading bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        plan = prepare_run(path, output_dir=output_dir)
    except (SpecError, RunError) as err:
        print(f"rlkube run: {err}", file=sys.stderr)
        return 2
    try:
        run_job(plan, resume=resume)
    except Preempted as stopped:
        print(f"rlkube run: {stopped} `rlkube run {path}` resumes from it.", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except Exception as err:  # noqa: BLE001 - whatever stopped the run, the user gets its cause first
        # Ray hands an actor's error back wrapped in the actor's traceback: the cause goes to the
        # terminal, the whole traceback to a file.
        cause = getattr(err, "cause", None) or err
        report = plan.output_dir / "logs" / "failure.txt"
        try:
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text("".join(traceback.format_exception(err)), encoding="utf-8")
            full = f"The full error: {report}"
        except OSError as unwritable:  # the cause may be this very disk being full
            full = f"The full error could not be written to {report} ({unwritable.strerror or unwritable})"
        print(
            f"rlkube run: {type(cause).__name__}: {cause}\nThe run stopped; its checkpoints are kept in "
            f"{plan.checkpoint_root} and `rlkube run {path}` resumes from the last one. {full}",
            file=sys.stderr,
        )
        return 1
    return 0


def prepare_run(path: str, *, output_dir: str | None = None) -> RunPlan:
    """Everything that can fail because of the spec or the data, checked before Ray starts."""
    jobs = load_rljobs(path)
    if len(jobs) != 1:
        raise RunError(f"{path}: `rlkube run` takes one RLJob per file, found {len(jobs)}")
    job = jobs[0]
    spec = job.spec
    from rlkube_runtime.train_worker import check_trainer_supports

    try:
        check_trainer_supports(spec)
    except ValueError as err:
        raise RunError(str(err)) from None
    out = Path(output_dir or spec.model.save or Path("runs") / job.metadata.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_path = _initial_model(job, out)
    _check_data(job, model_path)
    checkpoint_root = out / "checkpoints"
    resume_roots = (checkpoint_root,) + ((Path(spec.model.load),) if spec.model.load else ())
    return RunPlan(job, out, checkpoint_root, resume_roots, model_path)


def _initial_model(job: RLJob, out: Path) -> str:
    """The HF checkpoint to start from; the `tiny` preset is built here, seeded, nothing downloaded."""
    model = job.spec.model
    if model.hf_checkpoint:
        return model.hf_checkpoint
    if model.preset == "tiny":
        from rlkube_runtime.spec import builtin_task_name
        from rlkube_runtime.tiny.model import build_tiny_checkpoint
        from rlkube_runtime.tiny.task import get_task

        task = builtin_task_name(job.spec.data.prompt_data)
        alphabet = get_task(task).alphabet if task else None
        target = out / "tiny-model"
        if not (target / "config.json").exists():
            build_tiny_checkpoint(target, alphabet=alphabet, seed=job.spec.training.seed)
        return str(target)
    if model.preset:
        raise RunError(
            f"spec.model.preset: {model.preset!r} has no built-in weights; known presets: ['tiny']. "
            "For a named architecture give spec.model.hfCheckpoint too"
        )
    raise RunError("spec.model: set hfCheckpoint (or preset: tiny); `load` alone has no architecture to start from")


def _check_data(job: RLJob, model_path: str) -> None:
    """Load the prompt set once so a missing file or a bad line stops the run now, not mid-rollout."""
    from rlkube_runtime.data.dataset import DatasetError, load_prompt_dataset_from_spec
    import rlkube_runtime.tiny.task  # noqa: F401  (registers the builtin: prompt sets)

    tokenizer = None
    if job.spec.data.apply_chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=job.spec.model.trust_remote_code)
    try:
        load_prompt_dataset_from_spec(job.spec.data, tokenizer=tokenizer)
        for dataset in job.spec.eval.datasets:
            load_prompt_dataset_from_spec(_eval_data_spec(job, dataset), tokenizer=tokenizer)
    except (DatasetError, FileNotFoundError, OSError) as err:
        raise RunError(f"spec.data.promptData: {err}") from None


def _eval_data_spec(job: RLJob, dataset) -> Any:
    data = job.spec.data
    return data.model_copy(
        update={
            "prompt_data": dataset.path,
            "input_key": dataset.input_key or data.input_key,
            "label_key": dataset.label_key or data.label_key,
        }
    )


@dataclass
class Job:
    """The running job: its actors and where it reports."""

    plan: RunPlan
    trainers: list[Any]  # TrainerWorker handles, rank order
    rollout: Any  # the RolloutManager handle
    # Colocated: trainer and engines take turns with the device memory. On a CPU there is nothing
    # to free, but the turns run the same way, so the local run tests the order a GPU run needs.
    takes_turns: bool
    logger: Any  # MetricsLogger
    reporter: Any  # RLJobStatusReporter, or None outside a cluster
    engine_restarts: int = 0  # the job's total, earlier attempts included
    last_saved: int | None = None  # the rollout of the newest checkpoint this job holds
    pushers: tuple[list[int], str] = ([], "http")  # trainer rank serving engine j; the weight-sync transport

    @property
    def spec(self):
        return self.plan.job.spec


@dataclass(frozen=True)
class JobCheckpoint:
    """What a checkpoint holds beyond the files: written by `_save`, read by `_resume`."""

    trainer: dict[str, Any]  # rank 0's model, optimizer and schedule (the same on every rank)
    trainer_rng: list[Any]  # every rank's random streams, rank order
    data_source: dict[str, Any]  # the prompt position and buffer as of the next rollout's start
    progress: dict[str, int]

    def payload(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "trainer_rng": self.trainer_rng, "data_source": self.data_source,
                "progress": self.progress}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> JobCheckpoint:
        return cls(trainer=payload["trainer"], trainer_rng=payload.get("trainer_rng") or [],
                   data_source=payload["data_source"], progress=payload.get("progress") or {})


def run_job(plan: RunPlan, *, resume: bool = True) -> None:
    """The loop, one call per phase: generate (the rollout manager: prompts, engines, rewards,
    filters) -> train (advantages and optimizer steps on the trainer ranks, with the colocated
    hand-off and the weight sync) -> eval -> save -> report."""
    import ray

    from rlkube_runtime.trainer.checkpoint import clean_partial_checkpoints

    # A save cut short by a crash leaves a .tmp- directory; only complete checkpoints are loaded.
    clean_partial_checkpoints(plan.checkpoint_root)
    cluster = _init_ray()
    stop = _StopRequest.install()  # after Ray's own set-up, which must not replace it
    job = _start(plan, cluster)
    try:
        _prepare(job)
        spec = job.spec
        num_rollout = spec.training.num_rollout
        start = _resume(job) if resume else 0
        if _eval_interval(spec) and start == 0:
            job.logger.log(-1, {**ray.get(job.rollout.evaluate.remote(0)), "progress/num_rollout": num_rollout})
        rollouts = _Rollouts(job.rollout, start, num_rollout, overlap=spec.training.mode == "async")
        for rollout_id in range(start, num_rollout):
            step_start = time.monotonic()
            taken = rollouts.take(rollout_id, stop)
            if taken is None:  # SIGTERM while generating: this rollout is abandoned, redone on resume
                _stop_after(job, rollout_id - 1, stop, trained_since_start=rollout_id > start)
            samples, metrics = taken
            sync_now = (rollout_id + 1) % spec.training.update_weights_interval == 0 or rollout_id + 1 == num_rollout
            metrics.update(_train(job, rollout_id, samples, sync_version=rollout_id + 1 if sync_now else None,
                                  in_flight=rollouts.in_flight, stop=stop))
            # Recorded before the checkpoint that covers it: a crash in between redoes this rollout
            # (its record is written again) rather than leaving a trained rollout unrecorded.
            _log_trained_samples(plan.output_dir, rollout_id, samples)
            if not stop.requested:
                metrics.update(_evaluate(job, rollout_id))
            checkpoint = _save(job, rollout_id, force=stop.requested)
            rollouts.start_next(rollout_id)
            _report(job, rollout_id, metrics, checkpoint, seconds=time.monotonic() - step_start)
            if stop.requested:
                _stop_after(job, rollout_id, stop, trained_since_start=True)
    finally:
        job.logger.close()
        try:
            ray.get(job.rollout.shutdown.remote(), timeout=60)
        except Exception as err:  # shutting down after a failure must not hide that failure
            log.warning("rollout manager shutdown failed: %s", err)
        if cluster == "local":
            ray.shutdown()


def _start(plan: RunPlan, cluster: str) -> Job:
    """Actors placed on the topology, the metric sinks, and which trainer rank pushes weights to
    which engine."""
    import ray

    from rlkube_runtime.metrics import MetricsLogger

    spec = plan.job.spec
    topology = _plan_topology(spec)
    from rlkube_runtime.spec.contract import ENV_METRICS_PORT

    metrics_port = os.environ.get(ENV_METRICS_PORT)
    logger = MetricsLogger(plan.job.metadata.name, plan.output_dir, prometheus_port=int(metrics_port) if metrics_port else None)
    reporter = _status_reporter()
    trainers, rollout = _start_actors(plan, topology, cluster)
    job = Job(plan, trainers, rollout, takes_turns=topology.placement == "colocated",
              logger=logger, reporter=reporter,
              engine_restarts=reporter.engine_restarts_so_far() if reporter is not None else 0)
    job.pushers = _weight_pushers(spec, topology)
    return job


def _prepare(job: Job) -> None:
    """Colocated trainers start offloaded (the engines generate first); the engines learn who
    pushes them weights, and how."""
    import ray

    if job.takes_turns:
        ray.get([t.release_memory.remote() for t in job.trainers])
    ray.get(job.rollout.set_weight_pushers.remote(job.trainers, *job.pushers, str(job.plan.output_dir / "weights")))


def _resume(job: Job) -> int:
    """Load the newest complete checkpoint, if any (trainer state, each rank's random streams,
    the data position), give the engines its weights; returns the first rollout to run."""
    import ray

    from rlkube_runtime.trainer.checkpoint import load_latest_checkpoint

    found = None
    for root in job.plan.resume_roots:
        found = load_latest_checkpoint(root)
        if found is not None:
            break
    if found is None:
        return 0
    print(f"resuming from checkpoint {found.path} (rollout {found.rollout_id})", flush=True)
    saved = JobCheckpoint.from_payload(found.payload)
    rngs = saved.trainer_rng
    if len(rngs) != len(job.trainers):
        # Another trainer world size (or an older checkpoint): every rank takes rank 0's streams.
        rngs = [None] * len(job.trainers)
    ray.get([t.load_state_dict.remote(saved.trainer, rng) for t, rng in zip(job.trainers, rngs)])
    ray.get(job.rollout.load_data_state.remote(saved.data_source))
    start = found.rollout_id + 1
    job.last_saved = found.rollout_id
    ray.get(job.rollout.update_weights.remote(str(start)))
    return start


class _Rollouts:
    """Rollout k's samples, generated in the background: in async mode rollout k+1 starts as soon
    as k is taken (it trains while k+1 generates); otherwise after k is trained and saved."""

    def __init__(self, manager, start: int, num_rollout: int, *, overlap: bool):
        self._manager, self._num_rollout, self._overlap = manager, num_rollout, overlap
        self.in_flight = manager.generate.remote(start) if start < num_rollout else None

    def take(self, rollout_id: int, stop: _StopRequest) -> tuple[list[dict[str, Any]], dict[str, float]] | None:
        """Rollout k's (samples, metrics); None when a stop is requested before they are ready."""
        import ray

        while not ray.wait([self.in_flight], timeout=0.5)[0]:
            if stop.requested:
                return None
        samples, metrics = ray.get(self.in_flight)
        self.in_flight = None
        if self._overlap and rollout_id + 1 < self._num_rollout:
            self.in_flight = self._manager.generate.remote(rollout_id + 1)
        return samples, metrics

    def start_next(self, rollout_id: int) -> None:
        if self.in_flight is None and rollout_id + 1 < self._num_rollout:
            self.in_flight = self._manager.generate.remote(rollout_id + 1)


def _evaluate(job: Job, rollout_id: int) -> dict[str, float]:
    import ray

    every = _eval_interval(job.spec)
    if every and (rollout_id + 1) % every == 0:
        return ray.get(job.rollout.evaluate.remote(rollout_id + 1))
    return {}


class _StopRequest:
    """SIGTERM (preemption, suspend, a node drain) noted, not obeyed at once: the loop stops at the
    next point where a checkpoint can cover everything trained, saves it and exits."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.since: float | None = None

    @classmethod
    def install(cls) -> _StopRequest:
        import signal
        import threading

        request = cls()
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            signal.signal(signal.SIGTERM, request._note)
        return request

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _note(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal, self.since = signum, time.monotonic()
            print("SIGTERM: stopping at the next checkpoint-safe point (the current rollout's training, or now if "
                  "it is still generating), then saving", file=sys.stderr, flush=True)


def _stop_after(job: Job, rollout_id: int, stop: _StopRequest, *, trained_since_start: bool) -> None:
    """Make sure a checkpoint covers every rollout up to `rollout_id`, then raise Preempted."""
    if trained_since_start and job.last_saved != rollout_id:
        _save(job, rollout_id, force=True)
    waited = time.monotonic() - (stop.since or time.monotonic())
    _report_preempted(job)
    if job.last_saved is None:
        raise Preempted(f"stopped by SIGTERM after {waited:.1f} s, before any rollout was trained; nothing to save.")
    raise Preempted(
        f"stopped by SIGTERM after {waited:.1f} s; every trained rollout is in the checkpoint of rollout "
        f"{job.last_saved} in {job.plan.checkpoint_root}."
    )


def _report_preempted(job: Job) -> None:
    """On Kubernetes, note in the RLJob's status that this attempt ended by a preemption with
    everything saved, so the operator resumes it without counting a failure."""
    from rlkube_runtime.status_report import attempt_from_env

    attempt = attempt_from_env()
    if job.reporter is not None and attempt is not None:
        job.reporter.report_preempted(attempt, job.last_saved)


def _eval_interval(spec) -> int | None:
    return spec.eval.interval if spec.eval.datasets else None


def _save(job: Job, rollout_id: int, *, force: bool = False) -> dict[str, Any] | None:
    """A checkpoint when due (every checkpoint.interval rollouts, after the last one, or when
    `force`d): its rollout, path and time, else None."""
    import ray

    from rlkube_runtime.trainer.checkpoint import save_checkpoint

    spec = job.spec
    num_rollout, interval = spec.training.num_rollout, spec.checkpoint.interval
    if not (force or (interval and (rollout_id + 1) % interval == 0) or rollout_id + 1 == num_rollout):
        return None
    saved = JobCheckpoint(
        trainer=ray.get(job.trainers[0].state_dict.remote()),
        trainer_rng=ray.get([t.rng_state.remote() for t in job.trainers]),
        # The data position as of the next rollout's start (in async mode rollout k+1 already
        # took its prompts; its checkpointed position is from before).
        data_source=ray.get(job.rollout.data_state.remote(rollout_id + 1)),
        progress={"rollout_id": rollout_id, "num_rollout": num_rollout},
    )
    path = save_checkpoint(job.plan.checkpoint_root, rollout_id, saved.payload(), keep=spec.checkpoint.keep)
    job.last_saved = rollout_id
    return {"rollout": rollout_id, "path": str(path), "time": datetime.now(timezone.utc)}


def _report(job: Job, rollout_id: int, metrics: dict[str, Any], checkpoint: dict[str, Any] | None, *, seconds: float) -> None:
    """The rollout's metrics to the log, TensorBoard and Prometheus; progress to the RLJob's status."""
    import ray

    num_rollout = job.spec.training.num_rollout
    restarts = ray.get(job.rollout.take_engine_restarts.remote())
    job.engine_restarts += restarts
    if restarts:
        job.logger.prometheus.count_engine_restarts(restarts)
    metrics["rollout/engine_restarts"] = float(restarts)
    if checkpoint is not None:
        metrics["checkpoint/last_time"] = checkpoint["time"].timestamp()
    metrics["perf/step_time"] = seconds
    metrics["progress/rollout"] = rollout_id
    metrics["progress/num_rollout"] = num_rollout
    job.logger.log(rollout_id, metrics)
    if job.reporter is not None:
        job.reporter.report(
            rollout_id + 1,
            num_rollout,
            last_checkpoint=checkpoint,
            metrics={"reward_mean": metrics.get("rollout/raw_reward"), "kl": metrics.get("train/kl_loss"),
                     "step_seconds": seconds},
            engine_restarts=job.engine_restarts,
        )


def _train(
    job: Job, rollout_id: int, samples, *, sync_version: int | None, in_flight=None, stop: _StopRequest | None = None
) -> dict[str, float]:
    """Train on one rollout, then (when due) sync the weights to the engines; a rollout still in
    flight (async mode) finishes on the old weights first, as in slime's async loop.

    Colocated, the phases take turns with the memory, in slime's order: the engines give theirs
    up for the train phase; after it the trainer keeps only its weights while the engines take
    their weights back and the sync copies into them, then the trainer offloads the rest and the
    engines get their KV cache back (weights, sync, KV: the peak stays one model plus the cache).
    Returns the train metrics and perf/ seconds of each step.
    """
    import ray

    trainers, rollout, takes_turns = job.trainers, job.rollout, job.takes_turns
    metrics: dict[str, float] = {}
    handoff = 0.0
    started = time.monotonic()
    if takes_turns:
        ray.get(rollout.release_memory.remote())
        ray.get([t.resume_memory.remote() for t in trainers])
        metrics["perf/handoff_to_train_time"] = handoff = time.monotonic() - started
    metrics.update(ray.get([t.train.remote(rollout_id, samples) for t in trainers])[0])
    metrics["perf/actor_train_time"] = time.monotonic() - started - handoff
    if stop is not None and stop.requested:
        sync_version = None  # stopping: the checkpoint has the weights; the engines are going away
    if takes_turns:
        back = time.monotonic()
        ray.get([t.release_memory.remote(keep_weights=sync_version is not None) for t in trainers])
        ray.get(rollout.resume_memory.remote(["weights"]))
        handoff = time.monotonic() - back
    if sync_version is not None:
        if in_flight is not None:
            ray.wait([in_flight], num_returns=1)
        sync_start = time.monotonic()
        report = ray.get(rollout.update_weights.remote(str(sync_version)))
        metrics["perf/update_weights_time"] = time.monotonic() - sync_start
        metrics["perf/update_weights_push_time"] = report["seconds"]
        metrics["perf/update_weights_bytes"] = float(report["bytes_per_engine"])
    if takes_turns:
        back = time.monotonic()
        if sync_version is not None:
            ray.get([t.release_memory.remote() for t in trainers])
        ray.get(rollout.resume_memory.remote(["kv_cache", "cuda_graph"]))
        metrics["perf/handoff_to_rollout_time"] = handoff + time.monotonic() - back
    return metrics


def _weight_pushers(spec, topology) -> tuple[list[int], str]:
    """Which trainer rank pushes to engine j, and the transport: for `tensor` the rank on the
    engine's GPU (its bundle), otherwise rank 0."""
    from rlkube_runtime.topology import weight_sync_transport

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
    return owners, transport


def _log_trained_samples(out: Path, rollout_id: int, samples: list[dict[str, Any]]) -> None:
    """Which samples each rollout trained on: the audit trail for 'no prompt skipped or doubled'."""
    record = {
        "rollout": rollout_id,
        "sample_indices": [s["index"] for s in samples],
        "group_indices": sorted({s["group_index"] for s in samples}),
        # The engines' weight versions that generated them: the sync before rollout k sets k.
        "weight_versions": sorted({v for s in samples for v in s.get("weight_versions") or []}),
    }
    with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _init_ray() -> str:
    """Join the KubeRay cluster when there is one, else start a private local Ray."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return "cluster"
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)
    return "local"


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
    )


def _start_actors(plan: RunPlan, topology, cluster: str):
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlkube_runtime.rollout.manager import RolloutManager
    from rlkube_runtime.spec.contract import ROUTER_RESOURCE
    from rlkube_runtime.train_worker import TrainerWorker

    spec_dict = plan.job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    group = placement_group(list(topology.bundles), strategy="PACK")
    ray.get(group.ready(), timeout=600)

    def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    # Trainer ranks meet at rank 0's node (its IP, a free port there): on a cluster the ranks
    # are pods of their own, and loopback reaches none of them.
    master_addr, master_port = ray.get(
        ray.remote(_rendezvous_address)
        .options(num_cpus=0, scheduling_strategy=in_bundle(topology.trainer_bundles[0]))
        .remote()
    )
    trainer_cls = ray.remote(TrainerWorker)
    threads = 1 if topology.device == "cpu" else None
    trainers = [
        trainer_cls.options(
            num_cpus=topology.trainer_actor_resources.get("CPU", 0),
            num_gpus=topology.trainer_actor_resources.get("GPU", 0),
            scheduling_strategy=in_bundle(topology.trainer_bundles[rank]),
        ).remote(
            spec_dict,
            hf_checkpoint=plan.model_path,
            rank=rank,
            world_size=topology.trainer_world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=topology.device,
            num_threads=threads,
        )
        for rank in range(topology.trainer_world_size)
    ]
    manager_cls = ray.remote(RolloutManager)
    # The router runs inside the manager's process: on a rollout pod when the operator made some.
    router_pod = {ROUTER_RESOURCE: 0.01} if ROUTER_RESOURCE in ray.cluster_resources() else {}
    engine_gpus = None
    if topology.placement == "colocated" and topology.device == "cuda" and topology.gpus_per_engine > 1:
        # Ray shows each actor its own bundle's GPU only: an engine over several GPUs is given
        # those of the trainer ranks it shares by id (waiting for the ranks to exist).
        from rlkube_runtime.topology import colocated_engine_gpus

        engine_gpus = colocated_engine_gpus(ray.get([t.gpus.remote() for t in trainers]), topology.gpus_per_engine)
    rollout = manager_cls.options(num_cpus=0, max_concurrency=16, resources=router_pod).remote(
        spec_dict,
        model_path=plan.model_path,
        log_dir=str(plan.output_dir / "logs"),
        placement_group=group,
        engine_bundles=list(topology.engine_bundles),
        engine_resources=topology.engine_actor_resources,
        device=topology.device,
        engine_gpu_ids=engine_gpus,
    )
    ray.get([t.ready.remote() for t in trainers] + [rollout.start.remote()])
    return trainers, rollout


def _status_reporter():
    """Reports progress to the RLJob's status when running inside the cluster; None locally."""
    try:
        from rlkube_runtime.status_report import RLJobStatusReporter
    except ImportError:
        return None
    return RLJobStatusReporter.from_env()


def _rendezvous_address() -> tuple[str, int]:
    """(this node's IP, a free port on it), run as a Ray task on trainer rank 0's node."""
    from rlkube_runtime.rollout.launch import free_port, node_ip

    address = node_ip()
    return address, free_port(address)

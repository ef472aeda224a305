"""`rlkube run`: the training driver. Read top to bottom, it is the loop of DESIGN.md:

    generate -> reward -> filter (rollout manager) -> advantages -> train (trainer ranks)
    -> sync weights -> eval -> checkpoint -> metrics and status

Each phase is one actor call. Locally `ray.init()` starts a private Ray; inside a KubeRay cluster
(RAY_ADDRESS set by the RayJob) the same code joins the existing cluster.

Two debugging modes split the loop at the rollout dump (slime's --debug-rollout-only and
--debug-train-only): `rollout-only` generates and dumps every sample, starting no trainer;
`train-only` trains on such dumps, starting no engine. Neither writes checkpoints.
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
from typing import Any, Literal

from rlkube_runtime.spec import RLJob
from rlkube_runtime.spec.contract import PREEMPTED_EXIT_CODE
from rlkube_runtime.spec.load import SpecError, load_rljobs

log = logging.getLogger("rlkube.driver")

# A megatron trainer's checkpoint: its ranks' distributed checkpoint in this sub-directory.
MEGATRON_FORMAT = "megatron_dist"
MEGATRON_DIR = "trainer"
# The torch backend's state in a checkpoint: written by trainer rank 0, read by every rank.
TRAINER_STATE_FILE = "trainer_state.pt"


class Preempted(Exception):
    """The run stopped on SIGTERM after saving what it had done."""

    def __init__(self, message: str):
        super().__init__(message)


class RunError(Exception):
    """A problem found before training starts; the message names the field or the file."""


class InvalidSpec(RunError):
    """The spec asks for something this runtime refuses (the message names the field): another
    attempt would be refused the same way, so on a cluster it is reported for the operator to
    fail the job instead of restarting it. A missing data file stays a plain RunError."""


RunMode = Literal["train", "rollout-only", "train-only"]


@dataclass(frozen=True)
class RunPlan:
    job: RLJob
    output_dir: Path
    checkpoint_root: Path
    resume_roots: tuple[Path, ...]  # where to look for a checkpoint, newest first
    model_path: str  # HF directory (or hub id) the trainer and the engines start from
    spec_path: str = ""  # the job file, for the commands the end-of-run summary suggests
    mode: RunMode = "train"
    rollout_dump: str = "sample"  # spec.observability.rolloutDump, or "all" when asked for
    load_rollouts: Path | None = None  # train-only: the dumps to train on
    train_rollout_ids: tuple[int, ...] = ()  # train-only: the dumped rollouts, in order

    @property
    def trains(self) -> bool:
        return self.mode != "rollout-only"

    @property
    def generates(self) -> bool:
        return self.mode != "train-only"

    @property
    def dump_dir(self) -> Path:
        from rlkube_runtime.rollout_dump import DUMP_DIR

        return self.output_dir / DUMP_DIR


def run_from_file(
    path: str,
    *,
    output_dir: str | None = None,
    resume: bool = True,
    mode: RunMode = "train",
    load_rollouts: str | None = None,
    dump_all_rollouts: bool = False,
) -> int:
    """The CLI entry: exit 0 on success; a spec or data problem prints one clear error, exit 2."""
    logging.basicConfig(level=os.environ.get("RLKUBE_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    # This process and the actors (they inherit the environment) print one progress line per
    # rollout instead of model-loading bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not os.environ.get("RAY_ADDRESS"):
        # Ray turns token authentication on for a new local cluster and warns that it did unless
        # RAY_AUTH_MODE is set; saying `token` keeps the protection without the warning. Ray reads
        # it when first imported, so before anything here imports ray. (In a KubeRay cluster the
        # cluster's own setting applies.)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        plan = prepare_run(
            path, output_dir=output_dir, mode=mode, load_rollouts=load_rollouts, dump_all_rollouts=dump_all_rollouts
        )
    except (SpecError, RunError) as err:
        print(f"rlkube run: {err}", file=sys.stderr)
        if isinstance(err, (SpecError, InvalidSpec)):
            _report_invalid_spec(err)
        return 2
    try:
        run_job(plan, resume=resume)
    except RunError as err:  # found once Ray is up (a tracker that cannot start, an unsupported mode)
        print(f"rlkube run: {err}", file=sys.stderr)
        return 2
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


def _report_invalid_spec(err: SpecError | InvalidSpec) -> None:
    """On a cluster, write the refusal to the RLJob's status (status.invalidSpec) so the operator
    fails the job with reason InvalidSpec rather than restarting it; best effort, like all reports."""
    from rlkube_runtime.status_report import RLJobStatusReporter

    reporter = RLJobStatusReporter.from_env()
    if reporter is None:
        return
    if isinstance(err, SpecError):
        message = "; ".join(f"{field}: {text}" if field else text for field, text in err.errors)
    else:
        message = str(err)
    reporter.report_invalid_spec(message)


def prepare_run(
    path: str,
    *,
    output_dir: str | None = None,
    mode: RunMode = "train",
    load_rollouts: str | None = None,
    dump_all_rollouts: bool = False,
) -> RunPlan:
    """Everything that can fail because of the spec, the data or the dumps, checked before Ray starts."""
    if (mode == "train-only") != (load_rollouts is not None):
        raise RunError("--debug-train-only and --load-rollouts DIR go together: train-only trains on the dumps in DIR")
    jobs = load_rljobs(path)
    if len(jobs) != 1:
        raise InvalidSpec(f"{path}: `rlkube run` takes one RLJob per file, found {len(jobs)}")
    job = jobs[0]
    spec = job.spec
    from rlkube_runtime.actors.trainer import check_trainer_supports

    from rlkube_runtime.tracking import TrackingError, check_trackers_available

    try:
        check_trainer_supports(spec)
    except ValueError as err:
        raise InvalidSpec(str(err)) from None
    try:
        check_trackers_available(spec.observability)
    except TrackingError as err:
        raise RunError(str(err)) from None
    train_ids: tuple[int, ...] = ()
    if load_rollouts is not None:
        train_ids = _check_dumps(Path(load_rollouts), spec)
    out = Path(output_dir or spec.model.save or Path("runs") / job.metadata.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_path = _initial_model(job, out)
    if mode != "train-only":
        _check_data(job, model_path)
    checkpoint_root = out / "checkpoints"
    resume_roots = (checkpoint_root,) + ((Path(spec.model.load),) if spec.model.load else ())
    # A rollout-only run exists to produce dumps a train-only run can use: every sample.
    dump = "all" if dump_all_rollouts or mode == "rollout-only" else spec.observability.rollout_dump
    return RunPlan(job, out, checkpoint_root, resume_roots, model_path, spec_path=path, mode=mode, rollout_dump=dump,
                   load_rollouts=Path(load_rollouts).resolve() if load_rollouts else None, train_rollout_ids=train_ids)


def _check_dumps(directory: Path, spec) -> tuple[int, ...]:
    """The dumped rollouts to train on (at most training.numRollout of them); the first is read
    whole so a sample dump or one from another job stops the run now."""
    from rlkube_runtime.rollout_dump import RolloutDumpError, dumped_rollout_ids, load_rollout_dump

    try:
        ids = dumped_rollout_ids(directory)[: spec.training.num_rollout]
        load_rollout_dump(directory, ids[0], expected_samples=spec.samples_per_rollout)
    except (RolloutDumpError, OSError) as err:
        raise RunError(str(err)) from None
    return tuple(ids)


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
        raise InvalidSpec(
            f"spec.model.preset: {model.preset!r} has no built-in weights; known presets: ['tiny']. "
            "For a named architecture give spec.model.hfCheckpoint instead"
        )
    raise InvalidSpec("spec.model: set hfCheckpoint (or preset: tiny); `load` alone has no architecture to start from")


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
    trainers: list[Any]  # TrainerWorker handles, rank order (none when rollout-only)
    rollout: Any  # the RolloutManager handle (None when train-only)
    # Colocated: trainer and engines take turns with the device memory. On a CPU there is nothing
    # to free, but the turns run the same way, so the local run tests the order a GPU run needs.
    takes_turns: bool
    logger: Any  # MetricsLogger
    reporter: Any  # RLJobStatusReporter, or None outside a cluster
    summary: Any  # RunSummary: what the end-of-run block reports
    engine_restarts: int = 0  # the job's total, earlier attempts included
    last_saved: int | None = None  # the rollout of the newest checkpoint this job holds
    last_saved_path: str | None = None  # and its directory
    pushers: tuple[list[int], str] = ([], "http")  # trainer rank serving engine j; the weight-sync transport

    @property
    def spec(self):
        return self.plan.job.spec

    @property
    def num_rollout(self) -> int:
        """The rollout count progress is shown against: training.numRollout, or up to the last dump a
        train-only run trains on."""
        return self.plan.train_rollout_ids[-1] + 1 if self.plan.mode == "train-only" else self.spec.training.num_rollout


@dataclass(frozen=True)
class JobCheckpoint:
    """What a checkpoint holds beyond the files: written by `_save`, read by `_resume`."""

    trainer_rng: list[Any]  # every rank's random streams, rank order
    data_source: dict[str, Any]  # the prompt position and buffer as of the next rollout's start
    progress: dict[str, int]
    # Rank 0's model, optimizer and schedule, only in checkpoints written before the trainer wrote
    # them itself (TRAINER_STATE_FILE, read by every rank without passing through the driver).
    trainer: dict[str, Any] | None = None

    def payload(self) -> dict[str, Any]:
        payload = {"trainer_rng": self.trainer_rng, "data_source": self.data_source, "progress": self.progress}
        return payload if self.trainer is None else {**payload, "trainer": self.trainer}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> JobCheckpoint:
        return cls(trainer=payload.get("trainer"), trainer_rng=payload.get("trainer_rng") or [],
                   data_source=payload["data_source"], progress=payload.get("progress") or {})


def run_job(plan: RunPlan, *, resume: bool = True) -> None:
    """The loop, one call per phase: generate (the rollout manager: prompts, engines, rewards,
    filters) -> train (advantages and optimizer steps on the trainer ranks, with the colocated
    hand-off and the weight sync) -> dump -> eval -> save -> report; then the HF export and the
    summary."""
    import ray

    from rlkube_runtime.trainer.checkpoint import clean_partial_checkpoints

    # A save cut short by a crash leaves a .tmp- directory; only complete checkpoints are loaded.
    clean_partial_checkpoints(plan.checkpoint_root)
    trackers = _open_trackers(plan)  # before Ray: a tracker that cannot start stops the run at once
    cluster = _init_ray()
    stop = _StopRequest.install()  # after Ray's own set-up, which must not replace it
    job = _start(plan, cluster, trackers)
    hf_export, finished = None, False
    try:
        _prepare(job)
        if plan.mode == "train-only":
            _train_on_dumps(job, stop)
        else:
            _generate_and_train(job, stop, resume=resume and plan.trains)
        if plan.trains:
            hf_export = _export_hf(job)
        finished = True
    finally:
        job.logger.close()
        if job.rollout is not None:
            try:
                ray.get(job.rollout.shutdown.remote(), timeout=60)
            except Exception as err:  # shutting down after a failure must not hide that failure
                log.warning("rollout manager shutdown failed: %s", err)
        if cluster == "local":
            ray.shutdown()
        # Also after a stop or a failure: what was done and how to go on (the cause follows).
        print(_summary_block(job, hf_export, finished=finished), flush=True)


def _generate_and_train(job: Job, stop: _StopRequest, *, resume: bool) -> None:
    """The loop of DESIGN.md (rollout-only: without train and save), from the resume point."""
    spec, plan = job.spec, job.plan
    num_rollout = spec.training.num_rollout
    start = _resume(job) if resume else 0
    if _eval_interval(spec) and start == 0:
        job.logger.log(-1, {**_evaluate(job, -1), "progress/num_rollout": num_rollout})
    rollouts = _Rollouts(job.rollout, start, num_rollout, overlap=spec.training.mode == "async")
    for rollout_id in range(start, num_rollout):
        step_start = time.monotonic()
        taken = rollouts.take(rollout_id, stop)
        if taken is None:  # SIGTERM while generating: this rollout is abandoned, redone on resume
            _stop_after(job, rollout_id - 1, stop, trained_since_start=rollout_id > start)
        samples, metrics = taken
        checkpoint = None
        if plan.trains:
            sync_now = (rollout_id + 1) % spec.training.update_weights_interval == 0 or rollout_id + 1 == num_rollout
            metrics.update(_train(job, rollout_id, samples, sync_version=rollout_id + 1 if sync_now else None,
                                  in_flight=rollouts.in_flight, stop=stop))
            # Recorded before the checkpoint that covers it: a crash in between redoes this rollout
            # (its record is written again) rather than leaving a trained rollout unrecorded.
            _log_trained_samples(plan.output_dir, rollout_id, samples)
        _dump(job, rollout_id, samples)
        if not stop.requested:
            metrics.update(_evaluate(job, rollout_id))
        if plan.trains:
            checkpoint = _save(job, rollout_id, force=stop.requested)
        rollouts.start_next(rollout_id)
        _report(job, rollout_id, metrics, checkpoint, seconds=time.monotonic() - step_start)
        if stop.requested:
            _stop_after(job, rollout_id, stop, trained_since_start=True)


def _train_on_dumps(job: Job, stop: _StopRequest) -> None:
    """Train-only: the dumped rollouts in order, each trained as the normal loop trains it (no
    engines, so no weight sync), no checkpoints."""
    from rlkube_runtime.rollout_dump import load_rollout_dump

    plan = job.plan
    for rollout_id in plan.train_rollout_ids:
        step_start = time.monotonic()
        samples = load_rollout_dump(plan.load_rollouts, rollout_id, expected_samples=job.spec.samples_per_rollout)
        metrics = {"rollout/raw_reward": sum(float(s["reward"]) for s in samples) / len(samples)}
        metrics.update(_train(job, rollout_id, samples, sync_version=None))
        _report(job, rollout_id, metrics, None, seconds=time.monotonic() - step_start)
        if stop.requested:
            raise Preempted("stopped by SIGTERM; a train-only run keeps no checkpoints.")


def _open_trackers(plan: RunPlan) -> list[Any]:
    """The W&B / MLflow runs spec.observability configures, continuing this job's run if any."""
    from rlkube_runtime.tracking import TrackingError, open_trackers, run_identity

    try:
        return open_trackers(plan.job, run_identity(plan.job, plan.output_dir))
    except TrackingError as err:
        raise RunError(str(err)) from None


def _start(plan: RunPlan, cluster: str, trackers: list[Any]) -> Job:
    """Actors placed on the topology, the metric sinks, and which trainer rank pushes weights to
    which engine."""
    import ray

    from rlkube_runtime.metrics import MetricsLogger

    spec = plan.job.spec
    topology = _plan_topology(spec)
    from rlkube_runtime.spec.contract import ENV_METRICS_PORT

    from rlkube_runtime.run_summary import RunSummary

    metrics_port = os.environ.get(ENV_METRICS_PORT)
    logger = MetricsLogger(plan.job.metadata.name, plan.output_dir, trackers=trackers,
                           prometheus_port=int(metrics_port) if metrics_port else None)
    reporter = _status_reporter()
    trainers, rollout = _start_actors(plan, topology, cluster)
    job = Job(plan, trainers, rollout, takes_turns=topology.placement == "colocated" and plan.trains and plan.generates,
              logger=logger, reporter=reporter, summary=None,
              engine_restarts=reporter.engine_restarts_so_far() if reporter is not None else 0)
    job.summary = RunSummary(plan.job.metadata.name, job.num_rollout)
    job.pushers = _weight_pushers(spec, topology)
    return job


def _prepare(job: Job) -> None:
    """Colocated trainers start offloaded (the engines generate first); the engines learn who
    pushes them weights, and how."""
    import ray

    if job.takes_turns:
        ray.get([t.release_memory.remote() for t in job.trainers])
    if job.rollout is not None and job.trainers:
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
    if found.payload.get("trainer_format") == MEGATRON_FORMAT:
        # Every rank reads its own shards and random streams from the checkpoint directory.
        ray.get([t.load_distributed.remote(str(found.path / MEGATRON_DIR)) for t in job.trainers])
        data_source = found.payload["data_source"]
    else:
        saved = JobCheckpoint.from_payload(found.payload)
        rngs = saved.trainer_rng
        if len(rngs) != len(job.trainers):
            # Another trainer world size (or an older checkpoint): every rank takes rank 0's streams.
            rngs = [None] * len(job.trainers)
        if saved.trainer is None:
            state = str(found.path / TRAINER_STATE_FILE)
            ray.get([t.load_state_file.remote(state, rng) for t, rng in zip(job.trainers, rngs)])
        else:
            ray.get([t.load_state_dict.remote(saved.trainer, rng) for t, rng in zip(job.trainers, rngs)])
        data_source = saved.data_source
    ray.get(job.rollout.load_data_state.remote(data_source))
    start = found.rollout_id + 1
    job.last_saved, job.last_saved_path = found.rollout_id, str(found.path)
    _stage_weights(job)
    ray.get(job.rollout.update_weights.remote(str(start)))
    return start


def _stage_weights(job: Job) -> None:
    """Before a push: the megatron trainer gathers its weights over all ranks (the pushing ranks
    alone could not); the torch trainer's ranks each hold the whole model already."""
    import ray

    if job.spec.training.backend == "megatron":
        pushers = set(job.pushers[0])
        ray.get([t.stage_weights.remote(keep=rank in pushers) for rank, t in enumerate(job.trainers)])


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
    """The eval datasets' metrics when an evaluation is due after `rollout_id` (-1: before the
    first rollout), with its time in perf/eval_time."""
    import ray

    every = _eval_interval(job.spec)
    if every and (rollout_id + 1) % every == 0:
        started = time.monotonic()
        metrics = ray.get(job.rollout.evaluate.remote(rollout_id + 1))
        return {**metrics, "perf/eval_time": time.monotonic() - started}
    return {}


def _dump(job: Job, rollout_id: int, samples: list[dict[str, Any]]) -> None:
    """The rollout's samples to <output>/rollouts/rollout_<k>.jsonl (spec.observability.rolloutDump),
    with the advantages rank 0 trained on."""
    import ray

    from rlkube_runtime.rollout_dump import samples_to_dump, write_rollout_dump

    observability = job.spec.observability
    count = samples_to_dump(samples, job.plan.rollout_dump, observability.rollout_dump_samples)
    if not count:
        return
    advantages = ray.get(job.trainers[0].last_advantages.remote(count)) if job.trainers else None
    write_rollout_dump(job.plan.dump_dir, rollout_id, samples[:count], advantages, samples_in_rollout=len(samples))


def _export_hf(job: Job) -> str:
    """The trained weights as a Hugging Face directory (<output>/hf), what `from_pretrained` and
    SGLang load."""
    import ray

    return ray.get(job.trainers[0].save_hf.remote(str(job.plan.output_dir / "hf")))


def _summary_block(job: Job, hf_export: str | None, *, finished: bool) -> str:
    plan = job.plan
    command = f"rlkube run {plan.spec_path} --output-dir {plan.output_dir}"
    checkpoint = f"{job.last_saved_path} (rollout {job.last_saved + 1})" if job.last_saved is not None else None
    num_rollout = job.spec.training.num_rollout
    if plan.mode == "rollout-only":
        next_steps = [("dumps", str(plan.dump_dir)),
                      ("train on them", f"{command}-train-only --debug-train-only --load-rollouts {plan.dump_dir}")]
    elif plan.mode == "train-only":
        next_steps = [("next", f"trained on the dumps in {plan.load_rollouts} (no checkpoints in train-only mode)")]
    elif job.last_saved is not None and job.last_saved + 1 == num_rollout:
        next_steps = [("next", f"all {num_rollout} rollouts done; with a larger training.numRollout `{command}` "
                               "continues from the last checkpoint (--no-resume starts over)")]
    elif job.last_saved is not None:
        next_steps = [("resume", f"`{command}` continues from rollout {job.last_saved + 2}")]
    else:
        next_steps = [("resume", f"no checkpoint yet: `{command}` starts from rollout 1")]
    return job.summary.render(finished=finished, checkpoint=checkpoint, hf_export=hf_export, next_steps=next_steps)


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
    if not job.plan.trains:
        raise Preempted("stopped by SIGTERM; a rollout-only run keeps no checkpoints.")
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

    from rlkube_runtime.trainer.checkpoint import abandon_checkpoint, begin_checkpoint, finish_checkpoint

    spec = job.spec
    num_rollout, interval = spec.training.num_rollout, spec.checkpoint.interval
    if not (force or (interval and (rollout_id + 1) % interval == 0) or rollout_id + 1 == num_rollout):
        return None
    if spec.training.backend == "megatron":
        # Every rank writes its own shards into the checkpoint's temporary directory; this
        # process adds the data position and makes the whole directory visible at once.
        tmp = begin_checkpoint(job.plan.checkpoint_root, rollout_id)
        ray.get([t.save_distributed.remote(str(tmp / MEGATRON_DIR)) for t in job.trainers])
        payload = {
            "trainer_format": MEGATRON_FORMAT,
            "data_source": ray.get(job.rollout.data_state.remote(rollout_id + 1)),
            "progress": {"rollout_id": rollout_id, "num_rollout": num_rollout},
        }
        path = finish_checkpoint(job.plan.checkpoint_root, rollout_id, tmp, payload, keep=spec.checkpoint.keep)
        job.last_saved, job.last_saved_path = rollout_id, str(path)
        return {"rollout": rollout_id, "path": str(path), "time": datetime.now(timezone.utc)}
    # Rank 0 writes the trainer state into the checkpoint's temporary directory itself; this
    # process adds the small parts and makes the whole directory visible at once.
    tmp = begin_checkpoint(job.plan.checkpoint_root, rollout_id)
    try:
        ray.get(job.trainers[0].save_state.remote(str(tmp / TRAINER_STATE_FILE)))
    except ray.exceptions.RayTaskError as err:
        raise abandon_checkpoint(job.plan.checkpoint_root, rollout_id, tmp, err.cause or err) from err
    saved = JobCheckpoint(
        trainer_rng=ray.get([t.rng_state.remote() for t in job.trainers]),
        # The data position as of the next rollout's start (in async mode rollout k+1 already
        # took its prompts; its checkpointed position is from before).
        data_source=ray.get(job.rollout.data_state.remote(rollout_id + 1)),
        progress={"rollout_id": rollout_id, "num_rollout": num_rollout},
    )
    path = finish_checkpoint(job.plan.checkpoint_root, rollout_id, tmp, saved.payload(), keep=spec.checkpoint.keep)
    job.last_saved, job.last_saved_path = rollout_id, str(path)
    return {"rollout": rollout_id, "path": str(path), "time": datetime.now(timezone.utc)}


def _report(job: Job, rollout_id: int, metrics: dict[str, Any], checkpoint: dict[str, Any] | None, *, seconds: float) -> None:
    """The rollout's metrics to the log, TensorBoard and Prometheus; progress to the RLJob's status."""
    import ray

    num_rollout = job.num_rollout
    restarts = ray.get(job.rollout.take_engine_restarts.remote()) if job.rollout is not None else 0
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
    job.summary.add(rollout_id, metrics)
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
        _stage_weights(job)
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

    from rlkube_runtime.actors.rollout_manager import RolloutManager
    from rlkube_runtime.spec.contract import ROUTER_RESOURCE

    spec_dict = plan.job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    group = placement_group(list(topology.bundles), strategy="PACK")
    ray.get(group.ready(), timeout=600)

    def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    trainers = _start_trainers(plan, topology, in_bundle) if plan.trains else []
    if not plan.generates:
        ray.get([t.ready.remote() for t in trainers])
        return trainers, None
    manager_cls = ray.remote(RolloutManager)
    # The router runs inside the manager's process: on a rollout pod when the operator made some.
    router_pod = {ROUTER_RESOURCE: 0.01} if ROUTER_RESOURCE in ray.cluster_resources() else {}
    engine_gpus = None
    if topology.placement == "colocated" and topology.device == "cuda" and topology.gpus_per_engine > 1:
        # Ray shows each actor its own bundle's GPU only: an engine over several GPUs is given
        # those of the trainer ranks it shares by id (waiting for the ranks to exist).
        from rlkube_runtime.topology import colocated_engine_gpus

        if not trainers:
            raise RunError(
                "--debug-rollout-only: colocated engines over several GPUs (rollout.gpusPerEngine > 1) take the GPUs "
                "of the trainer ranks they share, and rollout-only starts none; use resources.placement: separate"
            )
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


def _start_trainers(plan: RunPlan, topology, in_bundle) -> list[Any]:
    """The trainer ranks (TrainerWorker actors), one per trainer bundle, not yet waited for."""
    import ray

    from rlkube_runtime.actors.trainer import TrainerWorker

    # Trainer ranks meet at rank 0's node (its IP, a free port there): on a cluster the ranks
    # are pods of their own, and loopback reaches none of them.
    master_addr, master_port = ray.get(
        ray.remote(_rendezvous_address)
        .options(num_cpus=0, scheduling_strategy=in_bundle(topology.trainer_bundles[0]))
        .remote()
    )
    spec_dict = plan.job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    trainer_cls = ray.remote(TrainerWorker)
    threads = 1 if topology.device == "cpu" else None
    return [
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


def _status_reporter():
    """Reports progress to the RLJob's status when running inside the cluster; None locally."""
    try:
        from rlkube_runtime.status_report import RLJobStatusReporter
    except ImportError:
        return None
    return RLJobStatusReporter.from_env()


def _rendezvous_address() -> tuple[str, int]:
    """(this node's IP, a free port on it), run as a Ray task on trainer rank 0's node."""
    from rlkube_runtime.serving.launch import free_port, node_ip

    address = node_ip()
    return address, free_port(address)

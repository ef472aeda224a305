"""The loop of DESIGN.md, one call per phase (slime's train()):

    generate -> (reward, filter: the rollout manager) -> train (advantages, optimizer steps)
    -> sync weights -> dump -> eval -> save -> report

In async mode up to training.asyncBufferSize rollouts after k generate (one after another) while k
trains; otherwise rollout k+1 starts after k is saved.
"""

from __future__ import annotations

import time
from collections import deque

from rlkube_runtime.data.sample import syncs_behind
from rlkube_runtime.run import checkpoints
from rlkube_runtime.run.cluster import Job, init_ray, start_job
from rlkube_runtime.run.plan import RunPlan
from rlkube_runtime.run.report import Report, open_trackers
from rlkube_runtime.run.stop import Preempted, StopRequest, stop_after


def run_job(plan: RunPlan, *, resume: bool = True) -> None:
    """Start, loop, export the trained weights; always end with the summary block."""
    from rlkube_runtime.trainer.checkpoint import clean_partial_checkpoints, remove_temporaries

    clean_partial_checkpoints(plan.checkpoint_root)  # a save cut short by a crash leaves a .tmp- directory
    remove_temporaries(plan.hf_exports_dir)  # so does an export
    trackers = open_trackers(plan)  # before Ray: a tracker that cannot start stops the run at once
    cluster = init_ray()
    stop = StopRequest.install()  # after Ray's own set-up, which must not replace it
    job = start_job(plan, Report.open(plan, trackers))
    hf_export, finished = None, False
    try:
        if plan.mode == "train-only":
            train_on_dumps(job, stop)
        else:
            generate_and_train(job, stop, resume=resume and plan.trains)
        if plan.trains:
            hf_export = job.trainers.export_hf(plan.output_dir / "hf")
        finished = True
    finally:
        shutdown(job, local=cluster == "local", finished=finished)
        # Also after a stop or a failure: what was done and how to go on (the cause follows).
        print(job.report.summary_block(job.last_saved, job.last_saved_path, hf_export, finished=finished), flush=True)


def generate_and_train(job: Job, stop: StopRequest, *, resume: bool) -> None:
    """From the resume point to training.numRollout (rollout-only: without train and save)."""
    plan = job.plan
    start = checkpoints.resume(job) if resume else 0
    if start == 0 and plan.eval_due(-1):
        job.report.eval_before_training(evaluate(job, -1))
    num_rollout = plan.spec.training.num_rollout
    ahead = plan.spec.training.async_buffer_size if plan.spec.training.mode == "async" else 0
    masks_earlier_tokens = plan.spec.rollout.mask_off_policy_in_partial_rollout
    job.report.watch_engines(job.rollouts.engine_urls())
    pending = GenerationQueue(job.rollouts, start, num_rollout)
    pending.ask_through(start)
    for rollout_id in range(start, num_rollout):
        step_start = time.monotonic()
        taken = job.rollouts.take(pending.pop(rollout_id), stop)
        if taken is None:  # SIGTERM while generating: this rollout is abandoned, redone on resume
            stop_after(job, rollout_id - 1, stop, trained_since_start=rollout_id > start)
        samples, metrics = taken
        pending.ask_through(rollout_id + ahead)
        metrics.update(staleness_metrics(samples, trained_at=rollout_id, only_newest_trains=masks_earlier_tokens))
        saved = None
        if plan.trains:
            metrics.update(train(job, rollout_id, samples, sync=plan.sync_due(rollout_id), stop=stop))
            # Recorded before the checkpoint that covers it: a crash in between redoes this rollout
            # (its record is written again) rather than leaving a trained rollout unrecorded.
            job.report.trained_samples(rollout_id, samples)
        job.report.dump(rollout_id, samples, job.trainers)
        if not stop.requested:
            metrics.update(evaluate(job, rollout_id))
        if plan.trains and plan.hf_export_due(rollout_id):  # before the checkpoint: a crash between redoes both
            started = time.monotonic()
            job.trainers.export_hf(plan.hf_exports_dir / f"rollout_{rollout_id + 1}")
            metrics["perf/hf_export_time"] = time.monotonic() - started
        if plan.trains and (stop.requested or plan.save_due(rollout_id)):
            saved = checkpoints.save(job, rollout_id)
        pending.ask_through(rollout_id + 1)  # sync mode: the next rollout starts now
        finish_rollout(job, rollout_id, metrics, saved, step_start)
        if stop.requested:
            stop_after(job, rollout_id, stop, trained_since_start=True)


class GenerationQueue:
    """The rollouts asked of the rollout manager and not yet taken, in id order (the manager
    generates them one after another)."""

    def __init__(self, rollouts, first: int, num_rollout: int):
        self.rollouts, self.num_rollout = rollouts, num_rollout
        self.next_id = first
        self.refs: deque[tuple[int, object]] = deque()

    def ask_through(self, last: int) -> None:
        """Ask for every rollout up to `last` (within the job) not asked for yet."""
        while self.next_id <= min(last, self.num_rollout - 1):
            self.refs.append((self.next_id, self.rollouts.generate(self.next_id)))
            self.next_id += 1

    def pop(self, rollout_id: int):
        asked, ref = self.refs.popleft()
        assert asked == rollout_id, (asked, rollout_id)
        return ref


def staleness_metrics(samples, *, trained_at: int, only_newest_trains: bool = False) -> dict[str, float]:
    """How many weight syncs old each sample's policy is when rollout `trained_at` trains: the
    trainer then holds version `trained_at` (it has trained that many rollouts), and a sample
    generated by version v is `trained_at - v` behind (its oldest version, for a sample whose
    generation spanned a sync, as a partial rollout's does; its newest with `only_newest_trains`,
    where rollout.maskOffPolicyInPartialRollout keeps the older tokens out of the loss; the engine's
    initial weights are version 0; a sample that names no version is not counted). Sync mode: 0
    with a sync after every rollout; async mode: up to asyncBufferSize."""
    behind = [syncs_behind(s["weight_versions"], trained_at, newest=only_newest_trains)
              for s in samples if s.get("weight_versions")]  # a custom generate may not say
    if not behind:
        return {}
    metrics = {"rollout/staleness/mean": sum(behind) / len(behind), "rollout/staleness/max": float(max(behind))}
    for lag in sorted(set(behind)):
        metrics[f"rollout/staleness/share_{lag}"] = behind.count(lag) / len(behind)
    return metrics


def train_on_dumps(job: Job, stop: StopRequest) -> None:
    """Train-only: the dumped rollouts in order, each trained as the loop trains it (no engines,
    so no weight sync), no checkpoints."""
    from rlkube_runtime.rollout_dump import load_rollout_dump

    plan = job.plan
    for rollout_id in plan.train_rollout_ids:
        step_start = time.monotonic()
        samples = load_rollout_dump(plan.load_rollouts, rollout_id, expected_samples=plan.spec.samples_per_rollout)
        metrics = {"rollout/raw_reward": sum(float(s["reward"]) for s in samples) / len(samples)}
        metrics.update(train(job, rollout_id, samples, sync=False))
        finish_rollout(job, rollout_id, metrics, None, step_start)
        if stop.requested:
            raise Preempted("stopped by SIGTERM; a train-only run keeps no checkpoints.")


def train(job: Job, rollout_id: int, samples, *, sync: bool, stop: StopRequest | None = None):
    """Train on one rollout, then (when `sync`) push the weights to the engines at version
    rollout_id + 1; a rollout still generating (async mode) finishes on the old weights first,
    as in slime's async loop (the rollout manager holds the sync until it is done).
    Colocated, around the hand-off (run/handoff.py)."""
    metrics = job.handoff.to_train()
    started = time.monotonic()
    metrics.update(job.trainers.train(rollout_id, samples))
    metrics["perf/actor_train_time"] = time.monotonic() - started
    sync = sync and not (stop is not None and stop.requested)  # stopping: the checkpoint has the weights
    job.handoff.to_sync(syncing=sync)
    if sync:
        started = time.monotonic()
        report = job.trainers.push_weights(job.rollouts, rollout_id + 1)
        seconds = time.monotonic() - started - report.waited_seconds
        metrics.update({"perf/update_weights_time": seconds, **report.metrics()})
    metrics.update(job.handoff.to_rollout(synced=sync))
    return metrics


def evaluate(job: Job, rollout_id: int) -> dict[str, float]:
    """The eval datasets' metrics when an evaluation is due after `rollout_id`, with its time."""
    if not job.plan.eval_due(rollout_id):
        return {}
    started = time.monotonic()
    return {**job.rollouts.evaluate(rollout_id + 1), "perf/eval_time": time.monotonic() - started}


def finish_rollout(job: Job, rollout_id: int, metrics, saved, step_start: float) -> None:
    restarts = job.rollouts.take_engine_restarts() if job.rollouts is not None else 0
    if job.rollouts is not None:
        job.report.watch_engines(job.rollouts.engine_urls())
    job.report.rollout(rollout_id, metrics, saved, seconds=time.monotonic() - step_start, new_engine_restarts=restarts)


def shutdown(job: Job, *, local: bool, finished: bool) -> None:
    import logging

    import ray

    job.report.close()
    if job.rollouts is not None:
        try:
            job.rollouts.shutdown(timeout=60)
        except Exception as err:  # shutting down after a failure must not hide that failure
            logging.getLogger("rlkube.run").warning("rollout manager shutdown failed: %s", err)
    # After a failure a rank may be gone, and the others' barrier would wait for it: Ray ends them.
    if finished and job.trainers is not None:
        try:
            job.trainers.close(timeout=60)
        except Exception as err:  # e.g. a rank already dead: the others are ended by Ray
            logging.getLogger("rlkube.run").warning("trainer shutdown failed: %s", err)
    if local:
        ray.shutdown()

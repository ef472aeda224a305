"""Where the run's numbers go: each rollout's metrics to the log, metrics.jsonl, TensorBoard,
Prometheus and the trackers; progress to the RLJob's status; the audit trail of trained samples;
the rollout dumps; and the block printed at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlkube_runtime.run.plan import InvalidSpec, RunError, RunPlan


def open_trackers(plan: RunPlan) -> list[Any]:
    """The W&B / MLflow runs spec.observability configures, continuing this job's run if any."""
    from rlkube_runtime.tracking import TrackingError, open_trackers as open_all, run_identity

    try:
        return open_all(plan.job, run_identity(plan.job, plan.output_dir))
    except TrackingError as err:
        raise RunError(str(err)) from None


def report_invalid_spec(err: Exception) -> None:
    """On a cluster, write the refusal to the RLJob's status (status.invalidSpec) so the operator
    fails the job with reason InvalidSpec rather than restarting it; best effort, like all reports."""
    from rlkube_runtime.spec.load import SpecError
    from rlkube_runtime.status_report import RLJobStatusReporter

    if not isinstance(err, (SpecError, InvalidSpec)):
        return
    reporter = RLJobStatusReporter.from_env()
    if reporter is None:
        return
    if isinstance(err, SpecError):
        message = "; ".join(f"{field}: {text}" if field else text for field, text in err.errors)
    else:
        message = str(err)
    reporter.report_invalid_spec(message)


class Report:
    """logger: a MetricsLogger; status: an RLJobStatusReporter, or None outside a cluster;
    summary: the RunSummary the end-of-run block renders."""

    def __init__(self, plan: RunPlan, logger: Any, status: Any, summary: Any, engine_restarts: int = 0):
        self.plan, self.logger, self.status, self.summary = plan, logger, status, summary
        self.engine_restarts = engine_restarts  # the job's total, earlier attempts included

    @classmethod
    def open(cls, plan: RunPlan, trackers: list[Any]) -> Report:
        from rlkube_runtime.metrics import MetricsLogger
        from rlkube_runtime.run_summary import RunSummary
        from rlkube_runtime.spec.contract import ENV_METRICS_PORT

        port = os.environ.get(ENV_METRICS_PORT)
        logger = MetricsLogger(plan.job.metadata.name, plan.output_dir, trackers=trackers,
                               prometheus_port=int(port) if port else None)
        status = _status_reporter()
        return cls(plan, logger, status, RunSummary(plan.job.metadata.name, plan.num_rollout),
                   engine_restarts=status.engine_restarts_so_far() if status is not None else 0)

    def rollout(self, rollout_id: int, metrics: dict[str, Any], checkpoint: dict[str, Any] | None, *,
                seconds: float, new_engine_restarts: int = 0) -> None:
        """The rollout's metrics to the log, TensorBoard and Prometheus; progress to the RLJob's status."""
        num_rollout = self.plan.num_rollout
        self.engine_restarts += new_engine_restarts
        if new_engine_restarts:
            self.logger.prometheus.count_engine_restarts(new_engine_restarts)
        metrics["rollout/engine_restarts"] = float(new_engine_restarts)
        if checkpoint is not None:
            metrics["checkpoint/last_time"] = checkpoint["time"].timestamp()
        metrics["perf/step_time"] = seconds
        metrics["progress/rollout"] = rollout_id
        metrics["progress/num_rollout"] = num_rollout
        self.logger.log(rollout_id, metrics)
        self.summary.add(rollout_id, metrics)
        if self.status is not None:
            self.status.report(
                rollout_id + 1,
                num_rollout,
                last_checkpoint=checkpoint,
                metrics={"reward_mean": metrics.get("rollout/raw_reward"), "kl": metrics.get("train/kl_loss"),
                         "step_seconds": seconds},
                engine_restarts=self.engine_restarts,
            )

    def watch_engines(self, urls: list[str]) -> None:
        """The engines whose own series the driver's /metrics passes through (serving/engine_metrics.py)."""
        self.logger.prometheus.watch_engines(urls)

    def eval_before_training(self, metrics: dict[str, float]) -> None:
        self.logger.log(-1, {**metrics, "progress/num_rollout": self.plan.spec.training.num_rollout})

    def trained_samples(self, rollout_id: int, samples: list[dict[str, Any]]) -> None:
        """Which samples each rollout trained on: the audit trail for 'no prompt skipped or doubled'."""
        record = {
            "rollout": rollout_id,
            "sample_indices": [s["index"] for s in samples],
            "group_indices": sorted({s["group_index"] for s in samples}),
            # The engines' weight versions that generated them: the sync before rollout k sets k.
            "weight_versions": sorted({v for s in samples for v in s.get("weight_versions") or []}),
        }
        with open(self.plan.output_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def dump(self, rollout_id: int, samples: list[dict[str, Any]], trainers: Any) -> None:
        """The rollout's samples to <output>/rollouts/rollout_<k>.jsonl (spec.observability.rolloutDump),
        with the advantages rank 0 trained on."""
        from rlkube_runtime.rollout_dump import samples_to_dump, write_rollout_dump

        count = samples_to_dump(samples, self.plan.rollout_dump, self.plan.spec.observability.rollout_dump_samples)
        if not count:
            return
        advantages = trainers.last_advantages(count) if trainers is not None else None
        write_rollout_dump(self.plan.dump_dir, rollout_id, samples[:count], advantages, samples_in_rollout=len(samples))

    def preempted(self, last_saved: int | None) -> None:
        """On Kubernetes, note in the RLJob's status that this attempt ended by a preemption with
        everything saved, so the operator resumes it without counting a failure."""
        from rlkube_runtime.status_report import attempt_from_env

        attempt = attempt_from_env()
        if self.status is not None and attempt is not None:
            self.status.report_preempted(attempt, last_saved)

    def close(self) -> None:
        self.logger.close()

    def summary_block(self, last_saved: int | None, last_saved_path: str | None, hf_export: str | None, *,
                      finished: bool) -> str:
        """What was done and where it is, and the command that goes on."""
        plan = self.plan
        command = f"rlkube run {plan.spec_path} --output-dir {plan.output_dir}"
        checkpoint = f"{last_saved_path} (rollout {last_saved + 1})" if last_saved is not None else None
        num_rollout = plan.spec.training.num_rollout
        if plan.mode == "rollout-only":
            next_steps = [("dumps", str(plan.dump_dir)),
                          ("train on them", f"{command}-train-only --debug-train-only --load-rollouts {plan.dump_dir}")]
        elif plan.mode == "train-only":
            next_steps = [("next", f"trained on the dumps in {plan.load_rollouts} (no checkpoints in train-only mode)")]
        elif last_saved is not None and last_saved + 1 == num_rollout:
            next_steps = [("next", f"all {num_rollout} rollouts done; with a larger training.numRollout `{command}` "
                                   "continues from the last checkpoint (--no-resume starts over)")]
        elif last_saved is not None:
            next_steps = [("resume", f"`{command}` continues from rollout {last_saved + 2}")]
        else:
            next_steps = [("resume", f"no checkpoint yet: `{command}` starts from rollout 1")]
        done_before = 0 if last_saved is None else last_saved + 1
        return self.summary.render(finished=finished, checkpoint=checkpoint, hf_export=hf_export,
                                   next_steps=next_steps, done_before=done_before)


def write_failure(output_dir: Path, err: BaseException) -> str:
    """The whole traceback to <output>/logs/failure.txt; the sentence that says where it is."""
    import traceback

    report = output_dir / "logs" / "failure.txt"
    try:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("".join(traceback.format_exception(err)), encoding="utf-8")
        return f"The full error: {report}"
    except OSError as unwritable:  # the cause may be this very disk being full
        return f"The full error could not be written to {report} ({unwritable.strerror or unwritable})"


def _status_reporter():
    """Reports progress to the RLJob's status when running inside the cluster; None locally."""
    try:
        from rlkube_runtime.status_report import RLJobStatusReporter
    except ImportError:
        return None
    return RLJobStatusReporter.from_env()

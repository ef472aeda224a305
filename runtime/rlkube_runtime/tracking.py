"""Experiment trackers (Weights & Biases, MLflow): each rollout's metrics under the JSONL's names.

Both sit behind `Tracker` (log one rollout, close) so `MetricsLogger` fans out to them like its
other sinks. A job keeps one tracker run over its whole life: restarts in a cluster (a new attempt,
a new RayJob) and local resumes continue the run they started, identified by `RunIdentity.run_id`
(W&B: the run's `id` with `resume="allow"`; MLflow: the `rlkube.run-id` tag of the run). Each
start records its attempt on the run.

Credentials come from the environment only (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...), in a
cluster from Secrets through `spec.resources.env`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlkube_runtime.spec import RLJob
from rlkube_runtime.spec.contract import ENV_ATTEMPT, ENV_RLJOB_NAME, ENV_RLJOB_NAMESPACE
from rlkube_runtime.spec.observability import MlflowSpec, ObservabilitySpec, WandbSpec

RUN_ID_TAG = "rlkube.run-id"
INSTALL_HINT = "pip install 'rlkube[tracking]'"


class TrackingError(RuntimeError):
    """A configured tracker cannot start; the message names its spec field and the cause."""


class Tracker(Protocol):
    def log(self, rollout_id: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunIdentity:
    job_name: str
    run_id: str  # the same for every start of one job: restarts and resumes continue one run
    attempt: str  # which start of the job this is ("local" outside a cluster)
    output_dir: Path


def run_identity(job: RLJob, output_dir: Path, env: Mapping[str, str] = os.environ) -> RunIdentity:
    """In a cluster the RLJob's namespace and name (every attempt logs to one run); locally the
    job's name and its output directory (running the same command again resumes into it)."""
    name = job.metadata.name
    if env.get(ENV_RLJOB_NAME):
        namespace = env.get(ENV_RLJOB_NAMESPACE) or job.metadata.namespace or "default"
        return RunIdentity(name, f"{namespace}-{env[ENV_RLJOB_NAME]}", env.get(ENV_ATTEMPT, "0"), output_dir)
    digest = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:8]
    return RunIdentity(name, f"{name}-{digest}", "local", output_dir)


def check_trackers_available(observability: ObservabilitySpec, env: Mapping[str, str] = os.environ) -> None:
    """Before anything starts: the configured trackers' packages are installed, and an online W&B
    run in a cluster has its API key (a pod cannot log in interactively)."""
    for field, spec, package in (("wandb", observability.wandb, "wandb"), ("mlflow", observability.mlflow, "mlflow")):
        if spec is not None and importlib.util.find_spec(package) is None:
            raise TrackingError(f"spec.observability.{field} is set but {package} is not installed: {INSTALL_HINT}")
    wandb = observability.wandb
    online = wandb is not None and wandb.mode == "online" and env.get("WANDB_MODE", "online") == "online"
    if online and env.get(ENV_RLJOB_NAME) and not env.get("WANDB_API_KEY"):
        raise TrackingError(
            "spec.observability.wandb: mode online needs WANDB_API_KEY in the pod's environment; add it to "
            "spec.resources.secretEnv from a Secret in the job's namespace, or set mode: offline"
        )


def tracker_config(job: RLJob) -> dict[str, Any]:
    """The spec as the trackers record it, environment variables by name only: everyone who can see
    the run sees it (the spec refuses credentials written into it, and this keeps any other value
    out too)."""
    config = job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    resources = config.get("resources") or {}
    resources["env"] = [{"name": var.get("name")} for var in resources.get("env") or []]
    return config


def open_trackers(job: RLJob, identity: RunIdentity) -> list[Tracker]:
    """The trackers spec.observability configures (none by default), each run started."""
    observability = job.spec.observability
    config = tracker_config(job)
    trackers: list[Tracker] = []
    try:
        if observability.wandb is not None:
            trackers.append(WandbTracker(observability.wandb, identity, config))
        if observability.mlflow is not None:
            trackers.append(MlflowTracker(observability.mlflow, identity, config))
    except Exception:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (what a tracker can plot)."""
    import math

    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class WandbTracker:
    """A W&B run, x axis `rollout` (so a rollout redone after a resume is logged again, not dropped
    as an old step)."""

    def __init__(self, spec: WandbSpec, identity: RunIdentity, config: dict[str, Any]):
        import wandb

        try:
            self._run = wandb.init(
                project=spec.project,
                entity=spec.entity,
                name=spec.run_name or identity.job_name,
                id=identity.run_id,
                resume="allow",
                mode=spec.mode,
                dir=str(identity.output_dir),
                config={"spec": config},
                # No console capture or system metrics: the run's numbers only.
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )
        except Exception as err:  # noqa: BLE001 - wandb raises its own types for login, network, ...
            raise TrackingError(f"spec.observability.wandb: could not start the W&B run: {err}") from err
        self._run.config.update({"rlkube_attempt": identity.attempt}, allow_val_change=True)
        self._run.define_metric("rollout")
        self._run.define_metric("*", step_metric="rollout")

    def log(self, rollout_id: int, metrics: Mapping[str, float]) -> None:
        self._run.log({**numeric(metrics), "rollout": rollout_id})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run found by its `rlkube.run-id` tag, else created; metrics at step = rollout."""

    def __init__(self, spec: MlflowSpec, identity: RunIdentity, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        try:
            self._client = client = MlflowClient(tracking_uri=spec.tracking_uri)
            name = spec.experiment or identity.job_name
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
            found = client.search_runs(
                [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{identity.run_id}'", max_results=1
            )
            if found:
                self.run_id = found[0].info.run_id
                client.update_run(self.run_id, status="RUNNING")
            else:
                run = client.create_run(
                    experiment_id,
                    run_name=spec.run_name or identity.job_name,
                    tags={RUN_ID_TAG: identity.run_id, "rlkube.rljob": identity.job_name},
                )
                self.run_id = run.info.run_id
                client.log_dict(self.run_id, config, "rljob-spec.json")
            client.set_tag(self.run_id, "rlkube.attempt", identity.attempt)
        except Exception as err:  # noqa: BLE001 - unreachable server, bad URI, permissions
            raise TrackingError(f"spec.observability.mlflow: could not start the MLflow run at {spec.tracking_uri}: {err}") from err

    def log(self, rollout_id: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, rollout_id) for key, value in numeric(metrics).items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)

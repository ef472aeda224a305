"""`status`: what the operator observed, written by the operator only (the status subresource).

Unknown status keys are ignored rather than rejected: kopf keeps its own bookkeeping under
`status` too, and a typed view of a live object must still load.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Literal, Optional

from pydantic import ConfigDict, Field

from .base import SpecModel


class RLJobPhase(str, Enum):
    """Where the job is in its life; exactly one at a time."""

    PENDING = "Pending"  # accepted, nothing created yet
    QUEUED = "Queued"  # spec.queueName: the RayJob waits, suspended, for Kueue to admit it
    STARTING = "Starting"  # RayJob created, pods or the runtime not up yet
    RUNNING = "Running"  # rollouts in progress
    RESTARTING = "Restarting"  # an attempt failed; waiting out the backoff before resuming from a checkpoint
    SUSPENDED = "Suspended"  # spec.suspend is true; no pods
    SUCCEEDED = "Succeeded"  # all numRollout rollouts done
    FAILED = "Failed"  # permanent error, backoffLimit exhausted or activeDeadlineSeconds passed


TERMINAL_PHASES = frozenset({RLJobPhase.SUCCEEDED, RLJobPhase.FAILED})


class StatusModel(SpecModel):
    """Status sections: lenient about extra keys, and enum/time values arrive as JSON strings."""

    model_config = ConfigDict(extra="ignore", strict=False)


class Condition(StatusModel):
    """One observed aspect of the job, keyed by type (standard Kubernetes condition shape)."""

    type: str = Field(description="Condition type, e.g. Ready, Progressing, Failed. Unique within conditions.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: Optional[str] = Field(default=None, description="CamelCase machine-readable reason of the last transition.")
    message: Optional[str] = Field(default=None, description="Human-readable details of the last transition.")
    last_transition_time: Optional[datetime] = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: Optional[int] = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class Progress(StatusModel):
    """Rollouts completed so far."""

    rollout: int = Field(default=0, description="Rollouts completed (the next rollout id to run).")
    num_rollout: Optional[int] = Field(default=None, description="Total rollouts of the job (spec.training.numRollout).")


class LastCheckpoint(StatusModel):
    """The latest complete checkpoint: where a restarted attempt resumes."""

    rollout: Optional[int] = Field(default=None, description="Rollout id the checkpoint was taken after.")
    path: Optional[str] = Field(default=None, description="Checkpoint directory.")
    time: Optional[datetime] = Field(default=None, description="When it was completed (RFC 3339).")


class Restarts(StatusModel):
    """Restart counters."""

    engine: int = Field(default=0, description="Rollout engines restarted by the runtime.")
    job: int = Field(
        default=0,
        description="Training attempts restarted by the operator, preemptions included; the failures among them "
        "(job - preemptions) are bounded by faultTolerance.backoffLimit.",
    )
    preemptions: int = Field(
        default=0,
        description="Attempts that stopped on SIGTERM after saving a checkpoint (preemption, node drain) and were "
        "resumed at once; not counted against faultTolerance.backoffLimit.",
    )


class LastPreemption(StatusModel):
    """Written by the runtime when an attempt stops on SIGTERM having saved every trained rollout:
    the operator reads the attempt's end as a preemption to resume from, not a failure."""

    attempt: int = Field(description="The attempt (RayJob `<name>-<attempt>`) that was preempted.")
    rollout: Optional[int] = Field(
        default=None, description="Rollout id of the checkpoint it saved; absent when nothing was trained yet."
    )
    time: Optional[datetime] = Field(default=None, description="When it stopped (RFC 3339).")


class LastMetrics(StatusModel):
    """Metrics of the latest rollout (the full series is in Prometheus)."""

    reward_mean: Optional[float] = Field(default=None, description="Mean raw reward of the latest rollout.")
    kl: Optional[float] = Field(default=None, description="Mean KL(policy || reference) of the latest training step.")
    step_seconds: Optional[float] = Field(default=None, description="Seconds of the latest rollout step end to end.")


class SpecRefusal(StatusModel):
    """The runtime's refusal of the spec at the start of an attempt (written by the runtime)."""

    attempt: Optional[int] = Field(default=None, description="The attempt (restarts.job) whose runtime refused the spec.")
    message: Optional[str] = Field(
        default=None, description="Why, naming the spec field, e.g. 'spec.training.backend: ...'."
    )


class RLJobStatus(StatusModel):
    """Observed state of an RLJob."""

    phase: Optional[RLJobPhase] = Field(
        default=None,
        description="Pending, Queued, Starting, Running, Restarting, Suspended, Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Observed conditions, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: Optional[int] = Field(
        default=None, description="metadata.generation this status reflects."
    )
    progress: Optional[Progress] = Field(default=None, description="Rollouts completed out of numRollout.")
    progress_text: Optional[str] = Field(
        default=None, description="Progress as 'k/N' for kubectl get (JSONPath cannot format numbers)."
    )
    last_checkpoint: Optional[LastCheckpoint] = Field(default=None, description="Latest complete checkpoint.")
    restarts: Optional[Restarts] = Field(default=None, description="Engine, job and preemption restart counts.")
    last_preemption: Optional[LastPreemption] = Field(
        default=None, description="The latest attempt that stopped on SIGTERM with a checkpoint (written by the runtime)."
    )
    metrics: Optional[LastMetrics] = Field(default=None, description="Metrics of the latest rollout.")
    ray_job_name: Optional[str] = Field(default=None, description="Name of the current attempt's RayJob.")
    ray_cluster_name: Optional[str] = Field(default=None, description="Name of the current attempt's RayCluster.")
    dashboard_url: Optional[str] = Field(default=None, description="Ray dashboard URL of the current attempt.")
    message: Optional[str] = Field(default=None, description="Human-readable summary of the current phase, e.g. the cause of a failure.")
    invalid_spec: Optional[SpecRefusal] = Field(
        default=None,
        description="Set by the runtime when it refuses the spec at an attempt's start (a setting it cannot honour); "
        "the operator then fails the job with reason InvalidSpec instead of starting another attempt.",
    )


def format_progress(rollout: int, num_rollout: int) -> str:
    """The `progressText` value: 'k/N'."""
    return f"{rollout}/{num_rollout}"

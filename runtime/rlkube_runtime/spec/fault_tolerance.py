"""`spec.faultTolerance`: engine health checks and restart budgets."""

from __future__ import annotations

from pydantic import Field

from .base import SpecModel, section


class HealthCheckSpec(SpecModel):
    """Rollout-engine health check: a 1-token generation (/health_generate) per engine."""

    interval_seconds: float = Field(default=30, gt=0, description="Seconds between health checks. Default 30, > 0.")
    timeout_seconds: float = Field(
        default=30, gt=0, description="Seconds an engine has to answer before it counts as dead. Default 30, > 0."
    )
    first_wait_seconds: float = Field(
        default=300, ge=0, description="Grace period after an engine starts (model loading) before checks begin. Default 300, >= 0."
    )


class FaultToleranceSpec(SpecModel):
    """What is restarted when something dies, and how many times."""

    enabled: bool = Field(
        default=True, description="Restart dead rollout engines and failed training attempts. Default true."
    )
    health_check: HealthCheckSpec = section(HealthCheckSpec, "Rollout-engine health check.")
    max_engine_restarts: int = Field(
        default=3, ge=0, description="Engine restarts allowed per job before it fails. Default 3, >= 0."
    )
    backoff_limit: int = Field(
        default=3,
        ge=0,
        description="Failed training attempts (trainer crash, lost node) retried from the last checkpoint before the "
        "job is Failed. Default 3, >= 0.",
    )
    termination_grace_period_seconds: int = Field(
        default=600,
        ge=0,
        description="Seconds a pod may take to stop after SIGTERM (preemption, suspend, a node drain): the run "
        "finishes the rollout it is training, saves a checkpoint of everything trained and exits. Set it above the "
        "time a training step plus a checkpoint of the model and optimizer take. Default 600, >= 0.",
    )
    backoff_seconds: float = Field(
        default=10,
        ge=0,
        description="Delay before the first retry of a failed attempt; doubles with each further retry. The same "
        "delay, doubling, comes before every preemption's resume but the first. Default 10, >= 0.",
    )
    max_preemptions: int = Field(
        default=10,
        ge=0,
        description="Preemptions (SIGTERM: a node drain, a higher-priority job, Kueue) the job is resumed after; the "
        "next one fails it (reason PreemptionLimitExceeded, checkpoints kept). The first resume is immediate, each "
        "further one waits backoffSeconds x 2^(preemptions before it - 1), capped by the operator. Raise it on a "
        "cluster that preempts often. Default 10, >= 0.",
    )

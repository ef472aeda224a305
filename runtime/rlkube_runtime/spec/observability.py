"""`spec.observability`: where a run's numbers and rollouts go beyond the JSONL log, TensorBoard and
Prometheus, which are always on.

Weights & Biases and MLflow are off unless their section is set. Their credentials never live in
the spec: the runtime reads them from its environment (`WANDB_API_KEY`; `MLFLOW_TRACKING_TOKEN` or
`MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD`), which in a cluster comes from a Secret
through `spec.resources.env` (`valueFrom.secretKeyRef`).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .base import SpecModel

RolloutDumpMode = Literal["sample", "all", "off"]


class WandbSpec(SpecModel):
    """A Weights & Biases run that receives every rollout's metrics under the JSONL's names."""

    project: str = Field(min_length=1, max_length=128, description="W&B project. Required.")
    entity: Optional[str] = Field(
        default=None, min_length=1, max_length=128, description="W&B entity (user or team). Default: the API key's default entity."
    )
    run_name: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Display name of the run. Default: the RLJob's name. In a cluster every attempt of the RLJob "
        "logs to one run (its id is derived from the RLJob's namespace and name).",
    )
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="online: stream to the W&B server (needs WANDB_API_KEY in the environment, from a Secret through "
        "resources.env); offline: write the run under <output>/wandb for `wandb sync`. Default online.",
    )


class MlflowSpec(SpecModel):
    """An MLflow run that receives every rollout's metrics under the JSONL's names."""

    tracking_uri: str = Field(
        min_length=1,
        description="MLflow tracking server URI (http(s)://..., or file:/path for a local store). Required. "
        "Credentials: MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD in the environment.",
    )
    experiment: Optional[str] = Field(
        default=None, min_length=1, description="Experiment name, created when missing. Default: the RLJob's name."
    )
    run_name: Optional[str] = Field(
        default=None,
        min_length=1,
        description="Run name. Default: the RLJob's name. A restarted or resumed job continues the run it "
        "started, found by the rlkube.run-id tag.",
    )


class ObservabilitySpec(SpecModel):
    """Experiment trackers and rollout dumps."""

    wandb: Optional[WandbSpec] = Field(default=None, description="Log to Weights & Biases. Default: unset (off).")
    mlflow: Optional[MlflowSpec] = Field(default=None, description="Log to MLflow. Default: unset (off).")
    rollout_dump: RolloutDumpMode = Field(
        default="sample",
        description="Per rollout, write prompts, responses, rewards, advantages and engine logprobs to "
        "<output>/rollouts/rollout_<k>.jsonl. sample: the first rolloutDumpSamples samples (whole groups); all: "
        "every sample (what `rlkube run --debug-train-only --load-rollouts DIR` trains on); off: nothing. "
        "Default sample.",
    )
    rollout_dump_samples: int = Field(
        default=32, ge=1, le=100000, description="Samples written per rollout with rolloutDump: sample. Default 32; 1..100000."
    )

"""`spec.resources`: where the trainer and the rollout engines run on the cluster.

Kubernetes sub-objects (ResourceRequirements, Toleration, Volume, VolumeMount, EnvVar) are kept as
free dicts: they are copied into the pods unchanged and the API server validates them there.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .base import KubeObject, SpecModel, immutable_field, section

_RESOURCES_DOC = (
    "Kubernetes ResourceRequirements of each pod (requests, limits); GPUs are added from the GPU count. "
    "Default: none beyond the GPUs."
)


class TrainerResources(SpecModel):
    """The trainer's pods: one Ray worker pod per node."""

    nodes: int = Field(default=1, ge=1, description="Trainer nodes (pods). Default 1, >= 1.")
    gpus_per_node: int = Field(
        default=8, ge=0, description="GPUs per trainer node; the trainer has nodes x gpusPerNode ranks. Default 8, >= 0."
    )
    image: Optional[str] = Field(default=None, min_length=1, description="Container image. Default: the operator's runtime image.")
    resources: KubeObject = Field(default_factory=dict, description=_RESOURCES_DOC)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector. Default: none.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Pod tolerations (Kubernetes Toleration objects). Default: none.")


class RolloutResources(SpecModel):
    """The rollout engines' pods (separate placement only; colocated engines share the trainer's GPUs)."""

    gpus: int = Field(
        default=8,
        ge=0,
        description="GPUs for rollout engines in separate placement, split into engines of rollout.gpusPerEngine. "
        "Ignored when colocated. Default 8, >= 0.",
    )
    image: Optional[str] = Field(default=None, min_length=1, description="Container image. Default: trainer.image or the operator's runtime image.")
    resources: KubeObject = Field(default_factory=dict, description=_RESOURCES_DOC)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector. Default: none.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Pod tolerations (Kubernetes Toleration objects). Default: none.")


class ResourcesSpec(SpecModel):
    """Placement and pods of the trainer and the rollout engines, plus what every pod mounts."""

    placement: Literal["separate", "colocated"] = Field(
        default="separate",
        json_schema_extra=immutable_field("resources.placement"),
        description="separate: engines get their own GPUs (rollout.gpus). colocated: engines share the trainer's "
        "GPUs, trainer and engines releasing memory in turn (not with training.mode async). Default separate; "
        "fixed after creation.",
    )
    trainer: TrainerResources = section(TrainerResources, "Trainer pods.")
    rollout: RolloutResources = section(RolloutResources, "Rollout-engine pods (separate placement).")
    volumes: list[KubeObject] = Field(
        default_factory=list,
        description="Kubernetes Volumes added to every pod (e.g. a PVC holding checkpoints and data). Default: none.",
    )
    volume_mounts: list[KubeObject] = Field(
        default_factory=list, description="Kubernetes VolumeMounts added to every container. Default: none."
    )
    env: list[KubeObject] = Field(
        default_factory=list,
        description="Kubernetes EnvVars added to every container (secrets via valueFrom.secretKeyRef). Default: none.",
    )

"""`spec.resources`: where the trainer and the rollout engines run on the cluster.

Kubernetes sub-objects (ResourceRequirements, Toleration, Affinity, Volume, VolumeMount, EnvVar) are
kept as free dicts: they are copied into the pods unchanged and the API server validates them there.
Pod labels and annotations are checked here instead: KubeRay creates the pods, so a bad key would
only surface as pods that never appear.

The head (`head`): what the driver's pod asks for. Per group (`trainer`, `rollout`): what differs between GPU pools (GPU resource name, placement,
pod metadata). Job-wide: what every pod of the job shares (pull secrets, priority, /dev/shm, pod
metadata), the Ray head included.
"""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, Field, model_validator
from pydantic.alias_generators import to_camel

from .base import API_GROUP, KubeObject, SpecModel, cel_rules, cross_field_error, immutable_field, section

_RESOURCES_DOC = (
    "Kubernetes ResourceRequirements of each pod (requests, limits); GPUs are added from the GPU count "
    "under gpuResourceName, which must not be set here. Default: none beyond the GPUs."
)

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"

# Kubernetes name syntax (k8s.io/apimachinery/pkg/util/validation), RE2-compatible so the API
# server can use the same patterns in the CRD.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN_PATTERN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$"
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
QUALIFIED_NAME_PATTERN = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_NAME}$"
EXTENDED_RESOURCE_PATTERN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*/{_NAME}$"
LABEL_VALUE_PATTERN = rf"^({_NAME})?$"
# A positive memory quantity: 16Gi, 512Mi, 1.5G, 1073741824.
POSITIVE_QUANTITY_PATTERN = r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_DNS_SUBDOMAIN_RE = re.compile(DNS_SUBDOMAIN_PATTERN)
_QUALIFIED_NAME_RE = re.compile(QUALIFIED_NAME_PATTERN)
_EXTENDED_RESOURCE_RE = re.compile(EXTENDED_RESOURCE_PATTERN)
_LABEL_VALUE_RE = re.compile(LABEL_VALUE_PATTERN)
_QUANTITY_RE = re.compile(POSITIVE_QUANTITY_PATTERN)
_NAME_MAX, _PREFIX_MAX = 63, 253

# Pod labels the job's own machinery selects on: rlkube's (rljob, attempt, role), KubeRay's (it
# finds a cluster's pods by ray.io/* labels) and the managed-by label rlkube sets. A user label
# with one of these keys would hide pods from the operator or KubeRay, so it is refused.
RESERVED_LABEL_PREFIXES = (f"{API_GROUP}/", "ray.io/")
RESERVED_LABELS = ("app.kubernetes.io/managed-by",)
RESERVED_ANNOTATION_PREFIXES = (f"{API_GROUP}/",)


def _check_extended_resource(value: str) -> str:
    if len(value) > _PREFIX_MAX + 1 + _NAME_MAX or not _EXTENDED_RESOURCE_RE.match(value):
        raise ValueError(
            f"must be a Kubernetes extended resource name as '<vendor domain>/<name>' "
            f"(e.g. {DEFAULT_GPU_RESOURCE}, amd.com/gpu), got {value!r}"
        )
    return value


def _check_dns_subdomain(value: str) -> str:
    if len(value) > _PREFIX_MAX or not _DNS_SUBDOMAIN_RE.match(value):
        raise ValueError(
            f"must be a Kubernetes object name: at most {_PREFIX_MAX} lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, got {value!r}"
        )
    return value


def _check_quantity(value: str) -> str:
    if not _QUANTITY_RE.match(value):
        raise ValueError(f"must be a positive Kubernetes quantity of bytes such as 16Gi or 512Mi, got {value!r}")
    return value


ExtendedResourceName = Annotated[
    str, AfterValidator(_check_extended_resource), Field(json_schema_extra={"pattern": EXTENDED_RESOURCE_PATTERN})
]
"""A device plugin's resource name, e.g. nvidia.com/gpu, amd.com/gpu."""

ObjectName = Annotated[
    str,
    AfterValidator(_check_dns_subdomain),
    Field(min_length=1, max_length=_PREFIX_MAX, json_schema_extra={"pattern": DNS_SUBDOMAIN_PATTERN}),
]
"""The name of another Kubernetes object (a PriorityClass, a Secret): a DNS-1123 subdomain."""

def _check_label_value(value: str) -> str:
    if len(value) > _NAME_MAX or not _LABEL_VALUE_RE.match(value):
        raise ValueError(
            f"must be a label value: at most {_NAME_MAX} letters, digits, '-', '_' and '.', alphanumeric at both ends, "
            f"got {value!r}"
        )
    return value


LabelValue = Annotated[str, AfterValidator(_check_label_value), Field(json_schema_extra={"pattern": LABEL_VALUE_PATTERN})]
"""A Kubernetes label value (the operator puts it on the objects it creates)."""

MemoryQuantity = Annotated[
    str, AfterValidator(_check_quantity), Field(json_schema_extra={"pattern": POSITIVE_QUANTITY_PATTERN})
]
"""A positive number of bytes in Kubernetes quantity form (16Gi, 512Mi)."""


def key_problem(key: str) -> str | None:
    """Why `key` is not a valid label or annotation key ('[prefix/]name'), or None if it is."""
    prefix, _, name = key.rpartition("/")
    if not _QUALIFIED_NAME_RE.match(key) or len(name) > _NAME_MAX or len(prefix) > _PREFIX_MAX:
        return (
            f"key {key!r} must be '[prefix/]name': a name of at most {_NAME_MAX} letters, digits, '-', '_' and '.' "
            f"(alphanumeric at both ends), after an optional DNS subdomain prefix of at most {_PREFIX_MAX} characters"
        )
    return None


def check_pod_labels(labels: dict[str, str]) -> dict[str, str]:
    """Label keys and values Kubernetes accepts, none of them one the job's machinery selects on."""
    for key, value in labels.items():
        problem = key_problem(key)
        if problem:
            raise ValueError(problem)
        if key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABELS:
            raise ValueError(
                f"label {key!r} is reserved: rlkube and KubeRay find the job's pods by the labels "
                f"{', '.join(p + '*' for p in RESERVED_LABEL_PREFIXES)} and {', '.join(RESERVED_LABELS)}; "
                "use a key outside them"
            )
        if len(value) > _NAME_MAX or not _LABEL_VALUE_RE.match(value):
            raise ValueError(
                f"label {key!r}: value {value!r} must be empty or at most {_NAME_MAX} letters, digits, '-', '_' "
                "and '.', alphanumeric at both ends"
            )
    return labels


def check_pod_annotations(annotations: dict[str, str]) -> dict[str, str]:
    """Annotation keys Kubernetes accepts, none under rlkube's own prefix."""
    for key in annotations:
        problem = key_problem(key)
        if problem:
            raise ValueError(problem)
        if key.startswith(RESERVED_ANNOTATION_PREFIXES):
            raise ValueError(
                f"annotation {key!r} is reserved for rlkube ({RESERVED_ANNOTATION_PREFIXES[0]}*); use another key"
            )
    return annotations


_GROUP_PODS = "the group's pods, on top of resources.{field} (a key set in both takes this value)"
_ALL_PODS = "every pod of the job (head, workers, submitter)"

PodLabels = Annotated[dict[str, str], AfterValidator(check_pod_labels)]
PodAnnotations = Annotated[dict[str, str], AfterValidator(check_pod_annotations)]


# The fields both groups have, defined once so the two groups' docs cannot drift apart.


def gpu_resource_name_field() -> Any:
    return Field(
        default=DEFAULT_GPU_RESOURCE,
        max_length=_PREFIX_MAX + 1 + _NAME_MAX,
        description="Kubernetes resource the group's GPUs are requested as (the device plugin's name, e.g. "
        "amd.com/gpu, gpu.intel.com/i915). Default nvidia.com/gpu.",
    )


def affinity_field() -> Any:
    return Field(
        default_factory=dict,
        description="Pod affinity (a Kubernetes Affinity: nodeAffinity, podAffinity, podAntiAffinity) of the "
        "group's pods; the Ray head does not take it. Default: none.",
    )


def pod_labels_field(scope: str) -> Any:
    return Field(
        default_factory=dict,
        description=f"Labels added to {scope}. Keys under rlkube.io/ and ray.io/ and "
        "app.kubernetes.io/managed-by are refused: the operator and KubeRay select pods by them. Default: none.",
    )


def pod_annotations_field(scope: str) -> Any:
    return Field(
        default_factory=dict,
        description=f"Annotations added to {scope}; keys under rlkube.io/ are refused. Default: none.",
    )


# What the Ray head asks for when the RLJob says nothing: it runs Ray's GCS and dashboard and the
# driver (the loop, rewards, checkpoints' bookkeeping), no model.
DEFAULT_HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}}


class HeadResources(SpecModel):
    """The Ray head pod: Ray's GCS and job server and the driver (`rlkube run`'s loop); no GPU."""

    resources: KubeObject = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_HEAD_RESOURCES),
        description="Kubernetes ResourceRequirements of the head pod (requests, limits). Default: requests of "
        "2 CPUs and 8Gi of memory; a small job on a small node asks for less.",
    )


class TrainerResources(SpecModel):
    """The trainer's pods: one Ray worker pod per node."""

    nodes: int = Field(default=1, ge=1, description="Trainer nodes (pods). Default 1, >= 1.")
    gpus_per_node: int = Field(
        default=8, ge=0, description="GPUs per trainer node; the trainer has nodes x gpusPerNode ranks. Default 8, >= 0."
    )
    gpu_resource_name: ExtendedResourceName = gpu_resource_name_field()
    image: Optional[str] = Field(default=None, min_length=1, description="Container image. Default: the operator's runtime image.")
    resources: KubeObject = Field(default_factory=dict, description=_RESOURCES_DOC)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector. Default: none.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Pod tolerations (Kubernetes Toleration objects). Default: none.")
    affinity: KubeObject = affinity_field()
    pod_labels: PodLabels = pod_labels_field(_GROUP_PODS.format(field="podLabels"))
    pod_annotations: PodAnnotations = pod_annotations_field(_GROUP_PODS.format(field="podAnnotations"))


class RolloutResources(SpecModel):
    """The rollout engines' pods (separate placement only; colocated engines share the trainer's GPUs)."""

    gpus: int = Field(
        default=8,
        ge=0,
        description="GPUs for rollout engines in separate placement, split into engines of rollout.gpusPerEngine. "
        "Leave unset when colocated. Default 8, >= 0.",
    )
    gpu_resource_name: ExtendedResourceName = gpu_resource_name_field()
    image: Optional[str] = Field(default=None, min_length=1, description="Container image. Default: trainer.image or the operator's runtime image.")
    resources: KubeObject = Field(default_factory=dict, description=_RESOURCES_DOC)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector. Default: none.")
    tolerations: list[KubeObject] = Field(default_factory=list, description="Pod tolerations (Kubernetes Toleration objects). Default: none.")
    affinity: KubeObject = affinity_field()
    pod_labels: PodLabels = pod_labels_field(_GROUP_PODS.format(field="podLabels"))
    pod_annotations: PodAnnotations = pod_annotations_field(_GROUP_PODS.format(field="podAnnotations"))


_COLOCATED_ROLLOUT = (
    "resources.rollout.{field} is set, but resources.placement is colocated: the engines run in the trainer's pods "
    "(resources.trainer) and nothing reads it; remove it, or set resources.placement: separate"
)


def colocated_rollout_violations(placement: str, rollout: RolloutResources) -> list[tuple[str, str]]:
    """Colocated engines run in the trainer's pods, so every resources.rollout field would go
    unused: one set to anything but its default is refused rather than ignored."""
    if placement != "colocated":
        return []
    default = RolloutResources()
    return [(f"rollout.{to_camel(name)}", _COLOCATED_ROLLOUT.format(field=to_camel(name)))
            for name in RolloutResources.model_fields if getattr(rollout, name) != getattr(default, name)]


def _colocated_rollout_rules() -> list[dict[str, str]]:
    """The CEL side of colocated_rollout_violations: one rule per field, naming it. The free-form
    Kubernetes objects (resources, affinity) have no CEL rule: CEL cannot look inside them, so
    the spec model alone refuses those (the operator fails such a job at once, naming the field)."""
    rules = []
    for name, info in RolloutResources.model_fields.items():
        field = f"self.rollout.{to_camel(name)}"
        if info.default_factory is not None:
            if info.annotation == KubeObject:
                continue
            unset = f"!has({field}) || size({field}) == 0"
        elif info.default is None:
            unset = f"!has({field})"
        else:
            value = info.default if not isinstance(info.default, str) else f"'{info.default}'"
            unset = f"{field} == {value}"
        rules.append({
            "rule": f"self.placement != 'colocated' || !has(self.rollout) || {unset}",
            "message": _COLOCATED_ROLLOUT.format(field=to_camel(name)),
            "fieldPath": f".rollout.{to_camel(name)}",
        })
    return rules


class LocalObjectReference(SpecModel):
    """A Secret in the job's namespace, by name (Kubernetes LocalObjectReference)."""

    name: ObjectName = Field(description="Name of the Secret. Required.")


# Environment variables rlkube and Ray set in the job's pods themselves (the RLJob, attempt and role;
# Ray's token authentication, which KubeRay sets): a user value would silently change them.
RESERVED_ENV_PREFIXES = ("RLKUBE_", "RAY_")
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
_ENV_NAME_RE = re.compile(ENV_NAME_PATTERN)
MAX_SECRET_ENV = 32


# A variable with one of these names holds a credential: its value must come from a Secret, since a
# value written in the spec is stored in the RLJob, its spec ConfigMap and the trackers' config.
CREDENTIAL_ENV_PATTERN = r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|CREDENTIALS)$"
_CREDENTIAL_ENV_RE = re.compile(CREDENTIAL_ENV_PATTERN)
CREDENTIAL_MESSAGE = (
    "{name!r} holds a credential: a value written here is stored in the RLJob, its spec ConfigMap and the "
    "trackers' config; put it in a Secret and name it in resources.secretEnv"
)


def env_name_problem(name: Any) -> str | None:
    """Why `name` cannot be an environment variable of the job's pods, or None."""
    if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
        return f"name {name!r} must be a variable name: letters, digits and '_', not starting with a digit"
    if name.startswith(RESERVED_ENV_PREFIXES):
        return (
            f"{name!r}: variables starting with {' or '.join(RESERVED_ENV_PREFIXES)} are set by rlkube and Ray "
            "in the job's pods (its RLJob, attempt, role, Ray's authentication); a value here would change them"
        )
    return None


def _check_env_name(name: str) -> str:
    problem = env_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


EnvName = Annotated[str, AfterValidator(_check_env_name), Field(json_schema_extra={"pattern": ENV_NAME_PATTERN})]


class SecretEnvVar(SpecModel):
    """One environment variable of every container, read from a key of a Secret in the job's namespace."""

    name: EnvName = Field(max_length=256, description="The variable, e.g. WANDB_API_KEY. Names starting with "
                          "RLKUBE_ or RAY_ are refused. Required.")
    secret_name: ObjectName = Field(description="The Secret, in the RLJob's namespace. Required.")
    key: str = Field(min_length=1, max_length=253, description="The key in the Secret. Required.")
    optional: bool = Field(default=False, description="Start without the variable when the Secret or key is "
                           "missing. Default false.")


class ResourcesSpec(SpecModel):
    """Placement and pods of the trainer and the rollout engines, plus what every pod mounts."""

    model_config = cel_rules(*_colocated_rollout_rules())

    placement: Literal["separate", "colocated"] = Field(
        default="separate",
        json_schema_extra=immutable_field("resources.placement"),
        description="separate: engines get their own GPUs (rollout.gpus). colocated: engines share the trainer's "
        "GPUs, trainer and engines releasing memory in turn (not with training.mode async). Default separate; "
        "fixed after creation.",
    )
    head: HeadResources = section(HeadResources, "The Ray head pod (the driver).")
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
        description="Kubernetes EnvVars added to every container. Names starting with RLKUBE_ or RAY_ are refused "
        "(rlkube and Ray set those); valueFrom.secretKeyRef only of Secrets the cluster admin allows (the "
        "operator's podPolicy.secretNames): a job's own Secrets go through secretEnv. Default: none.",
    )
    secret_env: list[SecretEnvVar] = Field(
        default_factory=list,
        max_length=MAX_SECRET_ENV,
        description="Environment variables of every container read from Secrets in the job's namespace (W&B, "
        "MLflow, Hugging Face tokens): the one way for a job's own Secrets into its pods. Whoever creates or "
        "changes the RLJob must be allowed to read each Secret (the chart's admission policy asks the API "
        "server); the Secret's value never enters the spec or the spec file. At most "
        f"{MAX_SECRET_ENV}. Default: none.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        description="Secrets (by name, in the job's namespace) to pull the images with, on every pod: the Ray head "
        "and workers, and KubeRay's job-submitter pod. Default: none.",
    )
    priority_class_name: Optional[ObjectName] = Field(
        default=None,
        description="PriorityClass of every pod (head, workers, submitter); Kueue also reads it as the job's "
        "priority. Default: unset (the cluster's default priority).",
    )
    shared_memory_size: Optional[MemoryQuantity] = Field(
        default=None,
        description="Size limit of /dev/shm (a memory-backed emptyDir) on every Ray pod; NCCL, Ray's object store "
        "and PyTorch's data loaders live there, and what they use counts against the container's memory. "
        "Default: unset, which keeps KubeRay's own /dev/shm, sized to the container's memory limit (else its "
        "request, else unbounded). Cannot be combined with a volumeMount at /dev/shm. A positive quantity, e.g. 64Gi.",
    )
    pod_labels: PodLabels = pod_labels_field(_ALL_PODS)
    pod_annotations: PodAnnotations = pod_annotations_field(_ALL_PODS)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "ResourcesSpec":
        violations = colocated_rollout_violations(self.placement, self.rollout)
        violations += env_violations(self.env, self.secret_env)
        for group in ("head", "trainer", "rollout"):
            extra = sorted(set(getattr(self, group).resources) - set(RESOURCE_REQUIREMENT_KEYS))
            if extra:
                violations.append((f"{group}.resources.{extra[0]}", (
                    f"only {' and '.join(RESOURCE_REQUIREMENT_KEYS)} are rendered into the pods; remove {extra[0]}"
                )))
        gpu_names = {DEFAULT_GPU_RESOURCE, self.trainer.gpu_resource_name, self.rollout.gpu_resource_name}
        for section in RESOURCE_REQUIREMENT_KEYS:
            for name in sorted(gpu_names & set(self.head.resources.get(section) or {})):
                violations.append((f"head.resources.{section}", (
                    f"{name}: the Ray head runs no GPU work (num-gpus 0), so a GPU there would sit idle; "
                    "GPUs belong to resources.trainer and resources.rollout"
                )))
        for i, mount in enumerate(self.volume_mounts):
            if mount.get("mountPropagation") == "Bidirectional":
                violations.append((f"volumeMounts[{i}].mountPropagation", (
                    "Bidirectional propagation needs a privileged container, which job pods never are; use "
                    "HostToContainer or None"
                )))
        if violations:
            raise cross_field_error(violations)
        return self


RESOURCE_REQUIREMENT_KEYS = ("requests", "limits")


def env_violations(env: list[KubeObject], secret_env: list[SecretEnvVar]) -> list[tuple[str, str]]:
    """Variables of resources.env and resources.secretEnv that would change what rlkube and Ray set,
    or are given twice (Kubernetes keeps the last one without a word)."""
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for i, var in enumerate(env):
        name = var.get("name")
        problem = env_name_problem(name)
        if problem:
            out.append((f"env[{i}].name", problem))
            continue
        if name in seen:
            out.append((f"env[{i}].name", f"{name!r} is already set by {seen[name]}; keep one"))
        seen[name] = f"env[{i}]"
        if "value" in var and _CREDENTIAL_ENV_RE.search(name):
            out.append((f"env[{i}].value", CREDENTIAL_MESSAGE.format(name=name)))
    for i, var in enumerate(secret_env):
        if var.name in seen:
            out.append((f"secretEnv[{i}].name", f"{var.name!r} is already set by {seen[var.name]}; keep one"))
        seen[var.name] = f"secretEnv[{i}]"
    return out

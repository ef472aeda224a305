"""The RLJob resource: the spec sections put together, the rules that span sections, and the
Kubernetes envelope (apiVersion, kind, metadata, status)."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .algorithm import KL_REWARD_ESTIMATORS, AlgorithmSpec
from .backend_rules import BACKEND_RULES, backend_violations
from .base import API_VERSION, KIND, SpecModel, cel_rules, cross_field_error, immutable, immutable_field, section
from .checkpoint import CheckpointSpec
from .data import DataSpec
from .eval import EvalSpec
from .fault_tolerance import FaultToleranceSpec
from .lora import LORA_FP8_MESSAGE
from .model import ModelSpec
from .observability import ObservabilitySpec
from .parallelism import ParallelismSpec
from .resources import LabelValue, ResourcesSpec
from .reward import RewardSpec
from .rollout import RolloutSpec
from .status import RLJobStatus
from .training import TrainingSpec

_ASYNC_COLOCATED = (
    "training.mode async generates the next rollout while training and cannot share GPUs with the trainer; "
    "set resources.placement: separate, or training.mode: sync"
)

# The batch equation, CEL side. `nSamplesPerPrompt` and `numStepsPerRollout` always have a value
# there (the CRD defaults them before validation); `globalBatchSize` may be absent and is then derived.
# Messages use `'...'.format([...])`: the API server's cost estimate of `'...' + string(n)` is
# unbounded and it refuses the CRD, while format() is estimated from its arguments.
_SAMPLES = "self.rollout.batchSize * self.rollout.nSamplesPerPrompt"
_SAMPLES_ARGS = f"self.rollout.batchSize, self.rollout.nSamplesPerPrompt, {_SAMPLES}"
_TRAINED = "self.training.globalBatchSize * self.training.numStepsPerRollout"
BATCH_EQUATION_RULE = {
    "rule": f"!has(self.training.globalBatchSize) || {_SAMPLES} == {_TRAINED}",
    "messageExpression": "'rollout.batchSize(%d) x nSamplesPerPrompt(%d) = %d but globalBatchSize(%d) x "
    f"numStepsPerRollout(%d) = %d'.format([{_SAMPLES_ARGS}, self.training.globalBatchSize, "
    f"self.training.numStepsPerRollout, {_TRAINED}])",
    "fieldPath": ".training.globalBatchSize",
}
BATCH_DIVISIBLE_RULE = {
    "rule": f"has(self.training.globalBatchSize) || ({_SAMPLES}) % self.training.numStepsPerRollout == 0",
    "messageExpression": "'rollout.batchSize(%d) x nSamplesPerPrompt(%d) = %d samples cannot be split into "
    "numStepsPerRollout(%d) equal optimizer steps; set globalBatchSize or a numStepsPerRollout that divides it'"
    f".format([{_SAMPLES_ARGS}, self.training.numStepsPerRollout])",
    "fieldPath": ".training.numStepsPerRollout",
}
_ENGINE_GPUS = (
    "resources.rollout.gpus({gpus}) must be a positive multiple of rollout.gpusPerEngine({per_engine}) with "
    "separate placement: the rollout GPUs are split into whole engines (0, one CPU pod, only with rollout.engine "
    "builtin: SGLang needs GPUs)"
)
ENGINE_GPUS_RULE = {
    "rule": "!has(self.resources) || self.resources.placement != 'separate' || "
    "(self.resources.rollout.gpus == 0 ? self.rollout.engine == 'builtin' : "
    "(self.resources.rollout.gpus >= self.rollout.gpusPerEngine && "
    "self.resources.rollout.gpus % self.rollout.gpusPerEngine == 0))",
    "messageExpression": "'" + _ENGINE_GPUS.format(gpus="%d", per_engine="%d")
    + "'.format([self.resources.rollout.gpus, self.rollout.gpusPerEngine])",
    "fieldPath": ".resources.rollout.gpus",
}
_MULTI_NODE_COLOCATED = (
    "rollout.nodesPerEngine({nodes}) spreads each engine over rollout pods of its own, but resources.placement "
    "colocated runs the engines in the trainer pods on their GPUs: set resources.placement: separate, or "
    "rollout.nodesPerEngine: 1"
)
MULTI_NODE_PLACEMENT_RULE = {
    "rule": "!has(self.rollout.nodesPerEngine) || self.rollout.nodesPerEngine == 1 || !has(self.resources) || "
    "self.resources.placement != 'colocated'",
    "messageExpression": "'" + _MULTI_NODE_COLOCATED.format(nodes="%d") + "'.format([self.rollout.nodesPerEngine])",
    "fieldPath": ".rollout.nodesPerEngine",
}
_REF_UPDATE_NEEDS_KL = (
    "training.refUpdateInterval(%d) refreshes the reference model, which only a KL term uses; set "
    "algorithm.useKlLoss (or klCoef with reinforce_plus_plus, reinforce_plus_plus_baseline or ppo), or remove "
    "refUpdateInterval"
)
_KL_IN_REWARDS = " || ".join(f"self.algorithm.advantageEstimator == '{e}'" for e in KL_REWARD_ESTIMATORS)
REF_UPDATE_RULE = {
    "rule": "!has(self.training.refUpdateInterval) || (has(self.algorithm) && (self.algorithm.useKlLoss || "
    f"(self.algorithm.klCoef != 0.0 && ({_KL_IN_REWARDS}))))",
    "messageExpression": f"'{_REF_UPDATE_NEEDS_KL}'.format([self.training.refUpdateInterval])",
    "fieldPath": ".training.refUpdateInterval",
}
_STALENESS_BELOW_BUFFER = (
    "rollout.maxStaleness(%d) is below training.asyncBufferSize(%d): in async mode a rollout may start that many "
    "syncs behind the policy that trains on it, so even what the newest weights generated would count as stale; "
    "set maxStaleness to at least asyncBufferSize"
)
STALENESS_BUFFER_RULE = {
    "rule": "!has(self.rollout.maxStaleness) || self.training.mode != 'async' || "
    "self.rollout.maxStaleness >= self.training.asyncBufferSize",
    "messageExpression": f"'{_STALENESS_BELOW_BUFFER}'.format([self.rollout.maxStaleness, self.training.asyncBufferSize])",
    "fieldPath": ".rollout.maxStaleness",
}
_FP8 = "!has(self.model.rolloutDtype) || self.model.rolloutDtype != 'fp8' || "
FP8_DISK_MESSAGE = (
    "training.updateWeightsTransport disk writes the HF directory unquantized, so model.rolloutDtype fp8 would "
    "serve unquantized weights; use auto, tensor, distributed or http, or model.rolloutDtype: bf16"
)
FP8_DISK_RULE = {
    "rule": _FP8 + "!has(self.training.updateWeightsTransport) || self.training.updateWeightsTransport != 'disk'",
    "message": FP8_DISK_MESSAGE,
    "fieldPath": ".training.updateWeightsTransport",
}
# The API server fills tis.enabled: false in before anything reads the spec, so "TIS not
# configured" cannot be told from "TIS off": fp8 asks for it explicitly instead of defaulting it.
FP8_TIS_MESSAGE = (
    "model.rolloutDtype fp8 serves quantized weights, so the engine's logprobs differ from the trainer's: set "
    "algorithm.tis.enabled: true (truncated importance sampling corrects for it), or model.rolloutDtype: bf16"
)
FP8_TIS_RULE = {
    "rule": _FP8 + "(has(self.algorithm) && has(self.algorithm.tis) && has(self.algorithm.tis.enabled) && "
    "self.algorithm.tis.enabled)",
    "message": FP8_TIS_MESSAGE,
    "fieldPath": ".algorithm.tis.enabled",
}
FP8_LORA_RULE = {
    "rule": _FP8 + "!has(self.training.lora)",
    "message": LORA_FP8_MESSAGE,
    "fieldPath": ".training.lora",
}
FP8_RULES = (FP8_DISK_RULE, FP8_TIS_RULE, FP8_LORA_RULE)
ASYNC_PLACEMENT_RULE = {
    "rule": "self.training.mode != 'async' || !has(self.resources) || self.resources.placement != 'colocated'",
    "message": _ASYNC_COLOCATED,
    "fieldPath": ".training.mode",
}


class RLJobSpec(SpecModel):
    """Desired state of an RLJob: one slime-style RL post-training run.

    Each rollout generates rollout.batchSize x rollout.nSamplesPerPrompt samples, which are trained
    on in training.numStepsPerRollout optimizer steps of training.globalBatchSize samples each.
    """

    model_config = cel_rules(BATCH_EQUATION_RULE, BATCH_DIVISIBLE_RULE, ASYNC_PLACEMENT_RULE, ENGINE_GPUS_RULE,
                             MULTI_NODE_PLACEMENT_RULE, REF_UPDATE_RULE, STALENESS_BUFFER_RULE, *FP8_RULES, *BACKEND_RULES)

    model: ModelSpec = Field(
        description="Policy model: starting weights, checkpoint directories, precision. Required; fixed after creation.",
        json_schema_extra=immutable_field("model"),
    )
    data: DataSpec = Field(
        description="Prompt dataset and record keys. Required; fixed after creation.",
        json_schema_extra=immutable_field("data"),
    )
    rollout: RolloutSpec = Field(description="Generation: batch, sampling parameters, engines, plugins. Required.")
    reward: RewardSpec = Field(description="Reward function. Required.")
    algorithm: AlgorithmSpec = section(AlgorithmSpec, "Advantage estimator and policy-loss terms. Default: GRPO.")
    training: TrainingSpec = Field(description="Rollout count, optimizer steps per rollout, sync/async, optimizer. Required.")
    parallelism: ParallelismSpec = section(
        ParallelismSpec,
        "Trainer parallelism and micro-batching. Default: none. Fixed after creation.",
        rules=(immutable("parallelism"),),
    )
    eval: EvalSpec = section(EvalSpec, "Periodic evaluation. Default: none.")
    observability: ObservabilitySpec = section(
        ObservabilitySpec, "Experiment trackers (W&B, MLflow; off unless set) and rollout dumps."
    )
    checkpoint: CheckpointSpec = section(CheckpointSpec, "Checkpoint cadence and retention.")
    resources: ResourcesSpec = section(ResourcesSpec, "Placement, pods, volumes and environment.")
    fault_tolerance: FaultToleranceSpec = section(FaultToleranceSpec, "Engine health checks and restart budgets.")
    suspend: bool = Field(
        default=False,
        description="Stop the job's pods and keep its state; setting it back to false resumes from the last "
        "checkpoint. With queueName the job's RayJob is deleted instead (Kueue owns its suspend flag) and resuming "
        "queues a new one. Default false.",
    )
    ttl_seconds_after_finished: Optional[int] = Field(
        default=None, ge=0, description="Seconds after Succeeded or Failed before the RLJob is deleted. Default: unset (kept); >= 0."
    )
    active_deadline_seconds: Optional[int] = Field(
        default=None, ge=1, description="Seconds the job may run in total (restarts included) before it is Failed. Default: unset; >= 1."
    )
    queue_name: Optional[LabelValue] = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="Kueue LocalQueue to admit the job through: each RayJob is created suspended with the "
        "kueue.x-k8s.io/queue-name label, and Kueue alone then suspends and unsuspends it (phase Queued while it "
        "waits). A change applies to the next RayJob (a restart, or a resume). A label value: at most 63 letters, "
        "digits, '-', '_' and '.', alphanumeric at both ends. Default: unset (no Kueue).",
    )

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: training.globalBatchSize, or derived from the rollout size."""
        if self.training.global_batch_size is not None:
            return self.training.global_batch_size
        return self.samples_per_rollout // self.training.num_steps_per_rollout

    @property
    def samples_per_rollout(self) -> int:
        """rollout.batchSize x rollout.nSamplesPerPrompt: the samples each rollout trains on."""
        return self.rollout.batch_size * self.rollout.n_samples_per_prompt

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RLJobSpec":
        violations = batch_violations(self.rollout, self.training)
        if self.training.mode == "async" and self.resources.placement == "colocated":
            violations.append(("training.mode", _ASYNC_COLOCATED))
        gpus, per_engine = self.resources.rollout.gpus, self.rollout.gpus_per_engine
        whole_engines = self.rollout.engine == "builtin" if gpus == 0 else gpus >= per_engine and not gpus % per_engine
        if self.resources.placement == "separate" and not whole_engines:
            violations.append(("resources.rollout.gpus", _ENGINE_GPUS.format(gpus=gpus, per_engine=per_engine)))
        if self.rollout.nodes_per_engine > 1 and self.resources.placement == "colocated":
            violations.append(("rollout.nodesPerEngine", _MULTI_NODE_COLOCATED.format(nodes=self.rollout.nodes_per_engine)))
        every = self.training.ref_update_interval
        if every is not None and not self.algorithm.needs_reference_model:
            violations.append(("training.refUpdateInterval", _REF_UPDATE_NEEDS_KL % every))
        bound, ahead = self.rollout.max_staleness, self.training.async_buffer_size
        if bound is not None and self.training.mode == "async" and bound < ahead:
            violations.append(("rollout.maxStaleness", _STALENESS_BELOW_BUFFER % (bound, ahead)))
        violations += fp8_violations(self)
        violations += backend_violations(self)
        if violations:
            raise cross_field_error(violations)
        return self


def fp8_violations(spec: "RLJobSpec") -> list[tuple[str, str]]:
    """What model.rolloutDtype fp8 cannot run with (FP8_RULES, Python side)."""
    if spec.model.rollout_dtype != "fp8":
        return []
    violations = []
    if spec.training.update_weights_transport == "disk":
        violations.append(("training.updateWeightsTransport", FP8_DISK_MESSAGE))
    if not spec.algorithm.tis.enabled:
        violations.append(("algorithm.tis.enabled", FP8_TIS_MESSAGE))
    if spec.training.lora is not None:
        violations.append(("training.lora", LORA_FP8_MESSAGE))
    return violations


def batch_violations(rollout: RolloutSpec, training: TrainingSpec) -> list[tuple[str, str]]:
    """The batch equation: batchSize x nSamplesPerPrompt = globalBatchSize x numStepsPerRollout.

    Returns (field path relative to spec, message) pairs; empty when the sizes agree.
    """
    samples = rollout.batch_size * rollout.n_samples_per_prompt
    samples_text = (
        f"rollout.batchSize({rollout.batch_size}) x nSamplesPerPrompt({rollout.n_samples_per_prompt}) = {samples}"
    )
    steps = training.num_steps_per_rollout
    if training.global_batch_size is None:
        if samples % steps:
            return [(
                "training.numStepsPerRollout",
                f"{samples_text} samples cannot be split into numStepsPerRollout({steps}) equal optimizer steps; "
                "set globalBatchSize or a numStepsPerRollout that divides it",
            )]
        return []
    trained = training.global_batch_size * steps
    if samples != trained:
        return [(
            "training.globalBatchSize",
            f"{samples_text} but globalBatchSize({training.global_batch_size}) x numStepsPerRollout({steps}) = {trained}",
        )]
    return []


# DNS-1123 subdomain, as the API server requires of object names.
# An RLJob's name becomes its RayJob's name plus `-<attempt>`; KubeRay needs DNS-1035 labels of
# at most 47 characters there, which leaves 40 for the RLJob.
NAME_MAX_LENGTH = 40
_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
_NAME_RE = re.compile(_NAME_PATTERN)
NAME_RULE = {
    "rule": f"self.metadata.name.size() <= {NAME_MAX_LENGTH} && self.metadata.name.matches('{_NAME_PATTERN}')",
    "message": f"metadata.name must be at most {NAME_MAX_LENGTH} characters of lowercase letters, digits and '-', "
    "starting with a letter and ending with a letter or digit (the RayJob is named <name>-<attempt>)",
}


class ObjectMeta(BaseModel):
    """The metadata fields rlkube reads; everything else the API server sets is kept as-is."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(description=f"Object name: a DNS-1035 label of at most {NAME_MAX_LENGTH} characters.")
    namespace: Optional[str] = Field(default=None, description="Namespace; the current one when unset.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if len(name) > NAME_MAX_LENGTH or not _NAME_RE.match(name):
            raise ValueError(f"{name!r}: {NAME_RULE['message']}")
        return name


class RLJob(SpecModel):
    """An RLJob custom resource as `kubectl apply` sends it or the API server returns it."""

    api_version: Literal["rlkube.io/v1alpha1"] = Field(
        default=API_VERSION, description=f"Must be {API_VERSION}."
    )
    kind: Literal["RLJob"] = Field(default=KIND, description=f"Must be {KIND}.")
    metadata: ObjectMeta = Field(description="Standard object metadata; name is required.")
    spec: RLJobSpec = Field(description="Desired state.")
    status: Optional[RLJobStatus] = Field(default=None, description="Observed state, written by the operator.")

    def to_manifest(self) -> dict[str, Any]:
        """The object as YAML/JSON would carry it: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

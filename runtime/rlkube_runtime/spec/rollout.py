"""`spec.rollout`: how samples are generated each rollout (batch, sampling, engines, plugins)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import BUILTIN_FILTERS, CallablePath, FilterRef, ScalarMap, SpecModel, cel_rules, cross_field_error, immutable_field


# Flags whose value the launcher wires into the rest of the job (the URL registered with the
# router, the GPUs the engine was given, the checkpoint the trainer also loads, the other nodes of
# a multi-node engine): a value from spec.rollout.sglangArgs would silently break that wiring, so
# it is refused, naming what decides the flag instead.
MANAGED_SGLANG_FLAGS = {
    "model-path": "spec.model.hfCheckpoint",
    "host": "the pod's IP (chosen by rlkube)",
    "port": "a free port on the pod (chosen by rlkube)",
    "nccl-port": "a free port on the pod (chosen by rlkube)",
    "tp-size": "spec.rollout.gpusPerEngine",
    "nnodes": "spec.rollout.nodesPerEngine",
    "node-rank": "the node's place in its engine (chosen by rlkube)",
    "dist-init-addr": "the first node of the engine (chosen by rlkube)",
    "base-gpu-id": "the GPUs Ray gave the engine (CUDA_VISIBLE_DEVICES)",
    # Running the checkpoint's own code is the spec's to say, once, for the trainer and the engines.
    "trust-remote-code": "spec.model.trustRemoteCode",
    "api-key": "the job's API key (a Secret the operator generates for each RLJob)",
    "admin-api-key": "the job's API key (a Secret the operator generates for each RLJob)",
    "enable-return-routed-experts": "spec.training.routingReplay",
    "enable-lora": "spec.training.lora",
    "max-lora-rank": "spec.training.lora.rank",
    "lora-target-modules": "spec.training.lora.targetModules",
}
# The same for the router: it requires the job's key from its callers and passes it to the engines.
MANAGED_ROUTER_FLAGS = {
    "api-key": "the job's API key (a Secret the operator generates for each RLJob)",
}
_MASK_NEEDS_PARTIAL = (
    "maskOffPolicyInPartialRollout masks what partial rollout kept from an earlier rollout: set partialRollout: true, "
    "or leave it false"
)
_STALENESS_NEEDS_PARTIAL = (
    "maxStaleness bounds how old a response partial rollout keeps may be: set partialRollout: true, or remove "
    "maxStaleness (without partial rollout no response outlives its rollout)"
)
_BUILTIN_ONE_GPU = (
    "the built-in engine runs on one device, so gpusPerEngine must be 1 with engine builtin; use engine: sglang "
    "for tensor-parallel engines"
)
# The built-in engine needs no rule of its own: it takes gpusPerEngine 1, which no nodesPerEngine > 1 divides.
_NODES_SPLIT_GPUS = (
    "gpusPerEngine({gpus}) must split evenly over nodesPerEngine({nodes}) pods: SGLang spreads the "
    "tensor-parallel ranks of an engine evenly over its nodes"  # no apostrophe: a CEL string literal
)
# SGLang's own spellings of two of them.
_SGLANG_FLAG_ALIASES = {"tensor-parallel-size": "tp-size", "nccl-init-addr": "dist-init-addr"}


class RolloutSpec(SpecModel):
    """Generation: prompts per rollout, samples per prompt, sampling parameters and the engines.

    Every rollout produces batchSize x nSamplesPerPrompt samples, which must equal
    training.globalBatchSize x training.numStepsPerRollout.
    """

    model_config = cel_rules(
        {
            "rule": "!has(self.overSamplingBatchSize) || self.overSamplingBatchSize > self.batchSize",
            "messageExpression": "'overSamplingBatchSize(%d) must be greater than batchSize(%d): over-sampling "
            "asks for more prompts than it keeps'.format([self.overSamplingBatchSize, self.batchSize])",
            "fieldPath": ".overSamplingBatchSize",
        },
        {
            "rule": "!has(self.topK) || self.topK != 0",
            "message": "topK must be -1 (disabled) or at least 1, got 0",
            "fieldPath": ".topK",
        },
        {
            "rule": "!has(self.engine) || self.engine != 'builtin' || !has(self.gpusPerEngine) || self.gpusPerEngine == 1",
            "message": _BUILTIN_ONE_GPU,
            "fieldPath": ".gpusPerEngine",
        },
        {
            "rule": "!has(self.nodesPerEngine) || (has(self.gpusPerEngine) ? self.gpusPerEngine : 1) % self.nodesPerEngine == 0",
            "messageExpression": "'" + _NODES_SPLIT_GPUS.format(gpus="%d", nodes="%d")
            + "'.format([has(self.gpusPerEngine) ? self.gpusPerEngine : 1, self.nodesPerEngine])",
            "fieldPath": ".nodesPerEngine",
        },
        {
            "rule": "!has(self.maskOffPolicyInPartialRollout) || !self.maskOffPolicyInPartialRollout || "
            "(has(self.partialRollout) && self.partialRollout)",
            "message": _MASK_NEEDS_PARTIAL,
            "fieldPath": ".maskOffPolicyInPartialRollout",
        },
        {
            "rule": "!has(self.maxStaleness) || (has(self.partialRollout) && self.partialRollout)",
            "message": _STALENESS_NEEDS_PARTIAL,
            "fieldPath": ".maxStaleness",
        },
    )

    batch_size: int = Field(
        ge=1,
        description="Prompts per rollout (groups kept after dynamic sampling). Required, >= 1; fixed after creation. "
        "batchSize x nSamplesPerPrompt = training.globalBatchSize x training.numStepsPerRollout.",
        json_schema_extra=immutable_field("rollout.batchSize"),
    )
    n_samples_per_prompt: int = Field(
        default=8,
        ge=1,
        description="Responses sampled per prompt (the group size for GRPO). Default 8, >= 1; fixed after creation.",
        json_schema_extra=immutable_field("rollout.nSamplesPerPrompt"),
    )
    max_response_len: int = Field(
        default=1024, ge=1, description="Maximum generated tokens per response (all turns together for multi-turn). Default 1024, >= 1."
    )
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature. Default 1.0, >= 0 (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass. Default 1.0, in (0, 1].")
    top_k: int = Field(default=-1, ge=-1, description="Top-k sampling; -1 disables it. Default -1; otherwise >= 1.")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings: generation of a response ends at the first one. Default none."
    )
    over_sampling_batch_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Prompts requested per generation round when dynamic sampling filters groups out; must be "
        "greater than batchSize. Rounds repeat until batchSize groups pass. Default: unset (= batchSize, no over-sampling).",
    )
    dynamic_sampling_filter: Optional[FilterRef] = Field(
        default=None,
        description="Group filter called with each finished group; groups it rejects are dropped. A built-in "
        f"filter by name ({', '.join(BUILTIN_FILTERS)}: drop groups whose rewards are all equal; slime's dotted "
        "path works too) or 'package.module:function'. Default: unset (keep every group).",
    )
    partial_rollout: bool = Field(
        default=False,
        description="Keep the partial responses of groups aborted when a rollout has enough samples, and "
        "continue them in the next rollout. Default false.",
    )
    mask_off_policy_in_partial_rollout: bool = Field(
        default=False,
        description="With partialRollout: a continued response's tokens from earlier rollouts (older weights) get "
        "loss mask 0, so only the tokens the current weights generate train (slime's "
        "--mask-offpolicy-in-partial-rollout). Default false.",
    )
    max_staleness: Optional[int] = Field(
        default=None,
        ge=0,
        description="With partialRollout: the most weight syncs a kept partial response may lag the policy that "
        "trains on it, counted by its oldest tokens as rollout/staleness/* counts; an older one is discarded when "
        "its group is drawn again and its samples generate afresh from their prompts (rollout/partial/stale_restarted "
        "counts them). In async mode at least training.asyncBufferSize. Default: unset (no bound: a response aborted "
        "rollout after rollout is kept however old).",
    )
    custom_generate_function: Optional[CallablePath] = Field(
        default=None,
        description="Custom generation 'package.module:function' (async) replacing the single-turn default, "
        "e.g. a multi-turn tool loop that sets per-token loss masks. Default: unset.",
    )
    max_turns: int = Field(
        default=1, ge=1, description="Maximum turns a custom generate function may take per sample. Default 1, >= 1."
    )
    engine: Literal["sglang", "builtin"] = Field(
        default="sglang",
        description="Rollout engine: sglang (SGLang servers behind sglang-router), or builtin (the project's "
        "engine speaking SGLang's HTTP protocol, for tiny/CPU runs). Default sglang.",
    )
    gpus_per_engine: int = Field(
        default=1, ge=1, description="GPUs per rollout engine (its tensor-parallel size). Default 1, >= 1."
    )
    nodes_per_engine: int = Field(
        default=1,
        ge=1,
        description="Pods (nodes) one engine spans, for a model larger than one node: each of the engine's pods "
        "holds gpusPerEngine / nodesPerEngine GPUs and runs one SGLang server of the group (--nnodes, --node-rank, "
        "--dist-init-addr), node 0 serving HTTP for the whole engine; the router knows only node 0, and a failed "
        "node restarts its whole engine. SGLang only, separate placement only. Default 1, >= 1.",
    )
    sglang_args: ScalarMap = Field(
        default_factory=dict,
        description="Extra SGLang server arguments, passed as --<key> <value> (true -> a bare flag), e.g. "
        "{mem-fraction-static: 0.7}. Default: none.",
    )
    router_args: ScalarMap = Field(
        default_factory=dict,
        description="Extra sglang-router arguments, passed as --<key> <value>. Default: none.",
    )

    @property
    def effective_over_sampling_batch_size(self) -> int:
        """Prompts requested per generation round: overSamplingBatchSize, or batchSize when unset."""
        return self.over_sampling_batch_size if self.over_sampling_batch_size is not None else self.batch_size

    @property
    def gpus_per_engine_node(self) -> int:
        """The GPUs of each pod of an engine: gpusPerEngine / nodesPerEngine."""
        return self.gpus_per_engine // self.nodes_per_engine

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RolloutSpec":
        violations = []
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size <= self.batch_size:
            violations.append((
                "overSamplingBatchSize",
                f"overSamplingBatchSize({self.over_sampling_batch_size}) must be greater than "
                f"batchSize({self.batch_size}): over-sampling asks for more prompts than it keeps",
            ))
        if self.top_k == 0:
            violations.append(("topK", "topK must be -1 (disabled) or at least 1, got 0"))
        if self.engine == "builtin" and self.gpus_per_engine != 1:
            violations.append(("gpusPerEngine", _BUILTIN_ONE_GPU))
        if self.gpus_per_engine % self.nodes_per_engine:
            violations.append(("nodesPerEngine", _NODES_SPLIT_GPUS.format(gpus=self.gpus_per_engine, nodes=self.nodes_per_engine)))
        if self.mask_off_policy_in_partial_rollout and not self.partial_rollout:
            violations.append(("maskOffPolicyInPartialRollout", _MASK_NEEDS_PARTIAL))
        if self.max_staleness is not None and not self.partial_rollout:
            violations.append(("maxStaleness", _STALENESS_NEEDS_PARTIAL))
        for key in self.sglang_args:
            name = key.lstrip("-").replace("_", "-")
            name = _SGLANG_FLAG_ALIASES.get(name, name)
            if name in MANAGED_SGLANG_FLAGS:
                violations.append((f"sglangArgs.{key}", f"rlkube sets --{name} itself (from {MANAGED_SGLANG_FLAGS[name]}); "
                                   "remove it from sglangArgs"))
        for key in self.router_args:
            name = key.lstrip("-").replace("_", "-")
            if name in MANAGED_ROUTER_FLAGS:
                violations.append((f"routerArgs.{key}", f"rlkube sets --{name} itself (from {MANAGED_ROUTER_FLAGS[name]}); "
                                   "remove it from routerArgs"))
        if violations:
            raise cross_field_error(violations)
        return self

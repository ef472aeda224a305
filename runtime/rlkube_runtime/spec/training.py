"""`spec.training`: how many rollouts, how each becomes optimizer steps, and the optimizer."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import SpecModel, cel_rules, cross_field_error, immutable_field, section
from .lora import LORA_REF_UPDATE_MESSAGE, LORA_TRANSPORT_MESSAGE, LoraSpec

# Outside async mode nothing generates ahead of training: a deeper buffer would be ignored.
ASYNC_BUFFER_MESSAGE = "asyncBufferSize(%d): only async mode (training.mode: async) generates ahead; set 1 or mode async"
MAX_ASYNC_BUFFER = 8  # each rollout asked for ahead holds one of the rollout manager's 16 concurrent calls


class OptimizerSpec(SpecModel):
    """The trainer's optimizer and learning-rate schedule."""

    type: Literal["adam"] = Field(default="adam", description="Optimizer: adam (AdamW with decoupled weight decay). Default adam.")
    lr: float = Field(default=1e-6, gt=0, description="Peak learning rate. Default 1e-6, > 0.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="Learning-rate schedule after warmup, decaying to minLr over the run: constant, linear, cosine. "
        "Default constant.",
    )
    min_lr: float = Field(default=0.0, ge=0, description="Learning rate at the end of a linear or cosine decay. Default 0, >= 0.")
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warmup from 0 to lr. Default 0, >= 0.")
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled weight decay. Default 0.1, >= 0.")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam beta1. Default 0.9, in [0, 1).")
    beta2: float = Field(default=0.98, ge=0, lt=1, description="Adam beta2. Default 0.98, in [0, 1).")
    eps: float = Field(default=1e-8, gt=0, description="Adam epsilon (added to the denominator). Default 1e-8, > 0.")
    clip_grad: float = Field(
        default=1.0, ge=0, description="Gradient-norm clipping threshold; 0 disables clipping. Default 1.0, >= 0."
    )


class TrainingSpec(SpecModel):
    """The outer loop: rollouts, optimizer steps per rollout, sync or async, and the optimizer."""

    # Transition rules on an optional field do not fire when it is added or removed; this does.
    model_config = cel_rules(
        {
            "rule": "has(self.globalBatchSize) == has(oldSelf.globalBatchSize)",
            "message": "spec.training.globalBatchSize cannot be added or removed while the RLJob exists; "
            "create a new RLJob to change it",
            "fieldPath": ".globalBatchSize",
        },
        {
            "rule": "!has(self.asyncBufferSize) || self.asyncBufferSize == 1 || (has(self.mode) && self.mode == 'async')",
            "messageExpression": f"'{ASYNC_BUFFER_MESSAGE}'.format([self.asyncBufferSize])",
            "fieldPath": ".asyncBufferSize",
        },
        {
            "rule": "has(self.lora) == has(oldSelf.lora)",
            "message": "spec.training.lora cannot be added or removed while the RLJob exists; create a new RLJob to "
            "change it",
            "fieldPath": ".lora",
        },
        {
            "rule": "!has(self.lora) || !has(self.updateWeightsTransport) || self.updateWeightsTransport == 'auto' || "
            "self.updateWeightsTransport == 'disk'",
            "message": LORA_TRANSPORT_MESSAGE,
            "fieldPath": ".updateWeightsTransport",
        },
        {
            "rule": "!has(self.lora) || !has(self.refUpdateInterval)",
            "message": LORA_REF_UPDATE_MESSAGE,
            "fieldPath": ".refUpdateInterval",
        },
    )

    num_rollout: int = Field(ge=1, description="Rollouts to run (generate -> train -> sync weights). Required, >= 1.")
    global_batch_size: Optional[int] = Field(
        default=None,
        ge=1,
        json_schema_extra=immutable_field("training.globalBatchSize"),
        description="Samples per optimizer step; fixed after creation. Default: derived as rollout.batchSize x rollout.nSamplesPerPrompt / "
        "numStepsPerRollout (which must divide evenly). When set, rollout.batchSize x rollout.nSamplesPerPrompt "
        "must equal globalBatchSize x numStepsPerRollout.",
    )
    num_steps_per_rollout: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps taken on each rollout's samples. Default 1, >= 1; fixed after creation.",
        json_schema_extra=immutable_field("training.numStepsPerRollout"),
    )
    backend: Literal["auto", "torch", "megatron"] = Field(
        default="auto",
        json_schema_extra=immutable_field("training.backend"),
        description="Trainer backend. torch: PyTorch DDP replicas (spec.parallelism sizes must be 1). megatron: "
        "Megatron-core with spec.parallelism's tensor/pipeline/sequence parallelism, selective recompute, "
        "model.megatronArgs and training.routingReplay. auto (default): megatron when any of those is set or the model's config.json is a "
        "mixture of experts (where it can be read: `rlkube run`, and `rlkube validate` for a local directory), torch "
        "otherwise; `rlkube run` prints which it chose. Fixed after creation.",
    )
    mode: Literal["sync", "async"] = Field(
        default="sync",
        json_schema_extra=immutable_field("training.mode"),
        description="sync: generate then train, in turn. async: generate rollout k+1 while training on rollout k "
        "(needs separate placement). Default sync; fixed after creation.",
    )
    async_buffer_size: int = Field(
        default=1,
        ge=1,
        le=MAX_ASYNC_BUFFER,
        description="Rollouts async mode generates ahead of training, one after another: while rollout k trains, "
        "rollouts up to k+N generate, each by the weights last synced when it started. A sample is then up to N "
        "weight versions behind the policy that trains on it (reported as rollout/staleness/*; "
        "algorithm.tis corrects for it). A deeper buffer does not raise throughput when generating and training "
        "take steady times (one rollout ahead already overlaps them); it keeps the engines busy through uneven ones "
        "(long-tail rollouts, checkpoints, evals). Default 1, 1 to 8; above 1 only with mode async.",
    )
    ref_update_interval: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rollouts between refreshes of the reference model: after training every N-th rollout the "
        "reference takes the policy's weights, so the KL term measures the drift since the last refresh (slime's "
        "--ref-update-interval). Needs a KL term (algorithm.useKlLoss, or klCoef with an estimator that folds it "
        "into the rewards). Checkpoints then hold the reference's weights too (twice the model), so a resume "
        "measures KL against the same reference. Default: unset (the reference stays the initial model); >= 1.",
    )
    update_weights_interval: int = Field(
        default=1, ge=1, description="Rollouts between weight syncs to the engines. Default 1, >= 1."
    )
    update_weights_transport: Literal["auto", "tensor", "distributed", "http", "disk"] = Field(
        default="auto",
        description="How weight syncs reach the engines, in SGLang's API. tensor: CUDA IPC handles "
        "(/update_weights_from_tensor; the engine shares the trainer ranks' GPUs, each rank handing over its GPU's "
        "payload, or its machine on a CPU). distributed: "
        "a NCCL (gloo on a CPU) broadcast from trainer rank 0 (/update_weights_from_distributed). http: the bytes in "
        "the requests (built-in engine only). disk: an HF directory on storage the engines share "
        "(/update_weights_from_disk). auto (default): tensor when colocated, distributed when separate.",
    )
    update_weight_buffer_mb: int = Field(
        default=128,
        ge=1,
        description="Weight syncs move the model in buckets of at most this many MiB of tensors (in the rollout "
        "dtype): one request per bucket, each staging at most this much memory. Over http a bucket is a request "
        "body (base64: 4/3 of it) and large tensors are split into blocks of rows. Default 128, >= 1.",
    )
    routing_replay: bool = Field(
        default=False,
        description="Rollout routing replay for a mixture of experts (slime's --use-rollout-routing-replay, R3): "
        "the engines return the experts every token was routed to (SGLang's --enable-return-routed-experts) and "
        "the trainer's routers take those experts in the actor's forward passes (old log-probs and training; the "
        "reference model routes for itself), so the policy gradient is taken through the experts that produced "
        "the tokens rather than the ones the trainer's slightly different numerics would pick. Each sample then "
        "carries 4 bytes x layers x top-k per token from the engine to the trainer. Needs a mixture-of-experts "
        "model, the megatron backend (auto chooses it) and parallelism.pipeline 1. Default false.",
    )
    lora: Optional[LoraSpec] = Field(
        default=None,
        json_schema_extra=immutable_field("training.lora"),
        description="Train a LoRA adapter of the given rank on the target layers instead of the whole model (torch "
        "backend, peft): the base weights stay frozen, so gradients and Adam moments are the adapter's only, the "
        "reference model is the base (the adapter off: no second copy), each weight sync sends only the adapter "
        "(written to storage the engines share and loaded with /load_lora_adapter; engines start with "
        "--enable-lora) and checkpoints hold only it. The HF export writes the merged model with the adapter in "
        "its adapter/ directory. Default: unset (full fine-tuning). Fixed after creation.",
    )
    optimizer: OptimizerSpec = section(OptimizerSpec, "Optimizer and learning-rate schedule. Default: Adam, lr 1e-6, constant.")
    seed: int = Field(default=1234, description="Seed of model initialisation, dropout and sampling on the trainer. Default 1234.")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "TrainingSpec":
        violations = []
        if self.async_buffer_size != 1 and self.mode != "async":
            violations.append(("asyncBufferSize", ASYNC_BUFFER_MESSAGE % self.async_buffer_size))
        if self.lora is not None and self.update_weights_transport not in ("auto", "disk"):
            violations.append(("updateWeightsTransport", LORA_TRANSPORT_MESSAGE))
        if self.lora is not None and self.ref_update_interval is not None:
            violations.append(("refUpdateInterval", LORA_REF_UPDATE_MESSAGE))
        if violations:
            raise cross_field_error(violations)
        return self

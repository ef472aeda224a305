"""`spec.model`: which weights the policy starts from, where checkpoints go, and precision."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import ScalarMap, SpecModel, cel_rules, cross_field_error

_NO_WEIGHTS = "set at least one of hfCheckpoint, preset or load: the job needs starting weights"
_PRESET_AND_CHECKPOINT = (
    "preset and hfCheckpoint both give the starting weights and architecture; set one: hfCheckpoint to load a "
    "checkpoint, preset: tiny for the built-in tiny model"
)


class ModelSpec(SpecModel):
    """The policy model: its starting weights, reference model, checkpoint directories and precision.

    At least one of hfCheckpoint, preset or load must be set.
    """

    model_config = cel_rules(
        {"rule": "has(self.hfCheckpoint) || has(self.preset) || has(self.load)", "message": _NO_WEIGHTS},
        {"rule": "!has(self.hfCheckpoint) || !has(self.preset)", "message": _PRESET_AND_CHECKPOINT,
         "fieldPath": ".preset"},
    )

    hf_checkpoint: Optional[str] = Field(
        default=None,
        description="Hugging Face checkpoint directory (config, tokenizer, safetensors), e.g. a path on a "
        "PVC. Gives the architecture and tokenizer, and the initial weights when load has no checkpoint yet.",
    )
    ref_load: Optional[str] = Field(
        default=None,
        description="Checkpoint of the frozen reference model used for KL terms. Optional; when omitted the "
        "initial weights (hfCheckpoint or preset) serve as the reference.",
    )
    load: Optional[str] = Field(
        default=None,
        description="Directory to resume from: the latest complete checkpoint in it is loaded (model, "
        "optimizer, data position). Usually the same directory as save.",
    )
    save: Optional[str] = Field(
        default=None,
        description="Directory checkpoints are written to (every checkpoint.interval rollouts). Optional; "
        "without it no checkpoints are written on a cluster and local runs use ./runs/<name>.",
    )
    preset: Optional[str] = Field(
        default=None,
        min_length=1,
        description="Built-in model: 'tiny' is the project's tiny model (CPU-friendly, randomly initialised, "
        "nothing downloaded). Cannot be combined with hfCheckpoint, which gives a checkpoint's own architecture.",
    )
    megatron_args: ScalarMap = Field(
        default_factory=dict,
        description="Extra megatron-core TransformerConfig or OptimizerConfig settings for the megatron backend, "
        "keyed by Megatron-LM flag names without the dashes (true sets a flag, false leaves it at its default), e.g. "
        "{attention-softmax-in-fp32: true}. The architecture comes from config.json and the parallel sizes from "
        "spec.parallelism, so such keys are refused; of the mixture-of-experts keys only the load-balancing losses "
        "can be set (moe-aux-loss-coeff, moe-z-loss-coeff, moe-router-load-balancing-type: aux_loss, seq_aux_loss "
        "or none). Default: none.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the Python code the checkpoint ships (its own model or tokenizer classes) wherever it is "
        "loaded: the trainer, the built-in engine, SGLang (--trust-remote-code). Only for checkpoints you trust. "
        "Default false.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Training precision of the trainer. One of bfloat16, float16, float32. Default bfloat16.",
    )
    rollout_dtype: Literal["bf16", "fp8"] = Field(
        default="bf16",
        description="Precision of the weights the rollout engines serve. bf16: the engine dtype. fp8: every weight "
        "sync sends the decoder layers' linear weights block-quantized to float8_e4m3fn (128x128 blocks with "
        "float32 scales, as SGLang's fp8 checkpoints; embeddings, lm_head, norms and biases stay high-precision), "
        "about half the bytes of bf16 for them. The engines start from a block-fp8 copy of the model written "
        "into the output directory (rollout-model-fp8/, config.json with quantization_config), so SGLang "
        "builds its fp8 layers and serves fp8 GEMMs; the built-in engine serves the weights dequantized (their "
        "quantization error, not fp8 GEMMs). fp8 needs safetensors weights, a transport other than disk and "
        "algorithm.tis.enabled (the engine's logprobs then differ from the trainer's). Default bf16.",
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "ModelSpec":
        violations = []
        if self.hf_checkpoint is None and self.preset is None and self.load is None:
            violations.append(("", _NO_WEIGHTS))
        if self.hf_checkpoint is not None and self.preset is not None:
            violations.append(("preset", _PRESET_AND_CHECKPOINT))
        if violations:
            raise cross_field_error(violations)
        return self

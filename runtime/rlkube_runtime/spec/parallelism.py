"""`spec.parallelism`: how the trainer splits the model and packs micro-batches.

The model-splitting sizes are the megatron backend's; the torch backend refuses them
(`backend_rules.py` holds both backends' rules).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .base import SpecModel


class ParallelismSpec(SpecModel):
    """Trainer parallelism (Megatron-core; the torch backend needs every size at 1) and micro-batching."""

    tensor: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel size (megatron backend). tensor x pipeline x context GPUs hold one model "
        "replica and must divide resources.trainer.nodes x gpusPerNode. Default 1, >= 1.",
    )
    pipeline: int = Field(default=1, ge=1, description="Pipeline-parallel size (megatron backend). Default 1, >= 1.")
    context: int = Field(
        default=1, ge=1, description="Context-parallel size for long sequences (megatron backend). Default 1, >= 1."
    )
    expert: int = Field(
        default=1,
        ge=1,
        description="Expert-parallel size of MoE models (megatron backend); expert x expertTensor x pipeline must "
        "divide the trainer GPUs. Default 1, >= 1.",
    )
    expert_tensor: Optional[int] = Field(
        default=None,
        ge=1,
        description="Tensor-parallel size inside each expert of a MoE model (megatron-core's "
        "expert_tensor_parallel_size; megatron backend): 1 keeps every expert whole on its rank while attention "
        "is split over `tensor` ranks. It must divide the model's expert MLP channels. Default: the tensor size.",
    )
    sequence_parallel: bool = Field(
        default=False, description="Megatron sequence parallelism (megatron backend, with tensor > 1). Default false."
    )
    dynamic_batch_size: bool = Field(
        default=True,
        description="Pack micro-batches by token count up to maxTokensPerGpu instead of a fixed microBatchSize; "
        "the loss is unchanged. Default true.",
    )
    max_tokens_per_gpu: Optional[int] = Field(
        default=None,
        ge=1,
        description="Token budget of one packed micro-batch per GPU when dynamicBatchSize is on. Default: unset "
        "(the runtime picks one from the response length).",
    )
    micro_batch_size: int = Field(
        default=1, ge=1, description="Samples per micro-batch when dynamicBatchSize is off. Default 1, >= 1."
    )
    recompute: Literal["none", "full", "selective"] = Field(
        default="none",
        description="Activation recomputation: none, full (every layer; the torch backend uses transformers' activation "
        "checkpointing), selective (attention only; megatron backend). Default none.",
    )

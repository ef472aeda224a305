"""`spec.parallelism`: how the trainer splits the model and packs micro-batches."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .base import SpecModel


class ParallelismSpec(SpecModel):
    """Trainer parallelism (Megatron-core) and micro-batching."""

    tensor: int = Field(default=1, ge=1, description="Tensor-parallel size. Default 1, >= 1.")
    pipeline: int = Field(default=1, ge=1, description="Pipeline-parallel size. Default 1, >= 1.")
    context: int = Field(default=1, ge=1, description="Context-parallel size (long sequences). Default 1, >= 1.")
    expert: int = Field(default=1, ge=1, description="Expert-parallel size (MoE models). Default 1, >= 1.")
    sequence_parallel: bool = Field(
        default=False, description="Megatron sequence parallelism (with tensor > 1). Default false."
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
        description="Activation recomputation: none, full (every layer), selective (attention only). Default none.",
    )

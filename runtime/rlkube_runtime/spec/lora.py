"""`spec.training.lora`: train a low-rank adapter instead of the whole model.

The trainer (torch backend, peft) trains only the adapter's A and B matrices of the named linear
layers; the base weights stay frozen, the reference model is the base itself (the adapter off), the
weight sync sends only the adapter (SGLang's /load_lora_adapter), and checkpoints hold only it.
The messages here are shared by the spec's rules (Python and CEL) and the runtime's own checks.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import SpecModel

# The linear layers of Llama/Qwen-style decoders, and the output layer, by the names both peft and
# SGLang's --lora-target-modules use.
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
ALL_LINEAR: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 256

LORA_MEGATRON_MESSAGE = (
    "lora is trained by the torch backend (peft); megatron-core has no LoRA layers: set spec.training.backend: "
    "torch (or auto) and no setting only megatron has"
)
LORA_TRANSPORT_MESSAGE = (
    "with lora the weight sync sends the adapter as a directory on storage the engines share "
    "(/load_lora_adapter); updateWeightsTransport must be auto or disk"
)
LORA_REF_UPDATE_MESSAGE = (
    "with lora the reference model is the base model (the adapter switched off), which never changes; remove "
    "refUpdateInterval"
)
LORA_TIED_HEAD_MESSAGE = (
    "lm_head is the input embedding too in this model (tie_word_embeddings), so an adapter there would change both; "
    "leave lm_head out of targetModules"
)
LORA_FP8_MESSAGE = (
    "lora with model.rolloutDtype fp8 is not built (the engine would merge the adapter into quantized weights); "
    "use model.rolloutDtype: bf16"
)


class LoraSpec(SpecModel):
    """A LoRA adapter: W x + (alpha / rank) B A x on each target layer, A and B trained, W frozen."""

    rank: int = Field(ge=1, le=MAX_LORA_RANK, description="The adapter's rank r (A is r x in, B is out x r). Required, 1 to 256.")
    alpha: float = Field(
        default=32.0, gt=0, description="Scale of the update: B A is multiplied by alpha / rank. Default 32, > 0."
    )
    target_modules: list[LoraTarget] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        min_length=1,
        max_length=len(ALL_LINEAR) + 1,
        description="Layers that get an adapter: the linear layers of every decoder layer (q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj) and the output layer lm_head (not with tied word embeddings, where "
        "it is the input embedding too). Default: the seven decoder-layer ones.",
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Dropout on the adapter's input while training. Default 0, in [0, 1)."
    )

    @field_validator("target_modules")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"each module at most once, got {value}")
        return value

    @property
    def scaling(self) -> float:
        """What B A is multiplied by (peft's default, not rank-stabilised)."""
        return self.alpha / self.rank

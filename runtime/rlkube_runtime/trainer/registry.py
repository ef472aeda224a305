"""The backend `spec.training.backend` names, built for one trainer rank, and the start-time
check of what it cannot honour."""

from __future__ import annotations

from ..spec import RLJobSpec
from ..spec.backend_rules import chosen_backend
from .backend import TrainerBackend
from .config import TrainerConfig
from .support import check_trainer_supports

__all__ = ["build_backend", "check_trainer_supports"]


def build_backend(spec: RLJobSpec, config: TrainerConfig, *, device: str) -> TrainerBackend:
    """device: "cpu", or "cuda" for the rank's current CUDA device."""
    on = device if device == "cpu" else None
    backend, _ = chosen_backend(spec)
    match backend:
        case "torch":
            from .torch_backend import TorchBackend

            return TorchBackend(config, device=on)
        case "megatron":
            from .megatron.backend import MegatronBackend
            from .megatron.model import ParallelSizes

            return MegatronBackend(config, ParallelSizes.from_spec(spec), megatron_args=dict(spec.model.megatron_args),
                                   device=on)
    raise ValueError(f"spec.training.backend: {backend!r}; known backends: ['auto', 'megatron', 'torch']")

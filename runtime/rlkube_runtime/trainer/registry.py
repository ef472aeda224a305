"""The backend `spec.training.backend` names, built for one trainer rank, and the start-time
check of what it cannot honour."""

from __future__ import annotations

from ..spec import RLJobSpec
from ..spec.algorithm import CRITIC_ESTIMATORS, NO_CRITIC_MESSAGE
from ..spec.backend_rules import chosen_backend
from .backend import TrainerBackend
from .config import TrainerConfig


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


def check_trainer_supports(spec: RLJobSpec) -> None:
    """Fail at start, naming the field, for what only the runtime can know: whether the chosen
    backend is installed. The spec's own validation refuses what no backend honours
    (spec/backend_rules.py, spec/model_fit.py) and the critic estimators; the estimators are
    checked here again for specs built without it."""
    backend, _ = chosen_backend(spec)
    if backend == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError as err:
            raise ValueError(
                "spec.training.backend: 'megatron' needs megatron-core in the runtime image "
                f"(pip install 'rlkube[megatron]'): {err}"
            ) from err
    if spec.algorithm.advantage_estimator in CRITIC_ESTIMATORS:
        raise ValueError(f"spec.algorithm.advantageEstimator: {NO_CRITIC_MESSAGE}")

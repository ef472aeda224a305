"""The backend `spec.training.backend` names, built for one trainer rank, and the start-time
check of what it cannot honour."""

from __future__ import annotations

from ..spec import RLJobSpec
from ..spec.algorithm import CRITIC_ESTIMATORS, NO_CRITIC_MESSAGE
from .backend import TrainerBackend
from .config import TrainerConfig


def build_backend(spec: RLJobSpec, config: TrainerConfig, *, device: str) -> TrainerBackend:
    """device: "cpu", or "cuda" for the rank's current CUDA device."""
    on = device if device == "cpu" else None
    match spec.training.backend:
        case "torch":
            from .torch_backend import TorchBackend

            return TorchBackend(config, device=on)
        case "megatron":
            from .megatron.backend import MegatronBackend
            from .megatron.model import ParallelSizes

            return MegatronBackend(config, ParallelSizes.from_spec(spec), megatron_args=dict(spec.model.megatron_args),
                                   device=on)
    raise ValueError(f"spec.training.backend: {spec.training.backend!r}; known backends: ['megatron', 'torch']")


def check_trainer_supports(spec: RLJobSpec) -> None:
    """Fail at start, naming the field, for settings this trainer cannot honour. The spec's own
    validation refuses what no backend honours (spec/backend_rules.py) and the critic estimators
    already; this is the second guard, in their words, plus what only the runtime can know."""
    backend = spec.training.backend
    if backend == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError as err:
            raise ValueError(
                "spec.training.backend: 'megatron' needs megatron-core in the runtime image "
                f"(pip install 'rlkube[megatron]'): {err}"
            ) from err
        par = spec.parallelism
        if par.expert != 1:
            raise ValueError(f"spec.parallelism.expert: {par.expert} needs a mixture-of-experts model, which the "
                             "megatron backend does not build (Llama, Qwen2, Qwen3 dense models); use 1")
        if par.context != 1:
            raise ValueError(f"spec.parallelism.context: {par.context} needs TransformerEngine's attention, which the "
                             "megatron backend does not use (it runs megatron-core's local layer spec); use 1")
        if spec.model.dtype == "float16":
            raise ValueError("spec.model.dtype: float16 needs loss scaling, which the megatron backend does not do; "
                             "use bfloat16 (or float32)")
    if spec.algorithm.advantage_estimator in CRITIC_ESTIMATORS:
        raise ValueError(f"spec.algorithm.advantageEstimator: {NO_CRITIC_MESSAGE}")

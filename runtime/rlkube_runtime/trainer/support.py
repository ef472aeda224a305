"""The start-time check of what the chosen trainer backend cannot honour, without importing a
backend: the driver runs it before Ray starts, in a process that otherwise never needs torch."""

from __future__ import annotations

from ..spec import RLJobSpec
from ..spec.algorithm import CRITIC_ESTIMATORS, NO_CRITIC_MESSAGE
from ..spec.backend_rules import chosen_backend


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

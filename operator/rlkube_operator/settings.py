"""Operator-wide settings, read once at start from the environment (the chart sets them).

Per-job behaviour lives in the RLJob spec; these are the cluster operator's knobs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlkube_runtime import __version__


@dataclass(frozen=True)
class OperatorSettings:
    trainer_image: str = f"rlkube/trainer:{__version__}"
    """Image of the Ray head and the trainer group when spec.resources.trainer.image is unset."""
    rollout_image: str = f"rlkube/rollout:{__version__}"
    """Image of the rollout group when neither rollout.image nor trainer.image is set."""
    max_backoff_seconds: float = 300.0
    """Cap of the restart backoff faultTolerance.backoffSeconds x 2^restarts."""
    resync_seconds: float = 30.0
    """Active jobs are reconciled at least this often, even when no watch event arrives."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """RLKUBE_TRAINER_IMAGE, RLKUBE_ROLLOUT_IMAGE, RLKUBE_MAX_BACKOFF_SECONDS, RLKUBE_RESYNC_SECONDS."""
        env = dict(os.environ if env is None else env)
        defaults = cls()
        return cls(
            trainer_image=env.get("RLKUBE_TRAINER_IMAGE") or defaults.trainer_image,
            rollout_image=env.get("RLKUBE_ROLLOUT_IMAGE") or defaults.rollout_image,
            max_backoff_seconds=_positive(env, "RLKUBE_MAX_BACKOFF_SECONDS", defaults.max_backoff_seconds),
            resync_seconds=_positive(env, "RLKUBE_RESYNC_SECONDS", defaults.resync_seconds),
        )


def _positive(env: dict[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{key} must be > 0 seconds, got {raw!r}")
    return value

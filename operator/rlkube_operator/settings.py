"""Operator-wide settings, read once at start from the environment (the chart sets them).

Per-job behaviour lives in the RLJob spec; these are the cluster operator's knobs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rlkube_runtime import __version__
from rlkube_runtime.spec.contract import IMAGE_UID
from rlkube_runtime.spec.pod_policy import PodPolicy, load_pod_policy


# Who may reach a job's pods from outside it (each job's NetworkPolicy admits its own pods and these):
# Prometheus (kube-prometheus-stack labels its pods so) to the metrics port, KubeRay's operator to
# the Ray dashboard, through which it submits and follows the job; in any namespace.
PROMETHEUS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
KUBERAY_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}


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
    run_as_user: int = IMAGE_UID
    """The non-root UID (and GID) every process of a job's pods runs as; the images' user."""
    read_only_root_filesystem: bool = True
    """Containers get a read-only root filesystem (writable: an emptyDir at /tmp, and the volumes)."""
    pod_policy: PodPolicy = field(default_factory=PodPolicy, compare=False)
    """What the admin allows job pods to reach beyond the safe default, per namespace."""
    metrics_from: tuple[dict, ...] = field(default=(PROMETHEUS_PEER,), compare=False)
    """NetworkPolicy peers admitted to the head's training-metrics port (Prometheus)."""
    dashboard_from: tuple[dict, ...] = field(default=(KUBERAY_PEER,), compare=False)
    """NetworkPolicy peers admitted to the head's Ray dashboard port (KubeRay's operator polls the job there)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """RLKUBE_TRAINER_IMAGE, RLKUBE_ROLLOUT_IMAGE, RLKUBE_MAX_BACKOFF_SECONDS, RLKUBE_RESYNC_SECONDS,
        RLKUBE_RUN_AS_USER, RLKUBE_READ_ONLY_ROOT_FILESYSTEM, RLKUBE_POD_POLICY (a YAML file),
        RLKUBE_METRICS_FROM and RLKUBE_DASHBOARD_FROM (JSON lists of NetworkPolicy peers)."""
        env = dict(os.environ if env is None else env)
        defaults = cls()
        return cls(
            trainer_image=env.get("RLKUBE_TRAINER_IMAGE") or defaults.trainer_image,
            rollout_image=env.get("RLKUBE_ROLLOUT_IMAGE") or defaults.rollout_image,
            max_backoff_seconds=_positive(env, "RLKUBE_MAX_BACKOFF_SECONDS", defaults.max_backoff_seconds),
            resync_seconds=_positive(env, "RLKUBE_RESYNC_SECONDS", defaults.resync_seconds),
            run_as_user=_non_root_uid(env, "RLKUBE_RUN_AS_USER", defaults.run_as_user),
            read_only_root_filesystem=_flag(env, "RLKUBE_READ_ONLY_ROOT_FILESYSTEM", defaults.read_only_root_filesystem),
            pod_policy=load_pod_policy(env["RLKUBE_POD_POLICY"]) if env.get("RLKUBE_POD_POLICY") else defaults.pod_policy,
            metrics_from=_peers(env, "RLKUBE_METRICS_FROM", defaults.metrics_from),
            dashboard_from=_peers(env, "RLKUBE_DASHBOARD_FROM", defaults.dashboard_from),
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


def _non_root_uid(env: dict[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{key} must be a non-root UID (an integer >= 1; pods run as non-root), got {raw!r}")
    return int(raw)


def _flag(env: dict[str, str], key: str, default: bool) -> bool:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    if raw.lower() not in ("true", "false"):
        raise ValueError(f"{key} must be true or false, got {raw!r}")
    return raw.lower() == "true"


def _peers(env: dict[str, str], key: str, default: tuple[dict, ...]) -> tuple[dict, ...]:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        peers = json.loads(raw)
    except ValueError:
        peers = None
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ValueError(f"{key} must be a JSON list of NetworkPolicy peers (podSelector, namespaceSelector, "
                         f"ipBlock), got {raw!r}")
    return tuple(peers)

"""Test helpers (imported by the tests here): builders for RLJob bodies (as the API server returns them) and observed cluster state."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from typing import Any

from rlkube_operator import render
from rlkube_operator.reconcile import Observed
from rlkube_operator.settings import OperatorSettings

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
CREATED = NOW - timedelta(minutes=5)

BASE_SPEC: dict[str, Any] = {
    "model": {"preset": "tiny", "save": "/ckpt/tiny", "load": "/ckpt/tiny"},
    "data": {"promptData": "builtin:digit-successor"},
    "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2, "gpusPerEngine": 1},
    "reward": {"type": "exact"},
    "training": {"numRollout": 10},
    "resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2}},
}


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_body(spec: dict[str, Any] | None = None, *, name: str = "tiny", status: dict[str, Any] | None = None,
              generation: int = 1) -> dict[str, Any]:
    body = {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": f"uid-{name}",
            "generation": generation,
            "resourceVersion": "42",
            "creationTimestamp": CREATED.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        "spec": deep_merge(BASE_SPEC, spec or {}),
    }
    if status is not None:
        body["status"] = status
    return body


def rayjob_with_status(body: dict[str, Any], attempt: int, status: dict[str, Any] | None = None,
                       **meta: Any) -> dict[str, Any]:
    """The RayJob render_rayjob makes for `attempt`, with a KubeRay status."""
    from rlkube_runtime.spec.load import parse_rljob

    job = parse_rljob({k: body[k] for k in ("apiVersion", "kind", "spec")} | {"metadata": {"name": body["metadata"]["name"]}})
    rj = render.render_rayjob(render.JobRef.from_body(body), job.spec, attempt=attempt, settings=OperatorSettings())
    rj["metadata"].update(meta)
    if status is not None:
        rj["status"] = status
    return rj


def observed(body: dict[str, Any], rayjobs: list[dict[str, Any]] | None = None, *, configmap: Any = "render",
             children: bool = True, pods: list[dict[str, Any]] | None = None, now: datetime = NOW,
             conflicts: tuple[str, ...] = ()) -> Observed:
    """Cluster state around `body`; by default its ConfigMap and RBAC objects already exist."""
    if configmap == "render":
        configmap = render.render_configmap(render.JobRef.from_body(body), body["spec"])
    return Observed(
        rljob=body,
        rayjobs=rayjobs or [],
        configmap=configmap,
        service_account=children,
        role=children,
        role_binding=children,
        pods=pods or [],
        now=now,
        conflicts=conflicts,
    )


def default_settings() -> OperatorSettings:
    return OperatorSettings(
        trainer_image="reg/trainer:1", rollout_image="reg/rollout:1", max_backoff_seconds=300, resync_seconds=30
    )

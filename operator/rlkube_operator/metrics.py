"""The operator's Prometheus metrics (kopf has none built in), served by `serve()` on /metrics."""

from __future__ import annotations

import threading

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from rlkube_runtime.spec import RLJobPhase

RECONCILES = Counter(
    "rlkube_operator_reconcile_total", "RLJob reconciles, by result (ok, error).", ["result"]
)
RECONCILE_ERRORS = Counter(
    "rlkube_operator_reconcile_errors_total",
    "Failed RLJob reconciles, by kind (api: the API server refused or failed; spec: the RLJob's spec; internal).",
    ["kind"],
)
# Every label value exists from the start, so dashboards and alerts see zeros, not "no data",
# before the first failure.
for _result in ("ok", "error"):
    RECONCILES.labels(_result)
for _kind in ("api", "spec", "internal"):
    RECONCILE_ERRORS.labels(_kind)
RECONCILE_SECONDS = Histogram(
    "rlkube_operator_reconcile_duration_seconds",
    "Seconds one RLJob reconcile takes, API calls included.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOBS = Gauge("rlkube_operator_jobs", "RLJobs this operator watches, by phase.", ["phase"])
RESTARTS = Counter(
    "rlkube_operator_job_restarts_total",
    "Training attempts the operator started again from a checkpoint, by reason: after a failure or a preemption.",
    ["reason"],
)
for _reason in ("failure", "preemption"):
    RESTARTS.labels(_reason)
OBJECTS_CREATED = Counter(
    "rlkube_operator_objects_created_total", "Objects the operator created for RLJobs, by kind.", ["kind"]
)


class PhaseTracker:
    """Keeps rlkube_operator_jobs in step with the last phase seen for each RLJob."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        for phase in RLJobPhase:
            JOBS.labels(phase.value).set(0)

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop(key, None)
            else:
                self._phases[key] = phase
            counts = {p.value: 0 for p in RLJobPhase}
            for value in self._phases.values():
                counts[value] = counts.get(value, 0) + 1
            for value, count in counts.items():
                JOBS.labels(value).set(count)


_server_lock = threading.Lock()
_served_ports: set[int] = set()


def serve(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Start the /metrics HTTP server on `port` (once per port per process)."""
    with _server_lock:
        if port in _served_ports:
            return
        start_http_server(port, registry=registry)
        _served_ports.add(port)

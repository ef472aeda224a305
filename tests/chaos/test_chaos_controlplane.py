"""Chaos on the control plane side: the operator SIGKILLed in the middle of reconciling a batch
of new RLJobs, and kube-apiserver restarted under a running operator. Nothing may be created
twice, no status may go backwards, and the operator must go on reconciling (a new RLJob made
after the API server came back is picked up). Figures go to the README's table like the local
scenarios'.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import yaml
from chaos_outcome import record_figures
from harness import ControlPlane
from operator_fixtures import OperatorProcess, apply_file, get_or_none, kubectl_json
from test_operator import crd_installed, ns, rljob_yaml  # noqa: F401 - fixtures used here

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

JOBS = [f"batch-{i}" for i in range(6)]
# How far along a job is; a status may only move up this order while nothing fails.
PHASE_ORDER = {None: 0, "Pending": 1, "Queued": 2, "Starting": 3, "Running": 4}


@pytest.fixture
def submitters_follow_their_ray_job(crd_installed: ControlPlane, ns: str):  # noqa: F811
    """A kwok Stage that keeps this namespace's Job pods (KubeRay's submitters) Running, as
    `ray job submit` would until its Ray job ends (an hour here): kwok's stock stage completes Job
    pods at once, and KubeRay fails a RayJob whose submitter finished before its Ray job did. It
    outweighs the stock pod-complete stage (weight 0) for these pods only."""
    cp = crd_installed
    stage = f"rlkube-test-submitter-follows-job-{ns}"
    complete = kubectl_json(cp, "get", "stage.kwok.x-k8s.io", "pod-complete")  # kwok's stock stage
    cp.apply_yaml(yaml.safe_dump({
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": stage},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".metadata.namespace", "operator": "In", "values": [ns]},
                *complete["spec"]["selector"]["matchExpressions"],  # not deleting, Running, owned by a Job
            ]},
            "weight": 1,
            "delay": {"durationMilliseconds": 3_600_000},
            "next": complete["spec"]["next"],  # then it completes, as the stock stage does at once
        },
    }))
    yield
    cp.kubectl("delete", "stage.kwok.x-k8s.io", stage, "--wait=false", check=False)


@pytest.fixture
def operator(crd_installed, tmp_path):  # noqa: F811 - crd_installed is the imported fixture
    proc = OperatorProcess(crd_installed, tmp_path / "operator.log", env={"RLKUBE_RESYNC_SECONDS": "2"})
    proc.start()
    yield proc
    if proc.alive():
        proc.stop()


class StatusWatch:
    """Polls every RLJob of a namespace in the background, keeping each one's (phase,
    restarts.job) history, to show that nothing moved backwards across the chaos."""

    def __init__(self, cp, ns: str):
        self.cp, self.ns = cp, ns
        self.history: dict[str, list[tuple[str | None, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            proc = self.cp.kubectl("-n", self.ns, "get", "rljobs", "-o", "json", check=False, timeout=10)
            if proc.returncode == 0:  # the API server may be down: that is the point
                for item in yaml.safe_load(proc.stdout)["items"]:
                    status = item.get("status") or {}
                    seen = (status.get("phase"), int((status.get("restarts") or {}).get("job") or 0))
                    runs = self.history.setdefault(item["metadata"]["name"], [])
                    if not runs or runs[-1] != seen:
                        runs.append(seen)
            time.sleep(0.2)

    def stop(self) -> dict[str, list]:
        self._stop.set()
        self._thread.join(timeout=15)
        return self.history

    def regressions(self) -> list[str]:
        out = []
        for name, runs in self.history.items():
            for (phase_a, job_a), (phase_b, job_b) in zip(runs, runs[1:]):
                if PHASE_ORDER.get(phase_b, 99) < PHASE_ORDER.get(phase_a, 99) or job_b < job_a:
                    out.append(f"{name}: {phase_a}/{job_a} -> {phase_b}/{job_b}")
        return out


def rayjobs_of(cp, ns: str) -> dict[str, list[str]]:
    items = kubectl_json(cp, "-n", ns, "get", "rayjobs")["items"]
    out: dict[str, list[str]] = {}
    for rj in items:
        out.setdefault(rj["metadata"]["labels"].get("rlkube.io/rljob", "?"), []).append(rj["metadata"]["name"])
    return out


def all_reconciled(cp, ns: str, names: list[str]) -> bool:
    """Every RLJob has its first attempt's RayJob and a status naming it."""
    rayjobs = rayjobs_of(cp, ns)
    for name in names:
        status = (get_or_none(cp, ns, "rljob", name) or {}).get("status") or {}
        if rayjobs.get(name) != [f"{name}-0"] or status.get("rayJobName") != f"{name}-0":
            return False
    return True


def test_operator_sigkill_mid_reconcile_then_restart_creates_nothing_twice_and_loses_no_status(
    operator, ns, tmp_path, submitters_follow_their_ray_job  # noqa: F811
):
    cp = operator.cp
    watch = StatusWatch(cp, ns)
    try:
        docs = "---\n".join(rljob_yaml(name) for name in JOBS)
        assert apply_file(cp, tmp_path / "batch.yaml", docs, ns).returncode == 0
        # Strike the moment the operator says it created the first RayJob: it is in the middle of
        # the batch (read from its log, which is faster than asking the API server).
        deadline = time.monotonic() + 60
        while "created RayJob" not in operator.log_text():
            assert time.monotonic() < deadline and operator.alive(), operator.log_tail()
            time.sleep(0.002)
        operator.process.send_signal(signal.SIGKILL)
        operator.process.wait(timeout=10)
        at_kill = sum(len(v) for v in rayjobs_of(cp, ns).values())
        restarted = time.monotonic()
        operator.start()
        cp.wait_for(lambda: all_reconciled(cp, ns, JOBS), 120, "every RLJob reconciled after the restart")
        recovered = time.monotonic() - restarted
        time.sleep(5)  # a few more resyncs: nothing further may appear
        rayjobs = rayjobs_of(cp, ns)
        created_after = operator.metric("rlkube_operator_objects_created_total", kind="RayJob")
    finally:
        watch.stop()
    duplicates = sum(len(v) - 1 for v in rayjobs.values())
    figures = {
        "rljobs": len(JOBS),
        "rayjobs_at_kill": at_kill,
        "rayjobs_created_after_restart": int(created_after),
        "duplicate_rayjobs": duplicates,
        "status_regressions": len(watch.regressions()),
        "operator_reconciled_all_s": round(recovered, 2),
    }
    record_figures("operator SIGKILL mid-reconcile -> restart", figures)
    assert rayjobs == {name: [f"{name}-0"] for name in JOBS}, rayjobs
    assert duplicates == 0
    assert at_kill + created_after == len(JOBS), figures  # each RayJob created exactly once in all
    assert watch.regressions() == [], watch.history
    for name in JOBS:
        status = get_or_none(cp, ns, "rljob", name)["status"]
        assert status["restarts"]["job"] == 0 and status["rayJobName"] == f"{name}-0", status
        for kind, child in (("configmap", "spec"), ("serviceaccount", "runtime"), ("role", "runtime"),
                            ("rolebinding", "runtime")):
            assert get_or_none(cp, ns, kind, f"{name}-{child}") is not None, (kind, name)


def test_apiserver_restart_the_operators_watch_recovers_and_a_new_rljob_is_reconciled(
    operator, ns, tmp_path, submitters_follow_their_ray_job  # noqa: F811
):
    cp = operator.cp
    assert apply_file(cp, tmp_path / "before.yaml", rljob_yaml("before"), ns).returncode == 0
    cp.wait_for(lambda: all_reconciled(cp, ns, ["before"]), 60, "the first RLJob reconciled")
    watch = StatusWatch(cp, ns)
    try:
        down = cp.restart_apiserver()
        back = time.monotonic()
        assert operator.alive(), operator.log_tail()
        assert apply_file(cp, tmp_path / "after.yaml", rljob_yaml("after"), ns).returncode == 0
        cp.wait_for(lambda: all_reconciled(cp, ns, ["before", "after"]), 180,
                    f"the RLJob made after the API server restart reconciled\n{operator.log_tail()}")
        picked_up = time.monotonic() - back
        time.sleep(3)
        rayjobs = rayjobs_of(cp, ns)
    finally:
        watch.stop()
    figures = {
        "apiserver_down_s": round(down, 2),
        "new_rljob_reconciled_after_s": round(picked_up, 2),
        "duplicate_rayjobs": sum(len(v) - 1 for v in rayjobs.values()),
        "status_regressions": len(watch.regressions()),
        "operator_alive": operator.alive(),
    }
    record_figures("kube-apiserver restart -> watch recovers, new RLJob reconciled", figures)
    assert rayjobs == {"before": ["before-0"], "after": ["after-0"]}, rayjobs
    assert watch.regressions() == [], watch.history
    assert operator.alive()

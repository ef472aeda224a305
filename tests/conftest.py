"""Suite-wide: which tests must share one pytest-xdist worker, and the control plane they share.

`make test` runs the suite on three workers (`-n 3 --dist loadgroup`). A session-scoped fixture is
made once per worker, so the tests that share an expensive one are kept on one worker: everything
on the shared control plane, everything on the real node (one per machine), and the chaos suite
(its own control plane and its reference run).
The rest is spread over the workers as they free up.

``control_plane`` (session scope) is a running tests/controlplane/harness.py ControlPlane: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kwok with two fake nodes of 8
``nvidia.com/gpu`` each, and the KubeRay operator; one for tests/integration and tests/security
alike (tests/chaos has its own). Mark tests that use it ``@pytest.mark.controlplane`` and
``@pytest.mark.slow``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CONTROLPLANE_DIR = TESTS / "controlplane"
FAKE_NODES = 2
GPUS_PER_NODE = 8


def xdist_group_of(path: Path, markers: set[str], fixtures: set[str]) -> str | None:
    """The worker group a test belongs to, or None when it may run anywhere."""
    if TESTS / "chaos" in path.parents:
        return "chaos"
    if "pods" in markers or "cluster" in fixtures:
        return "pods"  # one real node per machine
    if "controlplane" in markers or "control_plane" in fixtures:
        return "controlplane"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        group = xdist_group_of(Path(str(item.path)), markers, set(getattr(item, "fixturenames", ())))
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if str(CONTROLPLANE_DIR) not in sys.path:
        sys.path.insert(0, str(CONTROLPLANE_DIR))
    from harness import BUILD_COMMAND, ControlPlane, cache_dir, missing_binaries, processes_in_groups

    missing = missing_binaries()
    if missing:
        # CI builds them first (make test -> controlplane); a missing binary is a setup error, not a skip.
        pytest.fail(
            f"control plane binaries missing in {cache_dir() / 'bin'}: {', '.join(missing)}; "
            f"run `{BUILD_COMMAND}` first",
            pytrace=False,
        )
    # Logs go to RLKUBE_CONTROLPLANE_LOGS if set, else to pytest's temp dir, which outlives the run
    # (pytest keeps the last three runs' dirs).
    logs = os.environ.get("RLKUBE_CONTROLPLANE_LOGS")
    logs_dir = Path(logs) if logs else tmp_path_factory.mktemp("controlplane-logs")
    cp = ControlPlane(nodes=FAKE_NODES, gpus_per_node=GPUS_PER_NODE, logs_dir=logs_dir)
    cp.start()
    pgids = cp.pids
    try:
        yield cp
    finally:
        cp.stop()
    survivors = processes_in_groups(pgids)
    if survivors:
        pytest.fail(f"control plane processes survived stop(): {survivors}", pytrace=False)


class _WorkerLoad:
    """Seconds each xdist worker and each group spent in tests, printed after the slowest tests:
    the suite's wall time is its busiest worker's, so this shows where the budget goes."""

    def __init__(self) -> None:
        self.by_worker: dict[str, float] = {}
        self.by_group: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        worker = getattr(getattr(report, "node", None), "gateway", None)
        worker_id = worker.id if worker is not None else "main"
        group = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "ungrouped"  # xdist's "id@group"
        self.by_worker[worker_id] = self.by_worker.get(worker_id, 0.0) + report.duration
        self.by_group[group] = self.by_group.get(group, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if len(self.by_worker) < 2:
            return
        line = lambda d: ", ".join(f"{k} {v / 60:.1f} min" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
        terminalreporter.write_line(f"time in tests per worker: {line(self.by_worker)}")
        terminalreporter.write_line(f"time in tests per group: {line(self.by_group)}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(_WorkerLoad(), "rlkube-worker-load")

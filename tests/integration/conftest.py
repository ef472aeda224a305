"""Fixtures for tests against the real control plane (tests/controlplane/harness.py).

``control_plane`` (session scope) is a running ControlPlane: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok with two fake nodes of 8 ``nvidia.com/gpu`` each, and
the KubeRay operator. Mark tests that use it ``@pytest.mark.controlplane`` and ``@pytest.mark.slow``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CONTROLPLANE_DIR = Path(__file__).resolve().parents[1] / "controlplane"
if str(CONTROLPLANE_DIR) not in sys.path:
    sys.path.insert(0, str(CONTROLPLANE_DIR))

from harness import (  # noqa: E402 - needs the sys.path entry above
    BUILD_COMMAND,
    ControlPlane,
    cache_dir,
    missing_binaries,
    processes_in_groups,
)

FAKE_NODES = 2
GPUS_PER_NODE = 8


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
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

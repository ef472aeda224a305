"""tests/security: every test here is marked `security`; those on the control plane share the
session's `control_plane` (tests/conftest.py) and one install of the chart (`secured`), whose
admission policies and pod policy are the ones under test.

The chart goes in as release `rlkube-sec` with tests/security/values.yaml (the pod policy the
hostile corpus is checked against, also given to `rlkube validate --policy`), and is uninstalled
when the package's last test is done, so its policies never judge other tests' RLJobs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for extra in (REPO / "tests" / "controlplane", REPO / "tests" / "integration"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from secured_cluster import CHART, PROBE_NAMESPACE, RELEASE, RELEASE_NAMESPACE, VALUES, refused_by_policy  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.security)


@pytest.fixture(scope="package")
def secured(control_plane) -> Iterator:
    """The control plane with the chart installed (CRD, RBAC, admission policies), its admission
    policy in force."""
    cp = control_plane
    cp.helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
            "--values", str(VALUES))
    try:
        def established() -> bool:
            crd = cp.get_json("crd", "rljobs.rlkube.io")
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])

        cp.wait_for(established, 60, "the RLJob CRD to be Established")
        cp.create_namespace(PROBE_NAMESPACE)
        # A policy takes effect once the API server has compiled it: until a hostPath is refused.
        cp.wait_for(lambda: refused_by_policy(cp), 60, "the chart's admission policy to be in force")
        yield cp
    finally:
        cp.helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", check=False)
        cp.kubectl("delete", "namespace", RELEASE_NAMESPACE, PROBE_NAMESPACE, "--wait=false", check=False)



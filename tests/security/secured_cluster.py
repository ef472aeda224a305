"""What tests/security's test modules and its conftest share: the chart release under test and its
values (the pod policy), and a probe of whether its admission policy is in force."""

from __future__ import annotations

import json
from pathlib import Path

from corpus import base_rljob

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHART = REPO / "charts" / "rlkube"
VALUES = HERE / "values.yaml"
RELEASE, RELEASE_NAMESPACE = "rlkube-sec", "rlkube-sec-system"
OPERATOR_SA = RELEASE  # the chart's full name: the release name contains the chart's name
PROBE_NAMESPACE = "rlkube-sec-probe"


def refused_by_policy(cp) -> bool:
    """Whether the API server refuses a hostPath volume through the admission policy yet."""
    doc = base_rljob("probe", PROBE_NAMESPACE)
    doc["spec"]["resources"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
    proc = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    return proc.returncode != 0 and "ValidatingAdmissionPolicy" in proc.stderr

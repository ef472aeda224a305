"""The Helm chart charts/rlkube for real: installed with the pinned helm into the test control plane,
its ServiceAccount's permissions asked of the API server, the operator run under that
ServiceAccount, and the operator dashboard's queries run against a real Prometheus scraping it
(the training dashboard's, against the job's pods on the real node: tests/pods/test_rljobs.py).

kwok runs no containers, so the chart's operator pod never really runs (the image is not even
pulled): the operator runs as a local subprocess instead, authenticated with a token of the chart's
ServiceAccount, which proves the chart's RBAC is enough for it to do its work.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import yaml
from harness import ControlPlane, ControlPlaneError
from prometheus_server import Prometheus, PrometheusMissing, assert_every_query_returns_data
from operator_fixtures import (
    OperatorProcess,
    apply_file,
    get_or_none,
    kubectl_json,
    token_kubeconfig,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlkube"
RELEASE, NAMESPACE, SA = "rlkube", "rlkube-system", "rlkube"
SA_USER = f"system:serviceaccount:{NAMESPACE}:{SA}"

# The unit test module holds the chart helpers (render, dashboard_queries, exported_series, ...).
_spec = importlib.util.spec_from_file_location("chart_render", REPO / "tests" / "unit" / "test_chart_render.py")
chart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chart)


def start_prometheus(workdir: Path, targets: dict[str, str]) -> Prometheus:
    try:
        return Prometheus(workdir, targets)
    except PrometheusMissing as err:
        pytest.fail(str(err), pytrace=False)


# --- the chart in the control plane --------------------------------------------------------------------


def can_i(cp: ControlPlane, *args: str) -> bool:
    proc = cp.kubectl("auth", "can-i", f"--as={SA_USER}", *args, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


def exists(cp: ControlPlane, *args: str) -> bool:
    proc = cp.kubectl("get", *args, check=False)
    if proc.returncode != 0 and "NotFound" not in proc.stderr and "not found" not in proc.stderr:
        raise ControlPlaneError(proc.stderr)
    return proc.returncode == 0


NAMESPACED_OBJECTS = [("deployment", RELEASE), ("serviceaccount", SA), ("service", f"{RELEASE}-metrics"),
                      ("configmap", f"{RELEASE}-dashboard-rlkube-training"),
                      ("configmap", f"{RELEASE}-dashboard-rlkube-operator")]
CLUSTER_OBJECTS = [("clusterrole", RELEASE), ("clusterrolebinding", RELEASE),
                   ("validatingadmissionpolicy", f"{RELEASE}-rljob-reach"),
                   ("validatingadmissionpolicybinding", f"{RELEASE}-rljob-reach"),
                   ("validatingadmissionpolicy", f"{RELEASE}-runtime-status"),
                   ("validatingadmissionpolicybinding", f"{RELEASE}-runtime-status")]


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane) -> ControlPlane:
    cp = control_plane
    cp.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace")
    yield cp
    cp.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)  # no-op after the last test


@pytest.mark.controlplane
@pytest.mark.slow
def test_helm_install_creates_an_established_crd_the_operator_and_its_rbac(release):
    cp = release

    def established():
        crd = kubectl_json(cp, "get", "crd", "rljobs.rlkube.io")
        return any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"].get("conditions", []))

    cp.wait_for(established, 60, "the RLJob CRD to be Established")
    for kind, name in NAMESPACED_OBJECTS:
        assert exists(cp, "-n", NAMESPACE, kind, name), f"{kind} {name} missing"
    for kind, name in CLUSTER_OBJECTS:
        assert exists(cp, kind, name), f"{kind} {name} missing"
    deployment = kubectl_json(cp, "-n", NAMESPACE, "get", "deployment", RELEASE)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == SA
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    status = json.loads(cp.helm("status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_operator_service_account_may_do_what_the_operator_needs_and_no_more(release):
    cp = release
    for args in (["create", "rayjobs.ray.io", "-n", "team-a"], ["delete", "rayjobs.ray.io", "-n", "team-a"],
                 ["watch", "rljobs.rlkube.io", "--all-namespaces"], ["patch", "rljobs.rlkube.io", "--subresource=status", "-n", "x"],
                 ["get", "rljobs.rlkube.io", "--subresource=status", "-n", "x"],
                 ["create", "roles.rbac.authorization.k8s.io", "-n", "x"], ["create", "rolebindings.rbac.authorization.k8s.io", "-n", "x"],
                 ["create", "configmaps", "-n", "x"], ["create", "serviceaccounts", "-n", "x"], ["list", "pods", "-n", "x"],
                 ["create", "events", "-n", "x"], ["watch", "customresourcedefinitions"], ["list", "namespaces"],
                 ["create", "secrets", "-n", "x"], ["create", "networkpolicies.networking.k8s.io", "-n", "x"]):
        assert can_i(cp, *args), f"the operator's ServiceAccount may not {' '.join(args)}"
    for args in (["get", "secrets", "-n", "x"], ["list", "secrets", "--all-namespaces"], ["delete", "nodes"],
                 ["create", "pods", "-n", "x"], ["delete", "pods", "-n", "x"], ["create", "rljobs.rlkube.io", "-n", "x"],
                 ["update", "rljobs.rlkube.io", "-n", "x"], ["delete", "configmaps", "-n", "x"],
                 ["escalate", "roles.rbac.authorization.k8s.io", "-n", "x"], ["bind", "roles.rbac.authorization.k8s.io", "-n", "x"],
                 ["create", "clusterroles"], ["create", "clusterrolebindings"], ["patch", "roles.rbac.authorization.k8s.io", "-n", "x"],
                 ["create", "customresourcedefinitions"], ["create", "serviceaccounts", "--subresource=token", "-n", "x"],
                 ["create", "pods", "--subresource=exec", "-n", "x"], ["list", "clusterkopfpeerings.kopf.dev"],
                 ["patch", "rljobs.rlkube.io", "-n", "x"], ["update", "secrets", "-n", "x"],
                 ["get", "networkpolicies.networking.k8s.io", "-n", "x"]):
        assert not can_i(cp, *args), f"the operator's ServiceAccount may {' '.join(args)}, which it does not need"


def small_rljob(name: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
        "spec": {
            "model": {"preset": "tiny"}, "data": {"promptData": "builtin:digit-successor"},
            "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2, "gpusPerEngine": 2},
            "reward": {"type": "exact"}, "training": {"numRollout": 3},
            "resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2}},
        },
    })


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_operator_runs_under_the_chart_service_account_and_its_panels_get_data(release, tmp_path):
    """`rlkube operator --standalone` with a token of the chart's ServiceAccount reconciles an RLJob
    (creating the RayJob, ConfigMap, ServiceAccount, Role, RoleBinding, API-key Secret and NetworkPolicy: the Role's grant needs no
    `escalate` because the ServiceAccount holds get/patch on rljobs/status), and Prometheus scraping
    its /metrics answers every operator dashboard query."""
    cp = release
    ns = "rlkube-chart-op"
    cp.create_namespace(ns)
    kubeconfig = token_kubeconfig(cp, NAMESPACE, SA, tmp_path / "sa.kubeconfig")
    operator = OperatorProcess(cp, tmp_path / "operator.log", env={"KUBECONFIG": str(kubeconfig),
                                                                      "RLKUBE_RESYNC_SECONDS": "2"})
    prom = None
    try:
        operator.start()
        prom = start_prometheus(tmp_path, {"rlkube-operator": f"127.0.0.1:{operator.metrics_port}"})
        start = time.time() - 5
        assert apply_file(cp, tmp_path / "job.yaml", small_rljob("chart"), ns).returncode == 0

        def started():
            job = get_or_none(cp, ns, "rljob", "chart")
            return job is not None and (job.get("status") or {}).get("phase") in ("Starting", "Running")

        cp.wait_for(started, 90, "the RLJob to reach phase Starting under the chart's ServiceAccount")
        for kind, name in (("rayjob", "chart-0"), ("configmap", "chart-spec"), ("serviceaccount", "chart-runtime"),
                           ("role", "chart-runtime"), ("rolebinding", "chart-runtime"), ("secret", "chart-api-key"),
                           ("networkpolicy", "chart")):
            assert get_or_none(cp, ns, kind, name) is not None, f"{kind} {name} was not created"
        assert "Forbidden" not in operator.log_text(), operator.log_tail()
        operator_queries = [q for q in chart.dashboard_queries() if q[0] == "rlkube-operator.json"]
        # Every panel has data, the errors panel included: its series exist at zero from the start.
        assert 'rlkube_operator_reconcile_errors_total{kind="api"} 0.0' in operator.metrics()
        assert_every_query_returns_data(prom, operator_queries, start, timeout=90, translate=chart.for_prometheus)
    finally:
        if prom is not None:
            prom.stop()
        code = operator.stop()
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    assert code in (0, None), f"operator exited with {code}:\n{operator.log_tail()}"
    assert "Traceback" not in operator.log_text(), operator.log_text()[-6000:]


@pytest.mark.controlplane
@pytest.mark.slow
def test_helm_uninstall_removes_what_it_installed_but_keeps_the_crd(release):
    """Helm never deletes what a chart's crds/ installed (so RLJobs survive an uninstall)."""
    cp = release
    cp.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    cp.wait_for(lambda: not any(exists(cp, "-n", NAMESPACE, k, n) for k, n in NAMESPACED_OBJECTS)
                and not any(exists(cp, k, n) for k, n in CLUSTER_OBJECTS), 60, "the release's objects to go")
    assert not can_i(cp, "create", "rayjobs.ray.io", "-n", "team-a")
    assert exists(cp, "crd", "rljobs.rlkube.io")

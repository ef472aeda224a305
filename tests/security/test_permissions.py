"""Least privilege, asked of the API server: what the operator's ServiceAccount (the chart's, cluster
wide and in namespaced mode) and a job's runtime ServiceAccount may do, from `kubectl auth can-i
--list`, compared with exactly what each calls; the negatives (no Secret read, no pod created, no
other RLJob patched); and the admission policy that keeps the runtime to the status fields it reports."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from operator_fixtures import kubectl_json
from rlkube_operator import render
from secured_cluster import CHART, OPERATOR_SA, RELEASE_NAMESPACE

# What every authenticated identity may do (system:basic-user, system:discovery, ...): not the chart's.
BASELINE = {"selfsubjectaccessreviews.authorization.k8s.io", "selfsubjectrulesreviews.authorization.k8s.io",
            "selfsubjectreviews.authentication.k8s.io"}
OPERATOR_NAMESPACED = {
    "rljobs.rlkube.io": {"get", "list", "watch", "delete"},
    "rljobs.rlkube.io/status": {"get", "patch"},
    "rayjobs.ray.io": {"list", "watch", "create", "patch", "delete"},
    "configmaps": {"get", "create", "patch"},
    "serviceaccounts": {"get", "create"},
    "secrets": {"create"},
    "pods": {"list"},
    "events": {"create"},
    "roles.rbac.authorization.k8s.io": {"get", "create"},
    "rolebindings.rbac.authorization.k8s.io": {"get", "create"},
    "networkpolicies.networking.k8s.io": {"create"},
}
OPERATOR_CLUSTER = {"customresourcedefinitions.apiextensions.k8s.io": {"list", "watch"}, "namespaces": {"list", "watch"}}
NEVER = [  # (verb, resource[/subresource]): nothing of rlkube's may do these
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("create", "pods"), ("create", "pods/exec"),
    ("update", "rljobs.rlkube.io"), ("patch", "rljobs.rlkube.io"), ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("escalate", "roles.rbac.authorization.k8s.io"), ("bind", "roles.rbac.authorization.k8s.io"),
    ("create", "serviceaccounts/token"), ("impersonate", "users"),
    ("create", "validatingadmissionpolicies.admissionregistration.k8s.io"),
]


def can_i_list(cp, user: str, namespace: str) -> dict[str, set[str]]:
    """`kubectl auth can-i --list --as USER -n NS`: resource (with its group, and /subresource) -> verbs,
    resource names appended as `name[a,b]`; the baseline every user has left out."""
    out = cp.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    rules: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        # "<resource>   [<non-resource URLs>]   [<resource names>]   [<verbs>]"
        row = re.match(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        if row is None or row.group(1) in BASELINE:
            continue  # non-resource URLs (discovery: no resource column) and the baseline
        resource, _, names, verbs = row.groups()
        key = f"{resource}[{names}]" if names else resource
        rules.setdefault(key, set()).update(verbs.split())
    return rules


def can_i(cp, user: str, verb: str, resource: str, namespace: str, name: str = "") -> bool:
    """`kubectl auth can-i VERB RESOURCE[/NAME] [--subresource S]`; `resource` may end in /subresource."""
    resource, _, subresource = resource.partition("/")
    args = ["auth", "can-i", verb, resource + (f"/{name}" if name else ""), f"--as={user}", "-n", namespace]
    if subresource:
        args.append(f"--subresource={subresource}")
    return cp.kubectl(*args, check=False).stdout.strip() == "yes"


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_operator_may_do_what_it_calls_and_nothing_more(secured):
    cp = secured
    operator = f"system:serviceaccount:{RELEASE_NAMESPACE}:{OPERATOR_SA}"
    assert can_i_list(cp, operator, "team-x") == OPERATOR_NAMESPACED | OPERATOR_CLUSTER
    for verb, resource in NEVER:
        assert not can_i(cp, operator, verb, resource, "team-x"), f"the operator may {verb} {resource}"


@pytest.mark.controlplane
@pytest.mark.slow
def test_in_namespaced_mode_the_operator_has_its_grants_in_that_namespace_only(secured, tmp_path):
    cp = secured
    # The chart's RBAC of a release watching team-x, applied alone (one operator is installed already).
    args = ["template", "rlkube-one", str(CHART), "--namespace", RELEASE_NAMESPACE, "--set", "watchNamespace=team-x",
            "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml"]
    docs = cp.helm(*args).stdout
    cp.create_namespace("team-x")
    cp.apply_yaml(docs)
    operator = f"system:serviceaccount:{RELEASE_NAMESPACE}:rlkube-one"
    try:
        cp.wait_for(lambda: can_i(cp, operator, "create", "rayjobs.ray.io", "team-x"), 30, "the Role to apply")
        assert can_i_list(cp, operator, "team-x") == OPERATOR_NAMESPACED | OPERATOR_CLUSTER
        assert can_i_list(cp, operator, "team-y") == OPERATOR_CLUSTER  # kopf's cluster-wide lists only
        for verb, resource in NEVER:
            assert not can_i(cp, operator, verb, resource, "team-x"), f"the operator may {verb} {resource}"
    finally:
        cp.kubectl("delete", "-f", "-", "--wait=false", input=docs, check=False)


_namespaces = iter(range(100))


@pytest.fixture
def two_jobs(secured):
    """RLJobs `mine` and `other` in one namespace, with the runtime ServiceAccount, Role and
    RoleBinding the operator renders for `mine` (owned by it, as the operator makes them)."""
    cp = secured
    namespace = f"rlkube-sec-runtime-{next(_namespaces)}"  # each its own: a deleted one lingers a while
    cp.create_namespace(namespace)
    for name in ("mine", "other"):
        doc = {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name, "namespace": namespace},
               "spec": {"model": {"preset": "tiny"}, "data": {"promptData": "builtin:digit-successor"},
                        "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2}, "reward": {"type": "exact"},
                        "training": {"numRollout": 3}}}
        cp.kubectl("apply", "-f", "-", input=json.dumps(doc))
        cp.kubectl("-n", namespace, "patch", "rljob", name, "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": {"phase": "Running", "restarts": {"job": 0, "preemptions": 0}}}))
    uid = kubectl_json(cp, "-n", namespace, "get", "rljob", "mine")["metadata"]["uid"]
    ref = render.JobRef("mine", namespace, uid)
    cp.apply_yaml(yaml.safe_dump_all([render.render_service_account(ref), render.render_role(ref),
                                      render.render_role_binding(ref)]))
    runtime = f"system:serviceaccount:{namespace}:mine-runtime"
    cp.wait_for(lambda: can_i(cp, runtime, "patch", "rljobs.rlkube.io/status", namespace, "mine"), 30, "the Role")
    yield cp, namespace, runtime
    cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.mark.controlplane
@pytest.mark.slow
def test_a_jobs_runtime_may_get_and_patch_its_own_rljobs_status_and_nothing_else(two_jobs):
    cp, namespace, runtime = two_jobs
    assert can_i_list(cp, runtime, namespace) == {"rljobs.rlkube.io/status[mine]": {"get", "patch"}}
    assert not can_i(cp, runtime, "patch", "rljobs.rlkube.io/status", namespace, "other")
    assert not can_i(cp, runtime, "patch", "rljobs.rlkube.io", namespace, "mine")
    for verb, resource in NEVER + [("get", "rayjobs.ray.io"), ("get", "configmaps"), ("get", "pods")]:
        assert not can_i(cp, runtime, verb, resource, namespace), f"the runtime may {verb} {resource}"


def patch_status(cp, namespace: str, name: str, user: str, status: dict):
    return cp.kubectl("-n", namespace, "patch", "rljob", name, "--subresource=status", "--type=merge", "-p",
                      json.dumps({"status": status}), f"--as={user}", check=False)


@pytest.mark.controlplane
@pytest.mark.slow
def test_a_jobs_runtime_may_change_only_the_status_fields_it_reports(two_jobs):
    cp, namespace, runtime = two_jobs
    reported = {"progress": {"rollout": 2, "numRollout": 3}, "restarts": {"engine": 1},
                "lastPreemption": {"attempt": 0, "rollout": 2}}
    assert patch_status(cp, namespace, "mine", runtime, reported).returncode == 0
    for status, field in [({"phase": "Succeeded"}, "status.phase"),
                          ({"restarts": {"job": 7}}, "status.restarts.job"),
                          ({"message": "all good"}, "status.message"),
                          ({"conditions": [{"type": "Failed", "status": "False", "reason": "x", "message": "",
                                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}, "status.conditions")]:
        proc = patch_status(cp, namespace, "mine", runtime, status)
        assert proc.returncode != 0 and f"{field}: the job's runtime reports only" in proc.stderr, (status, proc.stderr)
    status = kubectl_json(cp, "-n", namespace, "get", "rljob", "mine")["status"]
    assert status["phase"] == "Running" and status["restarts"] == {"job": 0, "preemptions": 0, "engine": 1}
    # Another RLJob's status is not its to patch at all (RBAC), and the operator's writes stay free.
    assert "forbidden" in patch_status(cp, namespace, "other", runtime, reported).stderr.lower()
    assert patch_status(cp, namespace, "mine", f"system:serviceaccount:{RELEASE_NAMESPACE}:{OPERATOR_SA}",
                        {"phase": "Succeeded"}).returncode == 0

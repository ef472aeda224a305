"""Restricted by default: every pod the operator renders, for every example RLJob, passes the
`restricted` Pod Security Standard as the API server's own PodSecurity admission judges it, and
the pods KubeRay then creates for a job (head, workers with KubeRay's init container, the
submitter) are admitted in a namespace that enforces it.

kwok runs no containers, so whether the processes then run as UID 65532 on a read-only root is for
a real node to show (tests/node, where it exists)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from operator_fixtures import OperatorProcess, get_or_none, kubectl_json, token_kubeconfig
from rlkube_operator.preview import preview
from rlkube_operator.settings import OperatorSettings
from rlkube_runtime.spec.contract import IMAGE_UID
from rlkube_runtime.spec.load import load_documents
from secured_cluster import OPERATOR_SA, RELEASE_NAMESPACE, REPO, VALUES

EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
RESTRICTED = "rlkube-sec-restricted"
RESTRICTED_LABELS = {"pod-security.kubernetes.io/enforce": "restricted",
                     "pod-security.kubernetes.io/enforce-version": "latest"}


def rendered_pods(doc: dict, namespace: str) -> list[dict]:
    """Each pod template of the RayJob the operator renders for `doc`, as a Pod in `namespace`."""
    rayjob = next(o for o in preview(doc, settings=OperatorSettings(), namespace=namespace) if o["kind"] == "RayJob")
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"], "submitter": rayjob["spec"]["submitterPodTemplate"]}
    templates |= {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    pods = []
    for role, template in templates.items():
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{doc['metadata']['name']}-{role}", "namespace": namespace,
                            "labels": template["metadata"]["labels"]},
               "spec": copy.deepcopy(template["spec"])}
        if role == "submitter":
            pod["spec"]["serviceAccountName"] = "default"
        pods.append(pod)
    return pods


@pytest.fixture(scope="module")
def restricted(control_plane):
    cp = control_plane
    cp.create_namespace(RESTRICTED)
    cp.kubectl("label", "namespace", RESTRICTED, *(f"{k}={v}" for k, v in RESTRICTED_LABELS.items()), "--overwrite")
    yield cp
    cp.kubectl("delete", "namespace", RESTRICTED, "--wait=false", check=False)


@pytest.mark.controlplane
@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_pod_of_every_example_passes_the_restricted_standard(restricted, path: Path):
    cp = restricted
    for _, doc in load_documents(path):
        doc = copy.deepcopy(doc)
        doc["metadata"].pop("namespace", None)
        cp.kubectl("-n", RESTRICTED, "create", "serviceaccount", f"{doc['metadata']['name']}-runtime", check=False)
        for pod in rendered_pods(doc, RESTRICTED):
            proc = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
            assert proc.returncode == 0, f"{path.name} {pod['metadata']['name']}: {proc.stderr}"
            assert "Warning" not in proc.stderr, proc.stderr


@pytest.mark.controlplane
@pytest.mark.slow
def test_a_root_pod_is_refused_there_so_the_check_has_teeth(restricted):
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    pod = rendered_pods(doc, RESTRICTED)[0]
    del pod["spec"]["securityContext"]["runAsNonRoot"]
    pod["spec"]["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_ADMIN"]}
    proc = restricted.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert proc.returncode != 0 and 'violates PodSecurity "restricted:latest"' in proc.stderr, proc.stderr


@pytest.mark.controlplane
@pytest.mark.slow
def test_the_pods_kuberay_creates_for_a_job_are_admitted_in_a_restricted_namespace(secured, restricted, tmp_path):
    """The operator runs under the chart's ServiceAccount; KubeRay makes the pods from the RayJob,
    adding its own containers and settings; PodSecurity admits or refuses each as it is created."""
    cp = secured
    kubeconfig = token_kubeconfig(cp, RELEASE_NAMESPACE, OPERATOR_SA, tmp_path / "operator.kubeconfig")
    operator = OperatorProcess(cp, tmp_path / "operator.log", env={
        "KUBECONFIG": str(kubeconfig), "RLKUBE_RESYNC_SECONDS": "2", "RLKUBE_POD_POLICY": str(VALUES)})
    job = {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "strict", "namespace": RESTRICTED},
           "spec": {"model": {"preset": "tiny"}, "data": {"promptData": "builtin:digit-successor"},
                    "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2, "gpusPerEngine": 2}, "reward": {"type": "exact"},
                    "training": {"numRollout": 3},
                    "resources": {"placement": "separate", "trainer": {"nodes": 1, "gpusPerNode": 2},
                                  "rollout": {"gpus": 2}}}}
    try:
        operator.start()
        cp.kubectl("apply", "-f", "-", input=json.dumps(job))

        def every_pod_created():
            pods = kubectl_json(cp, "-n", RESTRICTED, "get", "pods", "-l", "rlkube.io/rljob=strict")["items"]
            roles = {p["metadata"]["labels"].get("rlkube.io/role") for p in pods}
            return pods if {"head", "trainer", "rollout", "submitter"} <= roles else None

        pods = cp.wait_for(every_pod_created, 120, "the head, trainer, rollout and submitter pods")
        for pod in pods:
            spec = pod["spec"]
            assert spec["securityContext"]["runAsUser"] == IMAGE_UID
            for container in spec.get("initContainers", []) + spec["containers"]:
                context = container.get("securityContext") or {}
                assert context.get("allowPrivilegeEscalation") is False, (pod["metadata"]["name"], container["name"])
        refusals = [e for e in kubectl_json(cp, "-n", RESTRICTED, "get", "events")["items"]
                    if "violates PodSecurity" in e.get("message", "")]
        assert refusals == [], [e["message"] for e in refusals]
        assert get_or_none(cp, RESTRICTED, "secret", "strict-api-key") is not None
        assert get_or_none(cp, RESTRICTED, "networkpolicy", "strict") is not None
    finally:
        operator.stop()
        cp.kubectl("-n", RESTRICTED, "delete", "rljob", "strict", "--wait=false", check=False)
    assert "Traceback" not in operator.log_text(), operator.log_tail()

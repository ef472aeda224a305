"""The real node itself: pods of rlkube's images run under the restricted Pod Security Standard,
reach Services by cluster DNS name and the API server through the kubernetes Service, and write to
PersistentVolumeClaims of the default StorageClass."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from node import NODE_NAME, STORAGE_CLASS, VOLUMES, Cluster

# One pytest-xdist worker runs every test on the real node: the session fixture is made once per
# worker, and a second worker's node would wait for the machine-wide node lock.
pytestmark = [pytest.mark.pods, pytest.mark.slow, pytest.mark.xdist_group("pods")]

UID = 65532  # the images' USER


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    """A fresh namespace that enforces the restricted Pod Security Standard."""
    name = f"pods-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    return name


def restricted_pod(name: str, image: str, command: list[str], **spec) -> dict:
    """A pod that passes the restricted Pod Security Standard, running ``command`` once."""
    container = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "Never",  # loaded by images/build.sh; there is no registry
        "command": command,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            **spec,
        },
    }


def run_to_completion(cluster: Cluster, namespace: str, pod: dict, timeout: float = 60) -> str:
    """Create the pod, wait until it ends, and return its log; fails unless it Succeeded."""
    cluster.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(pod))
    name = pod["metadata"]["name"]
    phase = cluster.wait_for(
        lambda: (p := cluster.get_json("pod", "-n", namespace, name)["status"].get("phase")) in ("Succeeded", "Failed")
        and p,
        timeout,
        f"pod {namespace}/{name} to finish",
    )
    log = cluster.kubectl("-n", namespace, "logs", name).stdout
    assert phase == "Succeeded", f"pod {name} {phase}; log:\n{log}\n{cluster.kubectl('-n', namespace, 'describe', 'pod', name).stdout}"
    return log


def test_the_node_is_ready_with_the_pinned_kubelet_and_containerd(cluster: Cluster):
    node = cluster.get_json("node", NODE_NAME)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.34.4"
    assert info["containerRuntimeVersion"].startswith("containerd://1.6.")
    assert {"type": "InternalIP", "address": cluster.control_plane.node_address} in node["status"]["addresses"]


def test_a_pod_of_the_operator_image_runs_rlkube_as_a_named_non_root_user(cluster, namespace, operator_image):
    check = "import getpass, os; print('user', getpass.getuser(), os.getuid())"
    pod = restricted_pod("smoke", operator_image, ["sh", "-c", f'rlkube --help && python -c "{check}"'])
    t0 = time.monotonic()
    log = run_to_completion(cluster, namespace, pod)
    print(f"pod ran to completion in {time.monotonic() - t0:.1f} s")
    assert "usage: rlkube" in log
    assert f"user rlkube {UID}" in log


def test_a_service_answers_another_pod_by_its_cluster_dns_name(cluster, namespace, operator_image):
    server = restricted_pod("web", operator_image, ["python", "-m", "http.server", "8080"],
                            container={"ports": [{"containerPort": 8080}],
                                       "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}})
    server["spec"]["restartPolicy"] = "Always"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    cluster.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                           "items": [server, service]}))
    cluster.wait_for(
        lambda: any(c["type"] == "Ready" and c["status"] == "True"
                    for c in cluster.get_json("pod", "-n", namespace, "web")["status"].get("conditions", [])),
        60, "the web pod Ready",
    )
    # Ready is not yet routable: kube-proxy programs the Service's new endpoint a moment later
    # (seconds on a loaded machine, where a first try was refused), so the client retries for 60 s.
    fetch = ("import time, urllib.request as u\n"
             "def get(url):\n"
             "    for _ in range(120):\n"
             "        try:\n"
             "            return u.urlopen(url, timeout=10).status\n"
             "        except OSError:\n"
             "            time.sleep(0.5)\n"
             "    return u.urlopen(url, timeout=10).status\n"
             f"print([get(url) for url in ('http://web/', 'http://web.{namespace}.svc.cluster.local/')])")
    log = run_to_completion(cluster, namespace, restricted_pod("client", operator_image, ["python", "-c", fetch]))
    assert "[200, 200]" in log


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(cluster, namespace, operator_image):
    # What the operator does in its pod: in-cluster config, the service account's token and CA.
    cluster.kubectl("-n", namespace, "create", "rolebinding", "view", "--clusterrole=view",
                    f"--serviceaccount={namespace}:default")
    script = (
        "from kubernetes import client, config; config.load_incluster_config(); "
        "print('host', client.Configuration.get_default_copy().host); "
        f"print('pods', len(client.CoreV1Api().list_namespaced_pod('{namespace}').items))"
    )
    log = run_to_completion(cluster, namespace, restricted_pod("incluster", operator_image, ["python", "-c", script]))
    assert "host https://10.0.0.1:443" in log
    assert "pods 1" in log  # itself


def test_a_claim_of_the_default_storage_class_binds_and_a_pod_writes_to_it(cluster, namespace, operator_image):
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    cluster.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(claim))
    writer = restricted_pod(
        "writer", operator_image, ["sh", "-c", "echo hello from $(id -u) > /data/greeting && cat /data/greeting"],
        container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
    )
    log = run_to_completion(cluster, namespace, writer)
    assert f"hello from {UID}" in log
    bound = cluster.get_json("pvc", "-n", namespace, "data")
    assert bound["status"]["phase"] == "Bound"
    assert bound["spec"]["storageClassName"] == STORAGE_CLASS  # the default class, filled in on creation
    volume = bound["spec"]["volumeName"]
    path = VOLUMES / volume / "greeting"
    assert path.read_text() == f"hello from {UID}\n"

    # Reclaim policy Delete: the claim's deletion takes the volume and its directory with it.
    cluster.kubectl("-n", namespace, "delete", "pod", "writer", "--wait=true")
    cluster.kubectl("-n", namespace, "delete", "pvc", "data", "--wait=true")
    cluster.wait_for(lambda: cluster.kubectl("get", "pv", volume, check=False).returncode != 0, 30,
                     f"PersistentVolume {volume} deleted")
    assert not Path(VOLUMES / volume).exists()

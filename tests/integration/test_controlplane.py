"""The test control plane itself: API server, kwok nodes, scheduler, KubeRay, GC, clean shutdown."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from harness import (
    BinariesMissing,
    ControlPlane,
    ControlPlaneError,
    processes_in_groups,
    read_versions,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

RAY_IMAGE = "rayproject/ray:2.40.0"  # never pulled: kwok only pretends to run it


def ray_cluster_yaml(name: str, namespace: str, workers: int = 1) -> str:
    resources = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [
                    {"name": "ray-head", "image": RAY_IMAGE, "resources": resources}]}},
            },
            "workerGroupSpecs": [{
                "groupName": "workers",
                "replicas": workers,
                "minReplicas": 0,
                "maxReplicas": 4,
                "rayStartParams": {},
                "template": {"spec": {"containers": [
                    {"name": "ray-worker", "image": RAY_IMAGE, "resources": resources}]}},
            }],
        },
    }
    return json.dumps(cluster)


def ray_pods(cp: ControlPlane, namespace: str, cluster: str) -> list[dict]:
    return cp.get_json("pods", "-n", namespace, "-l", f"ray.io/cluster={cluster}")["items"]


def worker_pods(cp: ControlPlane, namespace: str, cluster: str) -> list[dict]:
    return [p for p in ray_pods(cp, namespace, cluster) if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]


def ready_cluster(cp: ControlPlane, namespace: str, name: str, workers: int = 1) -> dict | None:
    rc = cp.get_json("raycluster", "-n", namespace, name)
    status = rc.get("status", {})
    if status.get("state") == "ready" and status.get("readyWorkerReplicas") == workers:
        return rc
    return None


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.create_namespace(name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def start_ray_cluster(cp: ControlPlane, namespace: str, name: str = "rc") -> dict:
    cp.apply_yaml(ray_cluster_yaml(name, namespace))
    return cp.wait_for(lambda: ready_cluster(cp, namespace, name), 60, f"RayCluster {namespace}/{name} ready")


def test_api_server_answers_with_the_pinned_version(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == read_versions()["KUBERNETES_VERSION"]
    assert control_plane.kubectl("auth", "can-i", "create", "pods").stdout.strip() == "yes"


def test_service_account_tokens_authenticate_and_rbac_authorizes(
    control_plane: ControlPlane, namespace: str
) -> None:
    token = control_plane.kubectl("-n", namespace, "create", "token", "default").stdout.strip()
    as_sa = ["--kubeconfig=/dev/null", f"--server={control_plane.server}", f"--token={token}",
             f"--certificate-authority={control_plane.ca_file}"]

    def can_list_pods() -> str:
        proc = subprocess.run([str(control_plane.bin("kubectl")), *as_sa, "-n", namespace, "auth", "can-i", "list", "pods"],
                              capture_output=True, text=True, timeout=30, check=False)
        return proc.stdout.strip()

    assert can_list_pods() == "no"  # authenticated as the service account, nothing granted yet
    control_plane.kubectl("-n", namespace, "create", "rolebinding", "view", "--clusterrole=view",
                          f"--serviceaccount={namespace}:default")
    assert control_plane.wait_for(lambda: can_list_pods() == "yes", 30, "RBAC to grant the binding")


def test_kwok_nodes_are_ready_with_gpu_capacity(control_plane: ControlPlane) -> None:
    nodes = control_plane.get_json("nodes", "-l", "type=kwok")["items"]
    assert len(nodes) == control_plane.nodes == 2
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True", node["metadata"]["name"]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == str(control_plane.gpus_per_node) == "8"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(control_plane.gpus_per_node) == "8"
        assert not node["spec"].get("taints"), node["spec"]["taints"]

    from kubernetes import client  # the Python client works against it too

    names = [n.metadata.name for n in client.CoreV1Api(control_plane.kube_client()).list_node().items]
    assert sorted(names) == ["kwok-node-0", "kwok-node-1"]


def test_rayclusters_are_served_by_the_kuberay_crds(control_plane: ControlPlane) -> None:
    proc = control_plane.kubectl("get", "rayclusters", "--all-namespaces")
    assert proc.returncode == 0
    for resource in ("rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"):
        control_plane.kubectl("get", "crd", resource)


def test_raycluster_pods_are_scheduled_run_and_the_cluster_turns_ready(
    control_plane: ControlPlane, namespace: str
) -> None:
    rc = start_ray_cluster(control_plane, namespace)

    pods = ray_pods(control_plane, namespace, "rc")
    kinds = sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods)
    assert kinds == ["head", "worker"]
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"].startswith("kwok-node-"), "placed by kube-scheduler on a kwok node"
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("RayCluster", rc["metadata"]["uid"])
    assert rc["status"]["desiredWorkerReplicas"] == 1
    conditions = {c["type"]: c["status"] for c in rc["status"]["conditions"]}
    assert conditions["HeadPodReady"] == conditions["RayClusterProvisioned"] == "True"
    assert rc["status"]["head"]["podIP"], "kwok gives the head pod an IP"


def test_injected_worker_failure_makes_kuberay_replace_the_worker(
    control_plane: ControlPlane, namespace: str
) -> None:
    start_ray_cluster(control_plane, namespace)
    [worker] = worker_pods(control_plane, namespace, "rc")
    old_name = worker["metadata"]["name"]

    control_plane.inject_pod_failure(namespace, old_name, exit_code=137, reason="OOMKilled")

    # KubeRay deletes a worker pod in phase Failed and records why in an event on the RayCluster.
    def deleted_event() -> dict | None:
        events = control_plane.get_json("events", "-n", namespace, "--field-selector", "reason=DeletedWorkerPod")
        return next((e for e in events["items"] if old_name in e["message"]), None)

    event = control_plane.wait_for(deleted_event, 60, f"KubeRay's DeletedWorkerPod event for {old_name}")
    assert "Pod status: Failed" in event["message"]
    assert "ExitCode:137" in event["message"] and "OOMKilled" in event["message"]
    assert event["involvedObject"]["kind"] == "RayCluster"

    def replaced() -> list[dict]:
        workers = worker_pods(control_plane, namespace, "rc")
        running = [p for p in workers if p["status"].get("phase") == "Running"]
        return running if [p["metadata"]["name"] for p in workers] != [old_name] and len(running) == 1 else []

    [new_worker] = control_plane.wait_for(replaced, 60, "a new Running worker pod")
    assert new_worker["metadata"]["name"] != old_name
    assert control_plane.wait_for(lambda: ready_cluster(control_plane, namespace, "rc"), 60, "ready again")


def test_deleting_a_raycluster_garbage_collects_its_pods(control_plane: ControlPlane, namespace: str) -> None:
    start_ray_cluster(control_plane, namespace)
    assert len(ray_pods(control_plane, namespace, "rc")) == 2

    control_plane.kubectl("-n", namespace, "delete", "raycluster", "rc", "--wait=false")

    # The controller-manager's garbage collector deletes the owned pods and services;
    # kwok's pod-delete stage finishes pods that have a deletionTimestamp (there is no kubelet).
    def collected() -> bool:
        services = control_plane.get_json("services", "-n", namespace, "-l", "ray.io/cluster=rc")["items"]
        return not ray_pods(control_plane, namespace, "rc") and not services

    control_plane.wait_for(collected, 60, "the RayCluster's pods and services to be collected")


def test_a_stopped_control_plane_leaves_no_process_and_no_files(tmp_path) -> None:
    # A second instance beside the session's (the session fixture checks its own on teardown, with
    # KubeRay); without KubeRay to keep it short.
    cp = ControlPlane(nodes=1, gpus_per_node=1, logs_dir=tmp_path / "logs", start_kuberay=False)
    cp.start()
    try:
        pgids = cp.pids
        workdir = cp.kubeconfig.parent
        assert len(processes_in_groups(pgids)) == 5  # etcd, apiserver, controller-manager, scheduler, kwok
        cp.kubectl("get", "nodes")
    finally:
        cp.stop()
    assert processes_in_groups(pgids) == []
    assert not workdir.exists()
    assert (tmp_path / "logs" / "kube-apiserver.log").stat().st_size > 0, "logs outlive the control plane"


def test_a_component_that_fails_to_start_is_reported_with_its_log_and_cleaned_up(tmp_path) -> None:
    cp = ControlPlane(nodes=1, start_kuberay=False, logs_dir=tmp_path,
                      extra_args={"kube-apiserver": ["--no-such-flag"]})
    with pytest.raises(ControlPlaneError, match=r"(?s)kube-apiserver exited with code 1.*unknown flag: --no-such-flag"):
        cp.start()
    assert len(cp.started_pids) == 2  # etcd, kube-apiserver
    assert processes_in_groups(cp.started_pids) == []  # etcd, started before, was stopped too
    assert (tmp_path / "etcd.log").exists()


def test_missing_binaries_fail_with_the_build_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RLKUBE_CONTROLPLANE_CACHE", str(tmp_path))
    with pytest.raises(BinariesMissing, match="bash tests/controlplane/build.sh"):
        ControlPlane().start()
    assert not os.listdir(tmp_path)

"""RLJob -> RayJob, ConfigMap and RBAC objects."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from operator_testutil import default_settings, make_body
from rlkube_operator import render
from rlkube_operator.settings import OperatorSettings
from rlkube_runtime.spec.contract import IMAGE_UID
from rlkube_runtime.spec.load import SpecError, load_rljob, parse_rljob
from rlkube_runtime.spec.resources import RESERVED_LABEL_PREFIXES, RESERVED_LABELS

SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
PVC_VOLUME = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "rl-ckpt"}}
PVC_MOUNT = {"name": "ckpt", "mountPath": "/ckpt"}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROLLOUT_TAINT = {"key": "pool", "operator": "Equal", "value": "rollout", "effect": "NoSchedule"}

SEPARATE = {
    "rollout": {"gpusPerEngine": 2},
    "resources": {
        "placement": "separate",
        "trainer": {
            "nodes": 2,
            "gpusPerNode": 8,
            "image": "reg/custom-trainer:7",
            "resources": {"requests": {"cpu": "16", "memory": "200Gi"}, "limits": {"memory": "220Gi"}},
            "nodeSelector": {"pool": "train"},
            "tolerations": [GPU_TAINT],
        },
        "rollout": {
            "gpus": 16,
            "image": "reg/custom-rollout:7",
            "nodeSelector": {"pool": "rollout"},
            "tolerations": [ROLLOUT_TAINT],
        },
        "volumes": [PVC_VOLUME],
        "volumeMounts": [PVC_MOUNT],
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, SECRET_ENV],
    },
}


def _render(spec=None, attempt=0, **kw):
    body = make_body(spec, **kw)
    job = parse_rljob(body)
    ref = render.JobRef.from_body(body)
    return body, render.render_rayjob(ref, job.spec, attempt=attempt, settings=default_settings())


def _groups(rayjob):
    return {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def _container(group):
    return group["template"]["spec"]["containers"][0]


def _ray_resources(group):
    return json.loads(group["rayStartParams"]["resources"].strip("'"))


def test_separate_placement_has_a_trainer_group_and_a_rollout_group_of_whole_engines():
    _, rj = _render(SEPARATE)
    groups = _groups(rj)
    assert list(groups) == ["trainer", "rollout"]
    trainer, rollout = groups["trainer"], groups["rollout"]
    assert (trainer["replicas"], trainer["minReplicas"], trainer["maxReplicas"]) == (2, 2, 2)
    assert _container(trainer)["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainer["rayStartParams"]["num-gpus"] == "8"
    assert _ray_resources(trainer) == {render.TRAINER_RESOURCE: 8}
    # 16 rollout GPUs in engines of 2: two pods of 8 GPUs (4 engines each).
    assert rollout["replicas"] == 2
    assert _container(rollout)["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert _ray_resources(rollout) == {render.ROLLOUT_RESOURCE: 8}
    # The router (and the rollout manager it runs in) on the head: losing a rollout pod loses engines only.
    assert _ray_resources(rj["spec"]["rayClusterSpec"]["headGroupSpec"]) == {render.ROUTER_RESOURCE: 1}


def test_colocated_placement_has_one_gpu_group_carrying_trainer_and_engine_resources():
    _, rj = _render({"resources": {"placement": "colocated", "trainer": {"nodes": 3, "gpusPerNode": 4}}})
    groups = _groups(rj)
    assert list(groups) == ["trainer"]
    trainer = groups["trainer"]
    assert trainer["replicas"] == 3
    assert _container(trainer)["image"] == "reg/trainer:1"
    assert _container(trainer)["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert _ray_resources(trainer) == {render.TRAINER_RESOURCE: 4, render.ROLLOUT_RESOURCE: 4, render.ROUTER_RESOURCE: 1}
    assert "resources" not in rj["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]


def test_ray_resources_use_kuberays_single_quoted_json():
    _, rj = _render()
    assert _groups(rj)["trainer"]["rayStartParams"]["resources"] == (
        '\'{"rlkube_rollout":2,"rlkube_router":1,"rlkube_trainer":2}\''
    )


def test_head_is_cpu_only_with_the_trainer_image_and_the_ray_ports():
    _, rj = _render(SEPARATE)
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    container = _container(head)
    assert container["image"] == "reg/custom-trainer:7"
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert {p["name"] for p in container["ports"]} >= {"gcs-server", "dashboard", "client"}
    # The head may share tainted GPU nodes, but is not pinned to them.
    assert head["template"]["spec"]["tolerations"] == [GPU_TAINT]
    assert "nodeSelector" not in head["template"]["spec"]


def test_the_heads_prestop_hook_stops_the_driver_it_finds_by_its_pid_file():
    _, rj = _render(SEPARATE)
    head = _container(rj["spec"]["rayClusterSpec"]["headGroupSpec"])
    assert head["lifecycle"] == {"preStop": {"exec": {"command": ["rlkube", "stop-driver"]}}}
    assert {"name": "RLKUBE_DRIVER_PID_FILE", "value": "/tmp/rlkube-driver.pid"} in head["env"]
    for group in _groups(rj).values():  # the driver runs on the head only
        assert "lifecycle" not in _container(group)


def test_every_ray_container_is_ready_as_kuberay_checks_it_but_looked_at_every_2_s():
    """KubeRay's checks (raylet on every node, GCS on the head: a RayJob is submitted only once all
    pass) with its 50 s of tolerated failures, first looked at 2 s after start instead of 10."""
    _, rj = _render(SEPARATE)
    head = _container(rj["spec"]["rayClusterSpec"]["headGroupSpec"])["readinessProbe"]
    raylet = "wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
    gcs = "wget --tries 1 -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"
    assert head["exec"]["command"] == ["bash", "-c", f"{raylet} && {gcs}"]
    assert (head["initialDelaySeconds"], head["periodSeconds"], head["failureThreshold"]) == (2, 2, 25)
    for group in _groups(rj).values():
        probe = _container(group)["readinessProbe"]
        assert probe["exec"]["command"] == ["bash", "-c", raylet]
        assert probe["periodSeconds"] * probe["failureThreshold"] == 50
        assert "livenessProbe" not in _container(group)  # KubeRay's own is kept


def test_the_head_asks_for_two_cpus_and_8gi_unless_the_job_sizes_it():
    _, rj = _render(SEPARATE)
    assert _container(rj["spec"]["rayClusterSpec"]["headGroupSpec"])["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"}}
    small = {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "3Gi"}}
    _, rj = _render({"resources": {"head": {"resources": small}}})
    assert _container(rj["spec"]["rayClusterSpec"]["headGroupSpec"])["resources"] == small


def test_images_default_from_operator_settings_and_rollout_falls_back_to_the_trainer_image():
    _, rj = _render({"resources": {"placement": "separate", "rollout": {"gpus": 2}}})
    assert _container(_groups(rj)["trainer"])["image"] == "reg/trainer:1"
    assert _container(_groups(rj)["rollout"])["image"] == "reg/rollout:1"
    _, rj = _render({"resources": {"placement": "separate", "trainer": {"image": "mine:1"}, "rollout": {"gpus": 2}}})
    assert _container(_groups(rj)["rollout"])["image"] == "mine:1"


def test_pod_settings_pass_through_to_the_right_groups():
    _, rj = _render(SEPARATE)
    groups = _groups(rj)
    trainer_pod, rollout_pod = groups["trainer"]["template"]["spec"], groups["rollout"]["template"]["spec"]
    assert trainer_pod["nodeSelector"] == {"pool": "train"}
    assert trainer_pod["tolerations"] == [GPU_TAINT]
    assert rollout_pod["nodeSelector"] == {"pool": "rollout"}
    assert rollout_pod["tolerations"] == [ROLLOUT_TAINT]
    trainer_res = _container(groups["trainer"])["resources"]
    assert trainer_res["requests"] == {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "8"}
    assert trainer_res["limits"] == {"memory": "220Gi", "nvidia.com/gpu": "8"}
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]
    for group in (head, groups["trainer"], groups["rollout"]):
        pod = group["template"]["spec"]
        container = _container(group)
        assert PVC_VOLUME in pod["volumes"]
        assert PVC_MOUNT in container["volumeMounts"]
        assert SECRET_ENV in container["env"]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
        assert pod["serviceAccountName"] == "tiny-runtime"


def test_every_container_reads_the_spec_from_the_configmap_and_knows_its_rljob():
    _, rj = _render(attempt=3)
    assert rj["spec"]["entrypoint"] == "rlkube run /etc/rlkube/rljob.yaml"
    for group in [rj["spec"]["rayClusterSpec"]["headGroupSpec"], *_groups(rj).values()]:
        pod = group["template"]["spec"]
        assert {"name": "rlkube-spec", "configMap": {"name": "tiny-spec"}} in pod["volumes"]
        container = _container(group)
        assert {"name": "rlkube-spec", "mountPath": "/etc/rlkube", "readOnly": True} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RLKUBE_RLJOB_NAME"] == "tiny"
        assert env["RLKUBE_RLJOB_NAMESPACE"] == "team-a"
        assert env["RLKUBE_ATTEMPT"] == "3"


def test_rayjob_fields_leave_retries_to_the_operator():
    _, rj = _render(attempt=2)
    spec = rj["spec"]
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob"
    assert rj["metadata"]["name"] == "tiny-2"
    assert rj["metadata"]["labels"][render.LABEL_ATTEMPT] == "2"
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["backoffLimit"] == 0
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 0
    assert spec["suspend"] is False
    assert "activeDeadlineSeconds" not in spec


def test_suspend_and_remaining_deadline_are_rendered():
    body = make_body({"suspend": True, "activeDeadlineSeconds": 3600})
    job = parse_rljob(body)
    rj = render.render_rayjob(render.JobRef.from_body(body), job.spec, attempt=0, settings=default_settings(),
                              active_deadline_seconds=1234.6)
    assert rj["spec"]["suspend"] is True
    assert rj["spec"]["activeDeadlineSeconds"] == 1234


def test_queue_name_becomes_the_kueue_label_on_a_rayjob_created_suspended():
    _, rj = _render({"queueName": "gpu-queue"})
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert rj["spec"]["suspend"] is True  # Kueue admits it by unsuspending it
    _, plain = _render()
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


def test_every_object_is_owned_by_the_rljob_as_controller():
    body, rj = _render()
    ref = render.JobRef.from_body(body)
    objects = [
        rj,
        render.render_configmap(ref, body["spec"]),
        render.render_service_account(ref),
        render.render_role(ref),
        render.render_role_binding(ref),
    ]
    for obj in objects:
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "name": "tiny", "uid": "uid-tiny",
            "controller": True, "blockOwnerDeletion": True,
        }], obj["kind"]
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"][render.LABEL_RLJOB] == "tiny"


def test_configmap_round_trips_to_the_same_spec():
    body = make_body(SEPARATE)
    cm = render.render_configmap(render.JobRef.from_body(body), body["spec"])
    doc = yaml.safe_load(cm["data"]["rljob.yaml"])
    assert doc["metadata"] == {"name": "tiny", "namespace": "team-a"}
    assert parse_rljob(doc).spec == parse_rljob(body).spec
    assert render.configmap_spec(cm) == body["spec"]


def test_role_allows_only_get_and_patch_of_this_rljobs_status():
    body = make_body()
    ref = render.JobRef.from_body(body)
    assert render.render_role(ref)["rules"] == [{
        "apiGroups": ["rlkube.io"], "resources": ["rljobs/status"], "resourceNames": ["tiny"], "verbs": ["get", "patch"],
    }]
    binding = render.render_role_binding(ref)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tiny-runtime"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-runtime", "namespace": "team-a"}]


@pytest.mark.parametrize(
    ("gpus", "per_engine", "expected"),
    [(16, 2, (2, 8)), (8, 1, (1, 8)), (3, 1, (1, 3)), (12, 4, (3, 4)), (24, 8, (3, 8)), (0, 1, (1, 0)), (4, 4, (1, 4))],
)
def test_rollout_pods_hold_whole_engines(gpus, per_engine, expected):
    assert render.rollout_pods(gpus, per_engine) == expected


@pytest.mark.parametrize(
    ("gpus", "per_engine", "nodes", "expected"),
    [(32, 16, 2, (4, 8)), (16, 16, 2, (2, 8)), (32, 32, 4, (4, 8)), (16, 8, 2, (4, 4))],
)
def test_an_engine_over_several_nodes_has_a_rollout_pod_per_node(gpus, per_engine, nodes, expected):
    assert render.rollout_pods(gpus, per_engine, nodes) == expected


def test_the_multi_node_example_renders_one_rollout_pod_of_8_gpus_per_engine_node():
    path = pathlib.Path(__file__).resolve().parents[3] / "manifests" / "examples" / "qwen3-235b-multi-node-engines.yaml"
    [_, rollout] = render.worker_groups(load_rljob(path).spec, default_settings())
    assert (rollout.replicas, rollout.gpus_per_pod, rollout.ray_resources) == (4, 8, {"rlkube_rollout": 8})


@pytest.mark.parametrize(
    ("spec", "field", "needle"),
    [
        ({"rollout": {"gpusPerEngine": 16}, "resources": {"placement": "separate", "rollout": {"gpus": 32}}},
         "spec.rollout.gpusPerEngine", "set rollout.nodesPerEngine"),
        ({"rollout": {"gpusPerEngine": 32, "nodesPerEngine": 2}, "resources": {"placement": "separate", "rollout": {"gpus": 32}}},
         "spec.rollout.nodesPerEngine", "need 16 GPUs per pod"),
        ({"rollout": {"gpusPerEngine": 4}, "resources": {"placement": "colocated", "trainer": {"gpusPerNode": 2}}},
         "spec.rollout.gpusPerEngine", "gpusPerNode(2)"),
        ({"resources": {"trainer": {"resources": {"limits": {"nvidia.com/gpu": "8"}}}}},
         "spec.resources.trainer.resources.limits", "nvidia.com/gpu is set from the GPU count"),
        ({"resources": {"volumes": [{"name": "rlkube-spec", "emptyDir": {}}]}},
         "spec.resources.volumes[0].name", "reserved"),
        ({"resources": {"volumes": [PVC_VOLUME, {"name": "rlkube-shm", "emptyDir": {}}]}},
         "spec.resources.volumes[1].name", "reserved"),
        ({"resources": {"placement": "separate", "rollout": {
            "gpus": 2, "gpuResourceName": "amd.com/gpu", "resources": {"requests": {"amd.com/gpu": "2"}}}}},
         "spec.resources.rollout.resources.requests", "amd.com/gpu is set from the GPU count"),
        ({"resources": {"sharedMemorySize": "32Gi", "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                        "volumeMounts": [PVC_MOUNT, {"name": "dshm", "mountPath": "/dev/shm/"}]}},
         "spec.resources.sharedMemorySize", "and so does resources.volumeMounts[1] ('dshm')"),
        ({"resources": {"volumes": [PVC_VOLUME], "volumeMounts": [{"name": "ckpt", "mountPath": "/tmp/"}]}},
         "spec.resources.volumeMounts[0].mountPath", "rlkube mounts the job's spec file and its writable /tmp"),
        ({"resources": {"volumes": [{"name": "rlkube-tmp", "emptyDir": {}}]}},
         "spec.resources.volumes[0].name", "reserved"),
    ],
)
def test_specs_that_cannot_become_pods_name_the_field(spec, field, needle):
    with pytest.raises(render.RenderError) as err:
        _render(spec)
    assert err.value.field == field
    assert needle in err.value.message


@pytest.mark.parametrize(
    ("name", "needle"),
    [("a" * 41, "41 characters"), ("9lives", "start with a letter"), ("dotted.name", "start with a letter")],
)
def test_rljob_names_must_make_valid_rayjob_names(name, needle):
    with pytest.raises(render.RenderError) as err:
        render.check_name(name)
    assert err.value.field == "metadata.name"
    assert needle in err.value.message


def test_longest_allowed_name_with_a_large_attempt_fits_kuberays_limit():
    name = "a" * render.MAX_RLJOB_NAME_LENGTH
    render.check_name(name)
    assert len(render.rayjob_name(name, 999_999)) <= render.MAX_RAYJOB_NAME_LENGTH


def test_the_head_serves_the_training_metrics_on_a_named_port():
    head = _render({})[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "rlkube-metrics", "containerPort": 9464} in head["ports"]
    assert {"name": "RLKUBE_METRICS_PORT", "value": "9464"} in head["env"]
    # The port is the one the chart's PodMonitor scrapes by name: the spec refuses a user value for it.
    with pytest.raises(SpecError, match=r"spec.resources.env\[0\].name: 'RLKUBE_METRICS_PORT': variables starting"):
        _render({"resources": {"env": [{"name": "RLKUBE_METRICS_PORT", "value": "9000"}]}})


# --- pod settings: GPU resource name, affinity, priority, pull secrets, labels, /dev/shm ----------

POD_KNOBS = {
    "rollout": {"gpusPerEngine": 2},
    "resources": {
        "placement": "separate",
        "trainer": {
            "nodes": 1, "gpusPerNode": 8,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu.product", "operator": "In", "values": ["H200"]}]}]}}},
            "podLabels": {"pool": "train", "team": "trainer-team"},
            "podAnnotations": {"sidecar.istio.io/inject": "false"},
        },
        "rollout": {
            "gpus": 4, "gpuResourceName": "amd.com/gpu",
            "resources": {"requests": {"cpu": "8"}, "limits": {"nvidia.com/gpu": "0"}},
            "podAnnotations": {"example.com/engine": "sglang"},
        },
        "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        "priorityClassName": "rl-high",
        "sharedMemorySize": "64Gi",
        "podLabels": {"team": "rl", "cost-center": "42"},
        "podAnnotations": {"example.com/owner": "rl-team"},
    },
}


def _pods(rj):
    """{role: pod template} for the head, each worker group and (when rendered) the submitter."""
    spec = rj["spec"]
    pods = {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"]}
    pods.update({g["groupName"]: g["template"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]})
    if "submitterPodTemplate" in spec:
        pods["submitter"] = spec["submitterPodTemplate"]
    return pods


def test_each_group_requests_its_gpus_under_its_own_resource_name_and_the_head_under_none():
    _, rj = _render(POD_KNOBS)
    pods = _pods(rj)
    trainer, rollout = (pods[g]["spec"]["containers"][0]["resources"] for g in ("trainer", "rollout"))
    assert trainer["limits"] == {"nvidia.com/gpu": "8"}
    # rollout.gpus 4 in engines of 2: one pod of 4 amd.com/gpu. A hand-set nvidia.com/gpu (here 0)
    # is another resource to the renderer and passes through untouched.
    assert rollout["limits"] == {"nvidia.com/gpu": "0", "amd.com/gpu": "4"}
    assert rollout["requests"] == {"cpu": "8", "amd.com/gpu": "4"}
    assert _groups(rj)["rollout"]["rayStartParams"]["num-gpus"] == "4"  # Ray counts AMD GPUs as GPUs too
    assert "gpu" not in json.dumps(pods["head"]["spec"]["containers"][0]["resources"])


def test_affinity_goes_to_its_own_group_only():
    _, rj = _render(POD_KNOBS)
    pods = _pods(rj)
    assert pods["trainer"]["spec"]["affinity"] == POD_KNOBS["resources"]["trainer"]["affinity"]
    assert "affinity" not in pods["rollout"]["spec"]
    assert "affinity" not in pods["head"]["spec"]  # the head needs no GPU node


def test_priority_and_pull_secrets_reach_every_pod_the_submitter_included():
    _, rj = _render(POD_KNOBS)
    pods = _pods(rj)
    assert set(pods) == {"head", "trainer", "rollout", "submitter"}
    for role, pod in pods.items():
        assert pod["spec"]["priorityClassName"] == "rl-high", role
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], role


def test_the_submitter_is_kuberays_default_pod_with_the_jobs_pod_security_and_job_wide_settings():
    _, rj = _render(POD_KNOBS)
    submitter = rj["spec"]["submitterPodTemplate"]
    [container] = submitter["spec"]["containers"]
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert container["name"] == "ray-job-submitter"
    assert container["image"] == head["spec"]["containers"][0]["image"]
    assert container["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"},
                                      "requests": {"cpu": "500m", "memory": "200Mi"}}
    assert container["securityContext"] == head["spec"]["containers"][0]["securityContext"]
    assert submitter["spec"]["securityContext"] == head["spec"]["securityContext"]
    assert submitter["spec"]["restartPolicy"] == "Never"
    assert "command" not in container  # KubeRay fills in `ray job submit ...` itself
    # Rendered for every job: KubeRay's own submitter pod has no securityContext, which a namespace
    # enforcing the restricted Pod Security Standard refuses.
    _, plain = _render(SEPARATE)
    assert "securityContext" in plain["spec"]["submitterPodTemplate"]["spec"]


@pytest.mark.parametrize("spec", [SEPARATE, POD_KNOBS, {}], ids=["separate", "pod-knobs", "colocated"])
def test_every_pod_runs_as_the_fixed_non_root_user_without_privileges_on_a_read_only_root(spec):
    _, rj = _render(spec)
    for role, pod in _pods(rj).items():
        assert pod["spec"]["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
        }, role
        [container] = pod["spec"]["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True, "runAsNonRoot": True,
        }, role
        # What the processes write goes to an emptyDir: /tmp is the working directory and $HOME.
        assert {"name": "rlkube-tmp", "emptyDir": {}} in pod["spec"]["volumes"], role
        assert {"name": "rlkube-tmp", "mountPath": "/tmp"} in container["volumeMounts"], role
        assert container["workingDir"] == "/tmp", role
        assert {"name": "HOME", "value": "/tmp"} in container["env"], role


def test_the_operator_settings_choose_the_uid_and_whether_the_root_is_read_only():
    settings = OperatorSettings(run_as_user=4242, read_only_root_filesystem=False)
    body = make_body(SEPARATE)
    rj = render.render_rayjob(render.JobRef.from_body(body), parse_rljob(body).spec, attempt=0, settings=settings)
    for role, pod in _pods(rj).items():
        context = pod["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (4242, 4242, 4242), role
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False, role


def test_pod_labels_and_annotations_merge_job_wide_then_group_and_keep_rlkubes_own():
    _, rj = _render(POD_KNOBS, attempt=2)
    pods = _pods(rj)
    for role, pod in pods.items():
        labels = pod["metadata"]["labels"]
        assert labels["cost-center"] == "42", role
        assert (labels["rlkube.io/rljob"], labels["rlkube.io/attempt"], labels["rlkube.io/role"]) == ("tiny", "2", role)
        assert labels["app.kubernetes.io/managed-by"] == "rlkube-operator"
        assert pod["metadata"]["annotations"]["example.com/owner"] == "rl-team", role
    assert pods["trainer"]["metadata"]["labels"]["team"] == "trainer-team"  # the group's value wins
    assert pods["trainer"]["metadata"]["labels"]["pool"] == "train"
    assert pods["rollout"]["metadata"]["labels"]["team"] == "rl"
    assert "pool" not in pods["head"]["metadata"]["labels"]
    assert pods["trainer"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pods["rollout"]["metadata"]["annotations"]["example.com/engine"] == "sglang"
    assert "sidecar.istio.io/inject" not in pods["rollout"]["metadata"]["annotations"]


def test_shared_memory_size_mounts_a_memory_emptydir_at_dev_shm_on_every_ray_pod():
    _, rj = _render(POD_KNOBS)
    for role, pod in _pods(rj).items():
        if role == "submitter":
            continue  # runs `ray job submit` only
        assert {"name": "rlkube-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["spec"]["volumes"]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "rlkube-shm", "mountPath": "/dev/shm"} in mounts, role


def test_without_shared_memory_size_dev_shm_is_left_to_kuberay():
    # KubeRay adds its own memory-backed /dev/shm, sized to the container's memory, to every Ray
    # pod that mounts none; an explicit volumeMount there (the examples' dshm) replaces it.
    _, rj = _render(SEPARATE)
    for role, pod in _pods(rj).items():
        assert not [v for v in pod["spec"]["volumes"] if v["name"] == "rlkube-shm"], role
        assert not [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"], role


def test_pods_without_the_new_settings_are_rendered_as_before():
    _, rj = _render(SEPARATE)
    for role, pod in _pods(rj).items():
        for key in ("priorityClassName", "imagePullSecrets", "affinity"):
            assert key not in pod["spec"], (role, key)
        assert "annotations" not in pod["metadata"], role


def test_every_label_rlkube_puts_on_pods_is_one_the_spec_refuses_from_users():
    # The spec (rlkube_runtime.spec.resources) keeps users off these keys; this keeps the two lists in step.
    _, rj = _render(POD_KNOBS)
    user = {**POD_KNOBS["resources"]["podLabels"], **POD_KNOBS["resources"]["trainer"]["podLabels"]}
    for role, pod in _pods(rj).items():
        for key in pod["metadata"]["labels"]:
            if key not in user:
                assert key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABELS, (role, key)


def test_every_pod_gets_the_grace_period_the_runtime_needs_to_checkpoint_on_sigterm():
    def grace_periods(rayjob):
        cluster = rayjob["spec"]["rayClusterSpec"]
        pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        return {pod["spec"]["terminationGracePeriodSeconds"] for pod in pods}

    assert grace_periods(_render({})[1]) == {600}
    assert grace_periods(_render({"faultTolerance": {"terminationGracePeriodSeconds": 1800}})[1]) == {1800}


# --- authenticated job traffic ------------------------------------------------------------------


def test_ray_token_authentication_is_on_for_every_cluster():
    _, rj = _render(SEPARATE)
    cluster = rj["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["rayVersion"] == "2.52.0"  # KubeRay refuses token mode below Ray 2.52


def test_every_ray_container_gets_the_jobs_api_key_from_its_secret():
    _, rj = _render(SEPARATE)
    for role, pod in _pods(rj).items():
        if role == "submitter":
            continue  # submits the Ray job (Ray's token reaches it from KubeRay); it calls no engine
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": "RLKUBE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "tiny-api-key", "key": "api-key"}}} in env, role


def test_the_api_key_secret_and_network_policy_are_owned_by_the_rljob():
    body = make_body(SEPARATE)
    ref = render.JobRef.from_body(body)
    secret = render.render_api_key_secret(ref, "k3y")
    assert (secret["metadata"]["name"], secret["stringData"]) == ("tiny-api-key", {"api-key": "k3y"})
    policy = render.render_network_policy(ref, default_settings())
    for obj in (secret, policy):
        assert obj["metadata"]["ownerReferences"] == [render.owner_reference(ref)]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"rlkube.io/rljob": "tiny"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, metrics, dashboard = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"rlkube.io/rljob": "tiny"}}}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9464}]
    assert dashboard["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert metrics["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_secret_env_becomes_a_secret_key_ref_on_every_ray_container():
    spec = {"resources": {"secretEnv": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": "api-key"},
                                        {"name": "HF_TOKEN", "secretName": "hf", "key": "token", "optional": True}]}}
    _, rj = _render(spec)
    for role, pod in _pods(rj).items():
        if role == "submitter":
            continue
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}} in env
        assert {"name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}} in env


def test_no_ray_pod_gets_the_namespaces_services_as_environment():
    # A Service named rlkube-metrics (the chart's, released as "rlkube") would otherwise set
    # RLKUBE_METRICS_PORT=tcp://<ip>:8080 in every pod of its namespace.
    cluster = _render({})[1]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert {pod["spec"]["enableServiceLinks"] for pod in pods} == {False}


def test_every_ray_pod_gives_its_volumes_the_images_group():
    # The images run as IMAGE_UID (not root): without fsGroup a claim whose root belongs to root
    # would refuse its checkpoints.
    cluster = _render({})[1]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert {(pod["spec"]["securityContext"]["fsGroup"], pod["spec"]["securityContext"]["fsGroupChangePolicy"])
            for pod in pods} == {(IMAGE_UID, "OnRootMismatch")}

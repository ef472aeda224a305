"""The rlkube operator against a real control plane: kube-apiserver, etcd, controller-manager
(garbage collection), scheduler, kwok GPU nodes and the KubeRay operator.

The operator runs as a real process (`rlkube operator --standalone`); RLJobs go in with
`kubectl apply -f`. KubeRay turns each RayJob into a RayCluster whose pods kwok "runs" (kwok runs
no containers), then submits the Ray job with a submitter Job whose pod kwok completes at once.
Since no Ray job server exists, KubeRay can never learn the Ray job's state on its own: where a
test needs the Ray job to be RUNNING, SUCCEEDED or FAILED, it patches the RayJob's status
subresource the way KubeRay does after asking Ray's job server (the test is the stand-in for Ray's
job server, and says so where it does it). Everything else — the RayCluster, its pods, suspending,
shutting the cluster down after the job, failing a RayJob whose submitter finished without a
terminal Ray job (KubeRay's 30 s grace period), garbage collection — is the real components'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from harness import ControlPlane
from operator_fixtures import (
    CRD_DIR,
    OperatorProcess,
    apply_file,
    get_or_none,
    kubectl_json,
    patch_status,
    rfc3339_now,
    token_kubeconfig,
)
from rlkube_runtime.spec.load import parse_rljob
from rlkube_runtime.status_report import RLJobStatusReporter

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

CHILDREN = (("configmap", "{}-spec"), ("serviceaccount", "{}-runtime"), ("role", "{}-runtime"),
            ("rolebinding", "{}-runtime"))


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
HF_TOKEN_ENV = {"name": "HF_TOKEN", "secretName": "hf", "key": "token", "optional": True}


def rljob_yaml(name: str, *, placement: str = "colocated", **spec_extra) -> str:
    """A small RLJob: colocated on one 2-GPU trainer pod, or separate with a 4-GPU trainer pod and
    4 rollout GPUs (engines of 2). Restarts after 1 s, at most once."""
    resources = {
        "colocated": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2}},
        "separate": {
            "placement": "separate",
            "trainer": {"nodes": 1, "gpusPerNode": 4, "tolerations": [GPU_TOLERATION]},
            "rollout": {"gpus": 4},
            "secretEnv": [HF_TOKEN_ENV],
            "volumes": [{"name": "ckpt", "emptyDir": {}}],
            "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
        },
    }[placement]
    spec = {
        "model": {"preset": "tiny", "save": f"/ckpt/{name}", "load": f"/ckpt/{name}"},
        "data": {"promptData": "builtin:digit-successor"},
        "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2, "gpusPerEngine": 2},
        "reward": {"type": "exact"},
        "training": {"numRollout": 3},
        "faultTolerance": {"backoffSeconds": 1, "backoffLimit": 1},
        "resources": resources,
    }
    for key, value in spec_extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return yaml.safe_dump({"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
                           "spec": spec}, sort_keys=False)


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd_installed(control_plane: ControlPlane) -> ControlPlane:
    control_plane.kubectl("apply", "-f", str(CRD_DIR))

    def established():
        crd = kubectl_json(control_plane, "get", "crd", "rljobs.rlkube.io")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    control_plane.wait_for(established, 60, "the RLJob CRD to be Established")
    return control_plane


@pytest.fixture(scope="module")
def operator(crd_installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(crd_installed, log, env={"RLKUBE_RESYNC_SECONDS": "2"})
    proc.start()
    yield proc
    code = proc.stop()
    assert code in (0, None), f"operator exited with {code}:\n{proc.log_tail()}"
    assert "Traceback" not in proc.log_text(), proc.log_text()[-6000:]


_counter = iter(range(1000))


@pytest.fixture
def ns(crd_installed: ControlPlane):
    """A namespace of its own per test, deleted afterwards (with every RLJob in it), so jobs of
    earlier tests cannot act during later ones."""
    name = f"rlkube-op-{next(_counter)}"
    crd_installed.create_namespace(name)
    yield name
    crd_installed.kubectl("delete", "namespace", name, "--wait=false", check=False)


# --- helpers ---------------------------------------------------------------------------------------


def wait_rljob(cp: ControlPlane, ns: str, name: str, what: str, predicate, timeout: float = 60) -> dict:
    def check():
        obj = get_or_none(cp, ns, "rljob", name)
        return obj if obj is not None and predicate(obj) else None

    return cp.wait_for(check, timeout, f"RLJob {ns}/{name}: {what}")


def wait_phase(cp: ControlPlane, ns: str, name: str, phase: str, timeout: float = 60) -> dict:
    return wait_rljob(cp, ns, name, f"phase {phase}",
                      lambda o: (o.get("status") or {}).get("phase") == phase, timeout)


def wait_rayjob(cp: ControlPlane, ns: str, name: str, predicate=lambda rj: True, what: str = "exists",
                timeout: float = 60) -> dict:
    def check():
        obj = get_or_none(cp, ns, "rayjob", name)
        return obj if obj is not None and predicate(obj) else None

    return cp.wait_for(check, timeout, f"RayJob {ns}/{name} {what}")


def deployment_status(rj: dict) -> str:
    return (rj.get("status") or {}).get("jobDeploymentStatus", "")


def pods_of(cp: ControlPlane, ns: str, selector: str) -> list[dict]:
    return kubectl_json(cp, "-n", ns, "get", "pods", "-l", selector)["items"]


def cluster_running(cp: ControlPlane, ns: str, rljob: str, attempt: int, groups: int) -> list[dict]:
    """The attempt's head and worker pods once all are Running (kwok) on a node."""
    selector = f"rlkube.io/rljob={rljob},rlkube.io/attempt={attempt}"

    def check():
        pods = [p for p in pods_of(cp, ns, selector) if p["status"].get("phase") == "Running"
                and p["metadata"]["labels"].get("rlkube.io/role") != "submitter"]
        roles = {p["metadata"]["labels"].get("rlkube.io/role") for p in pods}
        return pods if len(roles) == groups + 1 else None

    try:
        return cp.wait_for(check, 90, f"head and {groups} worker group(s) of {rljob} attempt {attempt} Running")
    except Exception as exc:
        state = cp.kubectl("-n", ns, "get", "rljobs,rayjobs,rayclusters,jobs,pods", "-o", "wide", check=False).stdout
        raise AssertionError(f"{exc}\n{state}") from exc


def stand_in_ray_job_status(cp: ControlPlane, ns: str, rayjob: str, job_status: str, deployment: str | None = None,
                            **extra: str) -> None:
    """Stand-in for Ray's job server: report the Ray job's state on the RayJob the way KubeRay
    writes it after asking the job server (kwok runs no Ray, so KubeRay cannot ask)."""
    status = {"jobStatus": job_status, **extra}
    if deployment:
        status["jobDeploymentStatus"] = deployment
    if deployment in ("Complete", "Failed"):
        status["endTime"] = rfc3339_now()  # KubeRay sets it on terminal transitions; its TTL logic reads it
    patch_status(cp, ns, "rayjob", rayjob, status)


def rljob_events(cp: ControlPlane, ns: str, name: str) -> list[dict]:
    items = kubectl_json(cp, "-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")["items"]
    items.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [e for e in items if e["involvedObject"].get("kind") == "RLJob"]


def events_of(cp: ControlPlane, ns: str, name: str) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in rljob_events(cp, ns, name)]


def table(cp: ControlPlane, ns: str, *args: str) -> list[dict[str, str]]:
    """`kubectl get rljobs` rows as {column: cell}, cut at the header's column offsets (cells may be empty)."""
    lines = cp.kubectl("-n", ns, "get", "rljobs", *args).stdout.rstrip().splitlines()
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    bounds = list(zip(starts, starts[1:] + [None]))
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds)} for line in lines[1:]]


def owner_uid(obj: dict) -> str | None:
    refs = [r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")]
    return refs[0]["uid"] if refs else None


# --- tests -----------------------------------------------------------------------------------------


def test_an_rljob_breaking_the_batch_equation_is_refused_naming_the_field(crd_installed, ns, tmp_path):
    bad = rljob_yaml("bad", rollout={"batchSize": 5}, training={"globalBatchSize": 4})
    proc = apply_file(crd_installed, tmp_path / "bad.yaml", bad, ns)
    assert proc.returncode != 0
    assert "spec.training.globalBatchSize" in proc.stderr
    assert "rollout.batchSize(5) x nSamplesPerPrompt(2) = 10 but globalBatchSize(4) x numStepsPerRollout(1) = 4" in proc.stderr
    assert get_or_none(crd_installed, ns, "rljob", "bad") is None


def test_fields_a_running_job_depends_on_cannot_change_but_others_can(crd_installed, ns, tmp_path):
    """The CRD's transition rules (self == oldSelf) run in the API server on every update."""
    cp = crd_installed
    assert apply_file(cp, tmp_path / "job.yaml", rljob_yaml("fixed"), ns).returncode == 0
    for patch, field in [
        ({"rollout": {"batchSize": 8, "nSamplesPerPrompt": 2}, "training": {"globalBatchSize": 16}}, "spec.rollout.batchSize"),
        ({"model": {"preset": "tiny", "save": "/other"}}, "spec.model"),
        ({"resources": {"placement": "separate"}}, "spec.resources.placement"),
    ]:
        proc = cp.kubectl("-n", ns, "patch", "rljob", "fixed", "--type", "merge", "-p", json.dumps({"spec": patch}),
                          check=False)
        assert proc.returncode != 0, f"{field} changed"
        assert f"{field} cannot change while the RLJob exists" in proc.stderr, proc.stderr
    proc = cp.kubectl("-n", ns, "patch", "rljob", "fixed", "--type", "merge", "-p",
                      json.dumps({"spec": {"training": {"numRollout": 7}, "suspend": True}}), check=False)
    assert proc.returncode == 0, proc.stderr
    assert kubectl_json(cp, "-n", ns, "get", "rljob", "fixed")["spec"]["training"]["numRollout"] == 7


@pytest.mark.parametrize(
    ("name", "spec", "field"),
    [
        # 47 characters: its RayJob 'name-0' would pass KubeRay's 47-character limit.
        ("a-very-long-rljob-name-that-kuberay-cannot-take", {}, "metadata.name"),
        ("odd-gpus", {"rollout": {"gpusPerEngine": 2},
                      "resources": {"placement": "separate", "trainer": {"nodes": 1, "gpusPerNode": 2},
                                    "rollout": {"gpus": 3}}}, "spec.rollout.gpusPerEngine"),
        # Colocated engines run in the trainer's pods: a rollout pod setting would be read by nothing.
        ("coloc-rollout", {"resources": {"rollout": {"nodeSelector": {"pool": "rollout"}}}},
         "spec.resources.rollout.nodeSelector"),
        ("ref-no-kl", {"training": {"refUpdateInterval": 2}}, "spec.training.refUpdateInterval"),
        ("kwargs-no-template", {"data": {"chatTemplateKwargs": {"enable_thinking": False}}},
         "spec.data.chatTemplateKwargs"),
        ("multi-node-coloc", {"rollout": {"gpusPerEngine": 2, "nodesPerEngine": 2}}, "spec.rollout.nodesPerEngine"),
    ],
    ids=["name-too-long", "gpus-not-whole-engines", "rollout-pods-when-colocated", "ref-update-without-kl",
         "chat-template-kwargs-without-the-template", "engine-over-nodes-when-colocated"],
)
def test_the_api_server_refuses_a_spec_its_crd_rules_cover(operator, ns, tmp_path, name, spec, field):
    proc = apply_file(operator.cp, tmp_path / "bad.yaml", rljob_yaml(name, **spec), ns)
    assert proc.returncode != 0
    assert field in proc.stderr or field.removeprefix("spec.") in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("name", "spec", "field", "message"),
    [
        ("torch-tp", {"training": {"backend": "torch"}, "parallelism": {"tensor": 2}}, "spec.parallelism.tensor",
         "tensor(2) > 1 splits the model over GPUs, which the torch backend cannot do"),
        ("megatron-misfit", {"training": {"backend": "megatron"}, "parallelism": {"tensor": 4}}, "spec.parallelism",
         "tensor(4) x pipeline(1) = 4 GPUs per model replica must divide the trainer GPUs, "
         "resources.trainer.nodes(1) x gpusPerNode(2) = 2"),
        ("expert-misfit", {"training": {"backend": "megatron"}, "parallelism": {"expert": 4}}, "spec.parallelism.expert",
         "expert(4) x expertTensor(1) x pipeline(1) = 4 GPUs must divide the trainer GPUs, "
         "resources.trainer.nodes(1) x gpusPerNode(2) = 2"),
        ("torch-expert-tensor", {"training": {"backend": "torch"}, "parallelism": {"expertTensor": 2}},
         "spec.parallelism.expertTensor", "expertTensor(2) > 1 splits each expert over GPUs, which the torch backend "
         "cannot do"),
        ("fp8", {"model": {"rolloutDtype": "fp8"}, "algorithm": {"tis": {"enabled": True}},
                 "training": {"updateWeightsTransport": "disk"}}, "spec.training.updateWeightsTransport",
         "training.updateWeightsTransport disk writes the HF directory unquantized"),
        ("buffer", {"training": {"asyncBufferSize": 2}}, "spec.training.asyncBufferSize",
         "asyncBufferSize(2): only async mode (training.mode: async) generates ahead"),
        ("ppo", {"algorithm": {"advantageEstimator": "ppo"}}, "spec.algorithm.advantageEstimator",
         "ppo needs a critic (value) model"),
        ("mask", {"rollout": {"maskOffPolicyInPartialRollout": True}}, "spec.rollout.maskOffPolicyInPartialRollout",
         "maskOffPolicyInPartialRollout masks what partial rollout kept from an earlier rollout"),
        ("torch-replay", {"training": {"backend": "torch", "routingReplay": True}}, "spec.training.routingReplay",
         "routingReplay has the trainer's routers take the engine's experts, which the torch backend"),
        ("pipelined-replay", {"training": {"routingReplay": True}, "parallelism": {"pipeline": 2}},
         "spec.training.routingReplay", "routingReplay with parallelism.pipeline(2) > 1 is not built"),
        ("lora-megatron", {"training": {"backend": "megatron", "lora": {"rank": 8}}}, "spec.training.lora",
         "lora is trained by the torch backend (peft); megatron-core has no LoRA layers"),
        ("lora-transport", {"training": {"lora": {"rank": 8}, "updateWeightsTransport": "tensor"}},
         "spec.training.updateWeightsTransport", "with lora the weight sync sends the adapter as a directory"),
        ("lora-fp8", {"training": {"lora": {"rank": 8}}, "model": {"rolloutDtype": "fp8"},
                      "algorithm": {"tis": {"enabled": True}}}, "spec.training.lora",
         "lora with model.rolloutDtype fp8 is not built"),
    ],
    ids=["torch-tensor-parallel", "megatron-replica-too-big", "expert-parallel-too-big", "torch-expert-tensor", "fp8-rollouts-by-disk", "async-buffer-2-in-sync-mode", "ppo",
         "off-policy-mask-without-partial-rollout", "torch-routing-replay", "pipelined-routing-replay", "lora-on-megatron",
         "lora-over-the-tensor-transport", "lora-with-fp8-rollouts"],
)
def test_the_api_server_refuses_what_no_backend_honours(crd_installed, ns, tmp_path, name, spec, field, message):
    """The CRD's CEL rules for spec/backend_rules.py and the unimplemented fields, in the real API
    server: refused at `kubectl apply`, naming the field, with the numbers."""
    proc = apply_file(crd_installed, tmp_path / "bad.yaml", rljob_yaml(name, **spec), ns)
    assert proc.returncode != 0
    assert field in proc.stderr and message in proc.stderr, proc.stderr
    assert get_or_none(crd_installed, ns, "rljob", name) is None


@pytest.mark.parametrize(
    "spec",
    [
        {"data": {"promptData": "/data/p.json", "applyChatTemplate": True,
                  "chatTemplateKwargs": {"enable_thinking": False}}},
        {"training": {"numRollout": 3, "refUpdateInterval": 2}, "algorithm": {"useKlLoss": True, "klLossCoef": 0.01}},
        {"checkpoint": {"hfExportInterval": 2}},
        {"placement": "separate", "training": {"numRollout": 3, "mode": "async", "asyncBufferSize": 4}},
        {"rollout": {"partialRollout": True, "maskOffPolicyInPartialRollout": True}},
        {"parallelism": {"expert": 2}},
        {"parallelism": {"tensor": 2, "expert": 2, "expertTensor": 1, "sequenceParallel": True}},
        {"training": {"numRollout": 3, "routingReplay": True}, "parallelism": {"expert": 2}},
        {"training": {"numRollout": 3, "lora": {"rank": 16, "alpha": 32, "targetModules": ["q_proj", "lm_head"]}}},
        {"model": {"rolloutDtype": "fp8"}, "algorithm": {"tis": {"enabled": True}}},
    ],
    ids=["chat-template-kwargs", "ref-update-interval", "hf-export-interval", "async-buffer-4", "off-policy-mask",
         "expert-parallel-2", "whole-experts-beside-tensor-2", "routing-replay", "lora", "fp8-rollouts-into-sglang"],
)
def test_the_api_server_accepts_the_switches_the_runtime_honours(crd_installed, ns, spec):
    """Their CEL rules compile in the real API server and pass a spec that uses them (a rule the
    server cannot compile makes the whole CRD fail to install)."""
    proc = crd_installed.kubectl("-n", ns, "create", "--dry-run=server", "-f", "-",
                                 input=rljob_yaml("switches", **spec), check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("name", "spec", "field"),
    [
        # Valid to the CRD's schema, but no pod can be made of it: the operator refuses it.
        ("gpu-twice", {"resources": {"placement": "colocated", "trainer": {
            "nodes": 1, "gpusPerNode": 2, "resources": {"limits": {"nvidia.com/gpu": "2"}}}}},
         "spec.resources.trainer.resources.limits"),
        ("spec-volume", {"resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2},
                                       "volumes": [{"name": "rlkube-spec", "emptyDir": {}}]}},
         "spec.resources.volumes[0].name"),
        ("shm-twice", {"resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2},
                                     "sharedMemorySize": "8Gi", "volumes": [{"name": "dshm", "emptyDir": {}}],
                                     "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}},
         "spec.resources.sharedMemorySize"),
        # A label the operator selects pods by; the CRD cannot check map keys, the spec model does.
        ("own-label", {"resources": {"placement": "colocated", "trainer": {"nodes": 1, "gpusPerNode": 2},
                                     "podLabels": {"rlkube.io/role": "mine"}}},
         "spec.resources.podLabels"),
        # megatronArgs' values are untyped, which hides the map from CEL; the spec model refuses it.
        ("torch-megatron-args", {"training": {"backend": "torch"}, "model": {"megatronArgs": {"attention-dropout": 0.0}}},
         "spec.model.megatronArgs"),
        # So is a free-form affinity: a colocated job's rollout pods would never exist to take it.
        ("coloc-affinity", {"resources": {"rollout": {"affinity": {"nodeAffinity": {}}}}},
         "spec.resources.rollout.affinity"),
    ],
    ids=["gpu-resource-set-by-hand", "reserved-volume-name", "shm-mounted-twice", "reserved-pod-label",
         "megatron-args-with-torch", "rollout-affinity-when-colocated"],
)
def test_a_spec_that_cannot_become_pods_fails_at_once_naming_the_field(operator, ns, tmp_path, name, spec, field):
    """The API server takes it; the operator fails it before anything is created (phase Failed,
    reason InvalidSpec, kopf.PermanentError logged)."""
    cp = operator.cp
    proc = apply_file(cp, tmp_path / "bad.yaml", rljob_yaml(name, **spec), ns)
    assert proc.returncode == 0, proc.stderr
    rljob = wait_phase(cp, ns, name, "Failed", timeout=30)
    failed = {c["type"]: c for c in rljob["status"]["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith(f"{field}: ")
    assert ("Warning", "Failed") in events_of(cp, ns, name)
    assert kubectl_json(cp, "-n", ns, "get", "rayjobs")["items"] == []
    assert get_or_none(cp, ns, "configmap", f"{name}-spec") is None
    cp.wait_for(lambda: f"{ns}/{name} failed: {field}" in operator.log_text(), 10, "kopf to log the permanent error")


def test_a_colocated_rljob_runs_to_success_through_kuberay(operator, ns, tmp_path):
    cp = operator.cp
    assert apply_file(cp, tmp_path / "tiny.yaml", rljob_yaml("tiny"), ns).returncode == 0
    rljob = wait_rljob(cp, ns, "tiny", "status written", lambda o: (o.get("status") or {}).get("rayJobName"))
    uid = rljob["metadata"]["uid"]
    assert rljob["metadata"].get("finalizers") is None  # owner references do the cleanup

    rayjob = wait_rayjob(cp, ns, "tiny-0")
    assert owner_uid(rayjob) == uid
    assert rayjob["spec"]["entrypoint"] == "rlkube run /etc/rlkube/rljob.yaml"
    assert rayjob["spec"]["backoffLimit"] == 0
    for kind, pattern in CHILDREN:
        obj = get_or_none(cp, ns, kind, pattern.format("tiny"))
        assert obj is not None and owner_uid(obj) == uid, kind
    spec_file = get_or_none(cp, ns, "configmap", "tiny-spec")["data"]["rljob.yaml"]
    assert parse_rljob(yaml.safe_load(spec_file)).spec == parse_rljob(rljob).spec

    # KubeRay makes the cluster; kwok runs its pods on the GPU nodes.
    pods = cluster_running(cp, ns, "tiny", 0, groups=1)
    trainer = next(p for p in pods if p["metadata"]["labels"]["rlkube.io/role"] == "trainer")
    assert trainer["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert trainer["spec"]["serviceAccountName"] == "tiny-runtime"
    assert trainer["spec"]["nodeName"].startswith("kwok-node-")

    # KubeRay submits the job (deployment Running); Ray's state is unknown: Starting.
    wait_rayjob(cp, ns, "tiny-0", lambda rj: deployment_status(rj) == "Running", "deployment Running")
    rljob = wait_phase(cp, ns, "tiny", "Starting")
    assert rljob["status"]["rayClusterName"].startswith("tiny-0-")

    # Stand-in for Ray's job server: the job runs.
    stand_in_ray_job_status(cp, ns, "tiny-0", "RUNNING")
    rljob = wait_phase(cp, ns, "tiny", "Running")
    conditions = {c["type"]: c for c in rljob["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "True"
    assert rljob["status"]["observedGeneration"] == rljob["metadata"]["generation"]
    assert operator.metric("rlkube_operator_jobs", phase="Running") >= 1

    # The runtime's reporter (admin credentials here; the narrow role has its own test).
    reporter = RLJobStatusReporter.from_env(
        {"RLKUBE_RLJOB_NAME": "tiny", "RLKUBE_RLJOB_NAMESPACE": ns}, kubeconfig=str(cp.kubeconfig)
    )
    assert reporter.engine_restarts_so_far() == 0
    assert reporter.report(2, 3, last_checkpoint={"rollout": 1, "path": "/ckpt/tiny/rollout_1"},
                           metrics={"reward_mean": 0.5, "kl": 0.01}, engine_restarts=2)
    wait_rljob(cp, ns, "tiny", "progressText 2/3", lambda o: o["status"].get("progressText") == "2/3", 20)
    [row] = table(cp, ns)
    assert list(row) == ["NAME", "PHASE", "PROGRESS", "REWARD", "RESTARTS", "AGE"]
    assert [row[c] for c in ("NAME", "PHASE", "PROGRESS", "REWARD", "RESTARTS")] == ["tiny", "Running", "2/3", "0.5", "0"]
    [row] = table(cp, ns, "-o", "wide")
    assert list(row) == ["NAME", "PHASE", "PROGRESS", "REWARD", "RESTARTS", "AGE", "RAYJOB", "CHECKPOINT"]
    assert (row["RAYJOB"], row["CHECKPOINT"]) == ("tiny-0", "/ckpt/tiny/rollout_1")
    rljob = get_or_none(cp, ns, "rljob", "tiny")
    assert rljob["status"]["phase"] == "Running"  # the runtime's patch left the operator's fields alone
    assert rljob["status"]["restarts"] == {"job": 0, "preemptions": 0, "engine": 2}  # each side's counters, side by side
    assert reporter.engine_restarts_so_far() == 2  # where the next attempt's count starts

    # Stand-in for Ray's job server: the job succeeded. KubeRay then shuts the cluster down.
    cluster = rljob["status"]["rayClusterName"]
    stand_in_ray_job_status(cp, ns, "tiny-0", "SUCCEEDED", "Complete")
    rljob = wait_phase(cp, ns, "tiny", "Succeeded")
    conditions = {c["type"]: c for c in rljob["status"]["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Progressing"]["status"], conditions["Failed"]["status"]) == (
        "False", "False", "False")
    cp.wait_for(lambda: get_or_none(cp, ns, "raycluster", cluster) is None, 60, "KubeRay deletes the finished cluster")
    reasons = [r for _, r in events_of(cp, ns, "tiny")]
    for reason in ("Pending", "Starting", "Running", "Succeeded"):
        assert reason in reasons

    # ttlSecondsAfterFinished may be set after the fact; the operator then deletes the RLJob, and
    # the garbage collector everything it owned.
    cp.kubectl("-n", ns, "patch", "rljob", "tiny", "--type=merge", "-p", '{"spec":{"ttlSecondsAfterFinished":1}}')
    cp.wait_for(lambda: get_or_none(cp, ns, "rljob", "tiny") is None, 30, "the finished RLJob deleted after its TTL")
    cp.wait_for(lambda: get_or_none(cp, ns, "rayjob", "tiny-0") is None, 60, "its RayJob garbage-collected")


def test_a_separate_rljob_gets_trainer_and_rollout_pods(operator, ns, tmp_path):
    cp = operator.cp
    assert apply_file(cp, tmp_path / "sep.yaml", rljob_yaml("sep", placement="separate"), ns).returncode == 0
    pods = cluster_running(cp, ns, "sep", 0, groups=2)
    by_role = {p["metadata"]["labels"]["rlkube.io/role"]: p for p in pods}
    assert set(by_role) == {"head", "trainer", "rollout"}
    gpus = {role: p["spec"]["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            for role, p in by_role.items()}
    assert gpus == {"head": None, "trainer": "4", "rollout": "4"}
    assert GPU_TOLERATION in by_role["trainer"]["spec"]["tolerations"]
    for pod in by_role.values():
        container = pod["spec"]["containers"][0]
        # Without resources.sharedMemorySize, /dev/shm is KubeRay's: memory-backed, on every Ray pod.
        assert {"name": "shared-mem", "mountPath": "/dev/shm"} in [{k: m[k] for k in ("name", "mountPath")}
                                                                   for m in container["volumeMounts"]]
        assert {v["name"]: v for v in pod["spec"]["volumes"]}["shared-mem"]["emptyDir"]["medium"] == "Memory"
        assert {"name": "ckpt", "mountPath": "/ckpt"} in [{k: m[k] for k in ("name", "mountPath")}
                                                          for m in container["volumeMounts"]]
        assert any(e["name"] == "HF_TOKEN" and "secretKeyRef" in e.get("valueFrom", {}) for e in container["env"])
    rayjob = get_or_none(cp, ns, "rayjob", "sep-0")
    groups = {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert json.loads(groups["trainer"]["rayStartParams"]["resources"].strip("'")) == {"rlkube_trainer": 4}
    assert json.loads(groups["rollout"]["rayStartParams"]["resources"].strip("'")) == {"rlkube_rollout": 4}
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert json.loads(head["rayStartParams"]["resources"].strip("'")) == {"rlkube_router": 1}
    wait_phase(cp, ns, "sep", "Starting")


def test_suspend_deletes_the_pods_and_resume_brings_them_back(operator, ns, tmp_path):
    cp = operator.cp
    assert apply_file(cp, tmp_path / "sus.yaml", rljob_yaml("sus"), ns).returncode == 0
    cluster_running(cp, ns, "sus", 0, groups=1)

    cp.kubectl("-n", ns, "patch", "rljob", "sus", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_rayjob(cp, ns, "sus-0", lambda rj: rj["spec"].get("suspend") is True, "suspend: true")
    wait_rayjob(cp, ns, "sus-0", lambda rj: deployment_status(rj) == "Suspended", "Suspended by KubeRay")
    rljob = wait_phase(cp, ns, "sus", "Suspended")
    conditions = {c["type"]: c for c in rljob["status"]["conditions"]}
    assert conditions["Suspended"]["status"] == "True"
    cp.wait_for(lambda: not pods_of(cp, ns, "rlkube.io/rljob=sus"), 60, "the suspended job's pods are gone")

    cp.kubectl("-n", ns, "patch", "rljob", "sus", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_rayjob(cp, ns, "sus-0", lambda rj: rj["spec"].get("suspend") is False, "suspend: false")
    cluster_running(cp, ns, "sus", 0, groups=1)
    rljob = wait_rljob(cp, ns, "sus", "resumed", lambda o: o["status"]["phase"] in ("Starting", "Running"))
    assert {c["type"]: c for c in rljob["status"]["conditions"]}["Suspended"]["status"] == "False"
    assert get_or_none(cp, ns, "rayjob", "sus-1") is None  # a resume is not a restart
    assert ("Normal", "Suspended") in events_of(cp, ns, "sus")


def test_a_failed_attempt_is_restarted_then_the_backoff_limit_fails_the_job(operator, ns, tmp_path):
    cp = operator.cp
    restarts_before = operator.metric("rlkube_operator_job_restarts_total", reason="failure")
    assert apply_file(cp, tmp_path / "crash.yaml", rljob_yaml("crash"), ns).returncode == 0
    cluster_running(cp, ns, "crash", 0, groups=1)
    wait_rayjob(cp, ns, "crash-0", lambda rj: deployment_status(rj) == "Running", "deployment Running")

    # Stand-in for Ray's job server: the driver crashed.
    stand_in_ray_job_status(cp, ns, "crash-0", "FAILED", "Failed", reason="AppFailed",
                            message="trainer rank 0 exited with code 1")
    wait_rljob(cp, ns, "crash", "restarted", lambda o: (o.get("status") or {}).get("restarts", {}).get("job") == 1)
    wait_rayjob(cp, ns, "crash-1")
    cp.wait_for(lambda: get_or_none(cp, ns, "rayjob", "crash-0") is None, 60, "the failed attempt's RayJob deleted")
    [restarting] = [e for e in rljob_events(cp, ns, "crash") if e["reason"] == "Restarting"]
    assert restarting["type"] == "Warning"
    assert "RayJob crash-0 failed: AppFailed; trainer rank 0 exited with code 1; attempt 1 (restart 1 of 1)" in (
        restarting["message"])
    [row] = table(cp, ns)
    assert (row["RESTARTS"], row["REWARD"]) == ("1", "")
    assert operator.metric("rlkube_operator_job_restarts_total", reason="failure") == restarts_before + 1

    # Attempt 1 is failed by KubeRay itself: its submitter finished, the Ray job never reached a
    # terminal state (no Ray here), and after KubeRay's 30 s grace period the RayJob is Failed.
    cluster_running(cp, ns, "crash", 1, groups=1)
    rljob = wait_phase(cp, ns, "crash", "Failed", timeout=120)
    failed = {c["type"]: c for c in rljob["status"]["conditions"]}["Failed"]
    assert failed["status"] == "True"
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "JobDeploymentStatusTransitionGracePeriodExceeded" in rljob["status"]["message"]
    assert "backoffLimit(1) restarts used up" in rljob["status"]["message"]
    assert get_or_none(cp, ns, "rayjob", "crash-2") is None
    assert ("Warning", "Failed") in events_of(cp, ns, "crash")


def test_a_spec_the_runtime_refuses_at_start_fails_the_job_without_a_restart(operator, ns, tmp_path):
    """The API server and the operator take the spec; the runtime refuses it at start. The real
    `rlkube run`, with the head pod's environment and the job's runtime service account, writes
    status.invalidSpec and exits 2; once the attempt fails the job is Failed (InvalidSpec) and no
    restart is made, although faultTolerance allows one."""
    cp = operator.cp
    # A named architecture without hfCheckpoint: valid, but `rlkube run` has no weights to start from.
    spec = rljob_yaml("refused", model={"preset": "qwen3-4b"})
    assert apply_file(cp, tmp_path / "refused.yaml", spec, ns).returncode == 0
    cluster_running(cp, ns, "refused", 0, groups=1)
    rayjob = wait_rayjob(cp, ns, "refused-0", lambda rj: deployment_status(rj) == "Running", "deployment Running")
    cp.wait_for(lambda: get_or_none(cp, ns, "rolebinding", "refused-runtime"), 30, "RoleBinding refused-runtime")

    # The head pod's view: the spec file from the ConfigMap, the environment the operator rendered.
    spec_file = tmp_path / "rljob.yaml"
    spec_file.write_text(get_or_none(cp, ns, "configmap", "refused-spec")["data"]["rljob.yaml"])
    [head] = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    env = {**os.environ, **{e["name"]: e["value"] for e in head["env"] if "value" in e}}
    env["KUBECONFIG"] = str(token_kubeconfig(cp, ns, "refused-runtime", tmp_path / "sa.kubeconfig"))
    run = subprocess.run([sys.executable, "-m", "rlkube_runtime.cli", "run", str(spec_file), "--output-dir",
                          str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    refusal = get_or_none(cp, ns, "rljob", "refused")["status"]["invalidSpec"]
    assert refusal["attempt"] == 0
    assert refusal["message"].startswith("spec.model.preset: 'qwen3-4b' has no built-in weights")

    # Stand-in for Ray's job server: the driver exited 2.
    stand_in_ray_job_status(cp, ns, "refused-0", "FAILED", "Failed", reason="AppFailed",
                            message="Job entrypoint command failed with exit code 2")
    rljob = wait_phase(cp, ns, "refused", "Failed", timeout=60)
    failed = {c["type"]: c for c in rljob["status"]["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec"
    assert f"the runtime of attempt 0 (RayJob refused-0) refused the spec: {refusal['message']}" in failed["message"]
    time.sleep(4)  # two resyncs: a restart (backoffSeconds 1) would exist by now
    assert get_or_none(cp, ns, "rayjob", "refused-1") is None
    status = get_or_none(cp, ns, "rljob", "refused")["status"]
    assert (status["phase"], status["restarts"]["job"]) == ("Failed", 0)
    assert ("Warning", "Failed") in events_of(cp, ns, "refused")
    assert ("Warning", "Restarting") not in events_of(cp, ns, "refused")


def test_deleting_the_rljob_deletes_everything_it_made(operator, ns, tmp_path):
    cp = operator.cp
    assert apply_file(cp, tmp_path / "gone.yaml", rljob_yaml("gone"), ns).returncode == 0
    pods = cluster_running(cp, ns, "gone", 0, groups=1)
    cluster = pods[0]["metadata"]["labels"]["ray.io/cluster"]
    cp.kubectl("-n", ns, "delete", "rljob", "gone", "--wait=true", "--timeout=30s")

    def all_gone():
        left = [k for k, p in CHILDREN if get_or_none(cp, ns, k, p.format("gone")) is not None]
        if get_or_none(cp, ns, "rayjob", "gone-0") is not None:
            left.append("rayjob")
        if get_or_none(cp, ns, "raycluster", cluster) is not None:
            left.append("raycluster")
        if pods_of(cp, ns, "rlkube.io/rljob=gone"):
            left.append("pods")
        return not left

    cp.wait_for(all_gone, 90, "the garbage collector to delete the RLJob's RayJob, cluster, pods, ConfigMap and RBAC")


def test_restarting_the_operator_creates_nothing_twice(operator, ns, tmp_path):
    cp = operator.cp
    # No restarts for this job: KubeRay may fail the attempt during the test (its grace period),
    # and a legitimate restart would look like something created twice.
    keep = rljob_yaml("keep", faultTolerance={"enabled": False})
    assert apply_file(cp, tmp_path / "keep.yaml", keep, ns).returncode == 0
    cluster_running(cp, ns, "keep", 0, groups=1)

    def snapshot():
        objs = {f"{k}/{p.format('keep')}": get_or_none(cp, ns, k, p.format("keep")) for k, p in CHILDREN}
        for rj in kubectl_json(cp, "-n", ns, "get", "rayjobs", "-l", "rlkube.io/rljob=keep")["items"]:
            objs[f"rayjob/{rj['metadata']['name']}"] = rj
        return {key: obj["metadata"]["uid"] for key, obj in objs.items()}

    before = snapshot()
    assert operator.stop() == 0
    operator.start()
    # The new process lists every RLJob at start and reconciles it; give it a few resyncs.
    cp.wait_for(lambda: operator.metric("rlkube_operator_reconcile_total", result="ok") >= 3, 60,
                "the restarted operator to reconcile")
    time.sleep(3)
    assert snapshot() == before
    for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob"):
        assert operator.metric("rlkube_operator_objects_created_total", kind=kind) == 0, kind
    status = get_or_none(cp, ns, "rljob", "keep")["status"]
    assert (status["rayJobName"], status["restarts"]["job"]) == ("keep-0", 0)


def test_the_runtime_role_patches_its_own_rljob_status_and_nothing_else(operator, ns, tmp_path):
    cp = operator.cp
    for name in ("mine", "other"):
        assert apply_file(cp, tmp_path / f"{name}.yaml", rljob_yaml(name), ns).returncode == 0
    for name in ("mine", "other"):
        wait_rljob(cp, ns, name, "running attempt", lambda o: (o.get("status") or {}).get("rayJobName"))
    cp.wait_for(lambda: get_or_none(cp, ns, "rolebinding", "mine-runtime"), 30, "RoleBinding mine-runtime")
    kubeconfig = token_kubeconfig(cp, ns, "mine-runtime", tmp_path / "sa.kubeconfig")

    env = {"RLKUBE_RLJOB_NAME": "mine", "RLKUBE_RLJOB_NAMESPACE": ns}
    mine = RLJobStatusReporter.from_env(env, kubeconfig=str(kubeconfig))
    assert mine.report(1, 3, metrics={"reward_mean": 0.25}, engine_restarts=1)
    status = get_or_none(cp, ns, "rljob", "mine")["status"]
    assert status["progress"] == {"rollout": 1, "numRollout": 3}
    assert status["metrics"] == {"rewardMean": 0.25}
    assert mine.engine_restarts_so_far() == 1  # the role may read what it wrote

    other = RLJobStatusReporter.from_env({**env, "RLKUBE_RLJOB_NAME": "other"}, kubeconfig=str(kubeconfig))
    assert other.report(3, 3) is False  # forbidden: another RLJob
    assert (get_or_none(cp, ns, "rljob", "other").get("status") or {}).get("progress") is None

    def can_i(*args: str) -> str:
        return cp.kubectl("-n", ns, "auth", "can-i", *args, f"--as=system:serviceaccount:{ns}:mine-runtime",
                          check=False).stdout.strip()

    assert can_i("patch", "rljobs.rlkube.io/mine", "--subresource=status") == "yes"
    assert can_i("get", "rljobs.rlkube.io/mine", "--subresource=status") == "yes"
    assert can_i("patch", "rljobs.rlkube.io/other", "--subresource=status") == "no"
    assert can_i("patch", "rljobs.rlkube.io/mine") == "no"  # the spec
    assert can_i("delete", "rljobs.rlkube.io/mine") == "no"
    assert can_i("list", "rljobs.rlkube.io") == "no"
    assert can_i("get", "rayjobs.ray.io") == "no"
    assert can_i("get", "secrets") == "no"


def test_kopf_run_of_the_handlers_module_works_too(operator, ns, tmp_path, monkeypatch):
    """`kopf run -m rlkube_operator.handlers`, in-process through kopf's KopfRunner (the module's
    operator process is paused meanwhile, so only this one acts)."""
    from kopf.testing import KopfRunner

    cp = operator.cp
    assert operator.stop() == 0
    monkeypatch.setenv("KUBECONFIG", str(cp.kubeconfig))
    # kopf logs in through the kubernetes package, which read KUBECONFIG when this process imported it.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(cp.kubeconfig))
    try:
        with KopfRunner(["run", "-m", "rlkube_operator.handlers", "--standalone", "--namespace", ns],
                        timeout=60) as runner:
            assert apply_file(cp, tmp_path / "kr.yaml", rljob_yaml("kr"), ns).returncode == 0
            wait_rayjob(cp, ns, "kr-0")
            wait_phase(cp, ns, "kr", "Starting")
        assert runner.exit_code == 0, runner.output
        assert runner.exception is None
        assert "Traceback" not in runner.output
    finally:
        operator.start()


def test_operator_metrics_are_served(operator, ns, tmp_path):
    cp = operator.cp
    before = operator.metric("rlkube_operator_objects_created_total", kind="RayJob")
    assert apply_file(cp, tmp_path / "m.yaml", rljob_yaml("m"), ns).returncode == 0
    wait_phase(cp, ns, "m", "Starting")
    text = operator.metrics()
    for name in ("rlkube_operator_reconcile_total", "rlkube_operator_reconcile_errors_total",
                 "rlkube_operator_reconcile_duration_seconds_bucket", "rlkube_operator_jobs",
                 "rlkube_operator_job_restarts_total", "rlkube_operator_objects_created_total"):
        assert name in text
    assert operator.metric("rlkube_operator_reconcile_total", result="ok") > 0
    assert operator.metric("rlkube_operator_reconcile_duration_seconds_count") > 0
    assert operator.metric("rlkube_operator_objects_created_total", kind="RayJob") == before + 1
    assert operator.metric("rlkube_operator_jobs", phase="Starting") >= 1


# --- pod settings and Kueue ------------------------------------------------------------------------

AMD_NODE = "kwok-node-1"
PRIORITY_CLASS = "rlkube-test-high"


@pytest.fixture
def amd_gpus_and_a_priority_class(operator):
    """kwok-node-1 also offers 8 amd.com/gpu (as if an AMD device plugin ran there), and a
    PriorityClass exists; both removed afterwards."""
    cp = operator.cp
    extra = {"amd.com/gpu": "8"}
    cp.kubectl("patch", "node", AMD_NODE, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": {"capacity": extra, "allocatable": extra}}))
    cp.apply_yaml(yaml.safe_dump({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                  "metadata": {"name": PRIORITY_CLASS}, "value": 1000}))
    yield
    remove = [{"op": "remove", "path": f"/status/{part}/amd.com~1gpu"} for part in ("capacity", "allocatable")]
    cp.kubectl("patch", "node", AMD_NODE, "--subresource=status", "--type=json", "-p", json.dumps(remove), check=False)
    cp.kubectl("delete", "priorityclass", PRIORITY_CLASS, "--wait=false", check=False)


def test_pod_settings_reach_every_pod_kuberay_creates(operator, ns, tmp_path, amd_gpus_and_a_priority_class):
    """GPU resource name and affinity per group; pull secret, priority, /dev/shm, labels and
    annotations on every pod: the API server takes the RayJob, and KubeRay's pods carry them."""
    cp = operator.cp
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "type", "operator": "In", "values": ["kwok"]}]}]}}}
    resources = {
        "placement": "separate",
        "trainer": {"nodes": 1, "gpusPerNode": 4, "affinity": affinity, "podLabels": {"pool": "train"}},
        "rollout": {"gpus": 4, "gpuResourceName": "amd.com/gpu", "podAnnotations": {"example.com/engine": "sglang"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": PRIORITY_CLASS,
        "sharedMemorySize": "2Gi",
        "podLabels": {"team": "rl"},
        "podAnnotations": {"example.com/owner": "rl-team"},
    }
    assert apply_file(cp, tmp_path / "knobs.yaml", rljob_yaml("knobs", resources=resources), ns).returncode == 0
    pods = cluster_running(cp, ns, "knobs", 0, groups=2)
    by_role = {p["metadata"]["labels"]["rlkube.io/role"]: p for p in pods}

    def limits(pod):
        return pod["spec"]["containers"][0].get("resources", {}).get("limits", {})

    assert limits(by_role["trainer"]).get("nvidia.com/gpu") == "4"
    assert limits(by_role["rollout"]).get("amd.com/gpu") == "4" and "nvidia.com/gpu" not in limits(by_role["rollout"])
    assert not any(k.endswith("/gpu") for k in limits(by_role["head"]))
    assert by_role["rollout"]["spec"]["nodeName"] == AMD_NODE  # the only node with amd.com/gpu
    assert by_role["trainer"]["spec"]["affinity"] == affinity
    assert "affinity" not in by_role["head"]["spec"] and "affinity" not in by_role["rollout"]["spec"]
    assert by_role["trainer"]["metadata"]["labels"]["pool"] == "train"
    assert by_role["rollout"]["metadata"]["annotations"]["example.com/engine"] == "sglang"
    for role, pod in by_role.items():
        assert pod["metadata"]["labels"]["team"] == "rl", role
        assert pod["metadata"]["annotations"]["example.com/owner"] == "rl-team", role
        assert pod["spec"]["priorityClassName"] == PRIORITY_CLASS, role
        assert pod["spec"]["priority"] == 1000, role  # resolved by the API server's Priority admission
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}], role
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["rlkube-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}, role
        assert "shared-mem" not in volumes, role  # KubeRay adds its own /dev/shm only when none is mounted
        mounts = [(m["name"], m["mountPath"]) for m in pod["spec"]["containers"][0]["volumeMounts"]]
        assert ("rlkube-shm", "/dev/shm") in mounts, role

    # KubeRay's submitter pod (the Job that runs `ray job submit`) pulls and ranks the same way.
    def submitter():
        found = pods_of(cp, ns, "rlkube.io/rljob=knobs,rlkube.io/role=submitter")
        return found[0] if found else None

    pod = cp.wait_for(submitter, 60, "KubeRay's submitter pod")
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert (pod["spec"]["priorityClassName"], pod["spec"]["priority"]) == (PRIORITY_CLASS, 1000)
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["spec"]["containers"][0]["command"]  # KubeRay still wrote the submit command
    wait_phase(cp, ns, "knobs", "Starting")


def test_a_queued_rljob_leaves_suspend_to_kueue(operator, ns, tmp_path):
    """No Kueue runs here: the test admits the RayJob by hand, the way Kueue does (spec.suspend
    false on the RayJob), and checks the operator neither admits it early nor suspends it again."""
    cp = operator.cp
    assert apply_file(cp, tmp_path / "q.yaml", rljob_yaml("q", queueName="team-queue"), ns).returncode == 0
    rayjob = wait_rayjob(cp, ns, "q-0")
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    assert rayjob["spec"]["suspend"] is True
    wait_rayjob(cp, ns, "q-0", lambda rj: deployment_status(rj) == "Suspended", "Suspended by KubeRay")
    wait_phase(cp, ns, "q", "Queued")
    # The reconcile that created the RayJob says so ("created RayJob q-0 ..., suspended until Kueue
    # admits it"); the ones after it, finding it suspended, say what it waits for.
    waits = "waits for Kueue to admit it from LocalQueue team-queue"

    def queued_and_waiting():
        found = get_or_none(cp, ns, "rljob", "q")
        status = (found or {}).get("status") or {}
        return found if status.get("phase") == "Queued" and waits in status.get("message", "") else None

    rljob = cp.wait_for(queued_and_waiting, 30, f"the Queued RLJob's message: {waits}")
    conditions = {c["type"]: c for c in rljob["status"]["conditions"]}
    assert (conditions["Progressing"]["status"], conditions["Suspended"]["status"]) == ("True", "False")
    assert ("Normal", "Queued") in events_of(cp, ns, "q")

    def reconciles_pass(count: int = 3) -> None:
        start = operator.metric("rlkube_operator_reconcile_total", result="ok")
        cp.wait_for(lambda: operator.metric("rlkube_operator_reconcile_total", result="ok") >= start + count, 30,
                    f"{count} more reconciles")

    reconciles_pass()
    assert get_or_none(cp, ns, "rayjob", "q-0")["spec"]["suspend"] is True  # waits for Kueue, not the operator
    assert not pods_of(cp, ns, "rlkube.io/rljob=q")

    # Kueue admits the workload: it unsuspends the RayJob.
    cp.kubectl("-n", ns, "patch", "rayjob", "q-0", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    cluster_running(cp, ns, "q", 0, groups=1)
    wait_rljob(cp, ns, "q", "admitted", lambda o: o["status"]["phase"] in ("Starting", "Running"))
    reconciles_pass()
    assert get_or_none(cp, ns, "rayjob", "q-0")["spec"]["suspend"] is False  # not flipped back

    # spec.suspend with a queue deletes the RayJob (Kueue would unsuspend an admitted one) ...
    cp.kubectl("-n", ns, "patch", "rljob", "q", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    cp.wait_for(lambda: get_or_none(cp, ns, "rayjob", "q-0") is None, 60, "the queued RayJob deleted")
    wait_phase(cp, ns, "q", "Suspended")
    cp.wait_for(lambda: not pods_of(cp, ns, "rlkube.io/rljob=q"), 60, "the suspended job's pods are gone")
    # ... and resuming queues a new one, suspended until Kueue admits it.
    cp.kubectl("-n", ns, "patch", "rljob", "q", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    rayjob = wait_rayjob(cp, ns, "q-0")
    assert rayjob["spec"]["suspend"] is True
    rljob = wait_phase(cp, ns, "q", "Queued")
    assert rljob["status"]["restarts"]["job"] == 0  # a resume is not a restart

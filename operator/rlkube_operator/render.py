"""RLJob -> the Kubernetes objects that run it: a KubeRay RayJob per attempt, the ConfigMap holding
the spec the runtime reads, the ServiceAccount/Role/RoleBinding the runtime reports status with,
the job's API key (a Secret) and the NetworkPolicy that admits only the job's own pods.

Pure: dicts in, dicts out; no API calls. Every object carries an owner reference to the RLJob
(controller, blockOwnerDeletion), so the garbage collector deletes them with it.

RayJob layout (ray.io/v1, K8sJobMode):
- head: CPU only (`num-gpus: 0`), trainer image; runs the entrypoint `rlkube run /etc/rlkube/rljob.yaml`
  (the Ray job driver), so it mounts the spec and uses the runtime ServiceAccount.
- separate placement: worker group `trainer` (nodes pods x gpusPerNode GPUs, Ray resource
  `rlkube_trainer`) and worker group `rollout` (rollout.gpus split into pods of whole engines, or
  one pod per node of an engine over rollout.nodesPerEngine nodes; Ray resources `rlkube_rollout`
  and `rlkube_router`), so trainer ranks and engines land on their
  own pods by asking for those resources.
- colocated placement: one GPU worker group `trainer` carrying all three Ray resources; the trainer
  image also has SGLang.
- pod settings: each group's GPUs under its gpuResourceName, its affinity, nodeSelector,
  tolerations, labels and annotations; job-wide pull secrets, priority class, /dev/shm size, labels
  and annotations on every pod, KubeRay's job-submitter pod included when one of those is set.
- spec.queueName: the RayJob is created suspended, labelled for Kueue, which admits it by
  unsuspending it.
- every pod (head, workers, KubeRay's submitter) passes the `restricted` Pod Security Standard: a
  fixed non-root UID, no privilege escalation, no capabilities, seccomp RuntimeDefault, a read-only
  root filesystem with an emptyDir at /tmp as working directory and $HOME.
- job traffic is authenticated: Ray's own token authentication (the cluster's authOptions; KubeRay
  makes the token), and the job's API key (RLKUBE_API_KEY, from the Secret `<name>-api-key`) that
  the router and every engine require; the NetworkPolicy `<name>` admits only the job's own pods,
  Prometheus to the metrics port and KubeRay's operator to the Ray dashboard.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

import yaml
from rlkube_runtime.spec.contract import (  # what the runtime inside the pods expects
    API_KEY_SECRET_KEY,
    DRIVER_PID_FILE,
    ENTRYPOINT,
    ENV_API_KEY,
    ENV_ATTEMPT,
    ENV_DRIVER_PID_FILE,
    ENV_METRICS_PORT,
    ENV_RLJOB_NAME,
    ENV_RLJOB_NAMESPACE,
    MAX_NAME_LENGTH,
    METRICS_PORT,
    METRICS_PORT_NAME,
    MIN_RAY_VERSION,
    ROLLOUT_RESOURCE,
    ROUTER_RESOURCE,
    SPEC_FILE,
    SPEC_MOUNT_DIR,
    STOP_DRIVER_COMMAND,
    TRAINER_RESOURCE,
    WRITABLE_DIR,
)
from rlkube_runtime.spec import API_VERSION, KIND, RLJobSpec
from rlkube_runtime.spec.resources import RolloutResources, SecretEnvVar, TrainerResources

from .settings import OperatorSettings

RAY_API_VERSION = "ray.io/v1"
RAYJOB_KIND = "RayJob"

LABEL_RLJOB = "rlkube.io/rljob"
LABEL_ATTEMPT = "rlkube.io/attempt"
LABEL_ROLE = "rlkube.io/role"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rlkube-operator"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

SPEC_VOLUME = "rlkube-spec"
SHM_VOLUME = "rlkube-shm"
SHM_MOUNT_DIR = "/dev/shm"
TMP_VOLUME = "rlkube-tmp"
RESERVED_VOLUMES = (SPEC_VOLUME, SHM_VOLUME, TMP_VOLUME)
# Paths rlkube mounts in every container; a user volumeMount there would collide with them.
RESERVED_MOUNT_PATHS = (SPEC_MOUNT_DIR, WRITABLE_DIR)

# A rollout pod holds whole engines and at most this many GPUs (one node of the usual GPU servers).
MAX_GPUS_PER_ROLLOUT_POD = 8
# KubeRay refuses RayJob names over 47 characters (its RayCluster gets a 6-character suffix, and
# Services derived from that must stay DNS labels); `<name>-<attempt>` must fit.
MAX_RAYJOB_NAME_LENGTH = 47
MAX_RLJOB_NAME_LENGTH = MAX_NAME_LENGTH
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# KubeRay's own submitter container (GetDefaultSubmitterContainer in ray-operator/controllers/ray/
# common/job.go, v1.5): the head's image with these resources. rlkube renders the same container only
# when a job-wide pod setting (pull secrets, priority, labels, annotations) must reach that pod too.
SUBMITTER_CONTAINER = "ray-job-submitter"
SUBMITTER_RESOURCES = {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}}
RAY_DASHBOARD_PORT = 8265
RAY_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": RAY_DASHBOARD_PORT},
    {"name": "client", "containerPort": 10001},
    {"name": "metrics", "containerPort": 8080},
]
# KubeRay's readiness checks of a Ray container (initLivenessAndReadinessProbe in ray-operator/
# controllers/ray/common/pod.go, v1.5): every node's raylet through its dashboard agent, the head's
# GCS through its dashboard. KubeRay's own probe first looks 10 s after the container starts and then
# every 5 s, and a RayJob is submitted only once every pod of its cluster is Ready, so each attempt
# (every restart too) waited up to 15 s for a Ray that is up in a few. The same checks, first at 2 s
# and then every 2 s, with the same 50 s of failures tolerated once Ready; KubeRay keeps a probe
# the pod already has (and still adds its liveness probe).
RAY_AGENT_PORT = 52365
_HEALTH_CHECK = "wget --tries 1 -T {timeout} -q -O- http://localhost:{port}/{path} | grep success"
RAYLET_HEALTH = _HEALTH_CHECK.format(timeout=2, port=RAY_AGENT_PORT, path="api/local_raylet_healthz")
GCS_HEALTH = _HEALTH_CHECK.format(timeout=2, port=RAY_DASHBOARD_PORT, path="api/gcs_healthz")
READINESS_PERIOD_SECONDS = 2
READINESS_TOLERATED_SECONDS = 50


def ray_readiness_probe(head: bool) -> dict[str, Any]:
    checks = [RAYLET_HEALTH, GCS_HEALTH] if head else [RAYLET_HEALTH]
    return {
        "exec": {"command": ["bash", "-c", " && ".join(checks)]},
        "initialDelaySeconds": READINESS_PERIOD_SECONDS,
        "periodSeconds": READINESS_PERIOD_SECONDS,
        "timeoutSeconds": 5,
        "successThreshold": 1,
        "failureThreshold": READINESS_TOLERATED_SECONDS // READINESS_PERIOD_SECONDS,
    }


# The driver (the RayJob's entrypoint, on the head) serves the rlkube_* training series here; the
# chart's PodMonitor scrapes this port by name.
RUNTIME_METRICS_PORT = METRICS_PORT
RUNTIME_METRICS_PORT_NAME = METRICS_PORT_NAME


class RenderError(ValueError):
    """The spec cannot be turned into pods; `field` is the RLJob field path to fix."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        return type(self), (self.field, self.message)


@dataclass(frozen=True)
class JobRef:
    """The identity of an RLJob: what owner references and names are made from."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


# --- names -------------------------------------------------------------------------------------


def rayjob_name(rljob: str, attempt: int) -> str:
    """Attempt n of RLJob `tiny` runs as RayJob `tiny-n` (n = status.restarts.job)."""
    return f"{rljob}-{attempt}"


def attempt_of(rayjob: dict[str, Any]) -> int | None:
    """The attempt number a RayJob was created for (its rlkube.io/attempt label)."""
    raw = (rayjob.get("metadata", {}).get("labels") or {}).get(LABEL_ATTEMPT)
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def configmap_name(rljob: str) -> str:
    return f"{rljob}-spec"


def api_key_secret_name(rljob: str) -> str:
    return f"{rljob}-api-key"


def network_policy_name(rljob: str) -> str:
    return rljob


def runtime_account_name(rljob: str) -> str:
    """The ServiceAccount, Role and RoleBinding the runtime reports status with share this name."""
    return f"{rljob}-runtime"


def check_name(name: str) -> None:
    """Raise RenderError unless `<name>-<attempt>` makes a RayJob name KubeRay accepts."""
    if len(name) > MAX_RLJOB_NAME_LENGTH:
        raise RenderError(
            "metadata.name",
            f"{name!r} is {len(name)} characters; RLJob names must be at most {MAX_RLJOB_NAME_LENGTH} "
            f"(each attempt runs as RayJob '<name>-<attempt>', and KubeRay allows {MAX_RAYJOB_NAME_LENGTH})",
        )
    if not _DNS1035.match(name):
        raise RenderError(
            "metadata.name",
            f"{name!r} must start with a letter and hold only lowercase letters, digits and '-' "
            "(KubeRay requires RayJob and RayCluster names to be DNS-1035 labels)",
        )


# --- shared pieces -----------------------------------------------------------------------------


def owner_reference(ref: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(ref: JobRef, **extra: str) -> dict[str, str]:
    return {LABEL_RLJOB: ref.name, LABEL_MANAGED_BY: MANAGED_BY, **extra}


def _metadata(ref: JobRef, name: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels(ref, **extra_labels),
        "ownerReferences": [owner_reference(ref)],
    }


# --- ConfigMap and RBAC ------------------------------------------------------------------------


def spec_document(ref: JobRef, spec: dict[str, Any]) -> dict[str, Any]:
    """The RLJob file the runtime reads: the object's spec as stored (API-server defaults included)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": ref.name, "namespace": ref.namespace},
        "spec": copy.deepcopy(spec),
    }


def render_configmap(ref: JobRef, spec: dict[str, Any]) -> dict[str, Any]:
    text = yaml.safe_dump(spec_document(ref, spec), sort_keys=False, default_flow_style=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, configmap_name(ref.name)),
        "data": {SPEC_FILE: text},
    }


def configmap_spec(configmap: dict[str, Any]) -> dict[str, Any] | None:
    """The spec a ConfigMap made by render_configmap holds (None if it holds none)."""
    text = (configmap.get("data") or {}).get(SPEC_FILE)
    if not text:
        return None
    doc = yaml.safe_load(text)
    return doc.get("spec") if isinstance(doc, dict) else None


def render_service_account(ref: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(ref, runtime_account_name(ref.name)),
    }


def render_role(ref: JobRef) -> dict[str, Any]:
    """get/patch on this one RLJob's status subresource, nothing else: the runtime reports
    progress, lastCheckpoint and metrics there and can touch no other object."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(ref, runtime_account_name(ref.name)),
        "rules": [
            {
                "apiGroups": [API_VERSION.split("/")[0]],
                "resources": ["rljobs/status"],
                "resourceNames": [ref.name],
                "verbs": ["get", "patch"],
            }
        ],
    }


def render_role_binding(ref: JobRef) -> dict[str, Any]:
    name = runtime_account_name(ref.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(ref, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ref.namespace}],
    }


# --- the job's API key and its NetworkPolicy ------------------------------------------------------


def render_api_key_secret(ref: JobRef, key: str) -> dict[str, Any]:
    """The job's API key (`key`, fresh random text from the controller), which the router and every
    engine require and the runtime sends. Created with each attempt's RayJob; one that exists is
    kept (the operator may create Secrets but never read them)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ref, api_key_secret_name(ref.name)),
        "type": "Opaque",
        "stringData": {API_KEY_SECRET_KEY: key},
    }


def render_network_policy(ref: JobRef, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the job's pods from its own pods only (any port: Ray, NCCL, the engines and router),
    plus the metrics port from Prometheus and the Ray dashboard from KubeRay's operator (it submits
    the Ray job and follows it there). Egress is left open (model hubs, trackers). Enforced only
    where the cluster's network plugin enforces NetworkPolicies."""
    own = {"matchLabels": {LABEL_RLJOB: ref.name}}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": copy.deepcopy(own)}]}]
    for peers, port in ((settings.metrics_from, RUNTIME_METRICS_PORT), (settings.dashboard_from, RAY_DASHBOARD_PORT)):
        if peers:
            ingress.append({"from": copy.deepcopy(list(peers)), "ports": [{"protocol": "TCP", "port": port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(ref, network_policy_name(ref.name)),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": ingress},
    }


# --- RayJob ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerGroup:
    """One Ray worker group: `replicas` pods of `gpus_per_pod` GPUs each, set up by `pods` (the
    group's spec section: resources, GPU resource name, placement, labels)."""

    name: str
    replicas: int
    gpus_per_pod: int
    image: str
    ray_resources: dict[str, int]
    pods: TrainerResources | RolloutResources


def worker_groups(spec: RLJobSpec, settings: OperatorSettings) -> list[WorkerGroup]:
    """The worker groups of the RayJob's cluster: `trainer` (and `rollout` when separate)."""
    res = spec.resources
    trainer = res.trainer
    gpe = spec.rollout.gpus_per_engine
    trainer_image = trainer.image or settings.trainer_image
    trainer_units = max(trainer.gpus_per_node, 1)

    def trainer_group(ray_resources: dict[str, int]) -> WorkerGroup:
        return WorkerGroup(
            name="trainer",
            replicas=trainer.nodes,
            gpus_per_pod=trainer.gpus_per_node,
            image=trainer_image,
            ray_resources=ray_resources,
            pods=trainer,
        )

    if res.placement == "colocated":
        total = trainer.nodes * trainer.gpus_per_node
        if trainer.gpus_per_node and trainer.gpus_per_node % gpe:
            raise RenderError(
                "spec.rollout.gpusPerEngine",
                f"colocated engines share the trainer's GPUs, so gpusPerEngine({gpe}) must divide "
                f"resources.trainer.gpusPerNode({trainer.gpus_per_node}); {total} GPUs in all",
            )
        # One group carries trainer ranks, engines and the router alike.
        return [trainer_group({TRAINER_RESOURCE: trainer_units, ROLLOUT_RESOURCE: trainer_units, ROUTER_RESOURCE: 1})]
    rollout = res.rollout
    replicas, per_pod = rollout_pods(rollout.gpus, gpe, spec.rollout.nodes_per_engine)
    return [
        trainer_group({TRAINER_RESOURCE: trainer_units}),
        WorkerGroup(
            name="rollout",
            replicas=replicas,
            gpus_per_pod=per_pod,
            image=rollout.image or trainer.image or settings.rollout_image,
            ray_resources={ROLLOUT_RESOURCE: max(per_pod, 1)},
            pods=rollout,
        ),
    ]


def rollout_pods(gpus: int, gpus_per_engine: int, nodes_per_engine: int = 1) -> tuple[int, int]:
    """(pods, GPUs per pod) for `gpus` rollout GPUs: the fewest pods of whole engines, each of at
    most MAX_GPUS_PER_ROLLOUT_POD GPUs; an engine over `nodes_per_engine` nodes has a pod per node,
    each of gpus_per_engine / nodes_per_engine GPUs. No GPUs: one CPU pod (the built-in engine runs on CPU)."""
    if gpus == 0:
        return 1, 0
    if gpus % gpus_per_engine:
        raise RenderError(
            "spec.rollout.gpusPerEngine",
            f"resources.rollout.gpus({gpus}) cannot be split into engines of gpusPerEngine({gpus_per_engine}) "
            "GPUs; make rollout.gpus a multiple of gpusPerEngine",
        )
    if nodes_per_engine > 1:
        per_node = gpus_per_engine // nodes_per_engine
        if per_node > MAX_GPUS_PER_ROLLOUT_POD:
            raise RenderError(
                "spec.rollout.nodesPerEngine",
                f"engines of gpusPerEngine({gpus_per_engine}) GPUs over nodesPerEngine({nodes_per_engine}) nodes "
                f"need {per_node} GPUs per pod, more than a rollout pod holds ({MAX_GPUS_PER_ROLLOUT_POD}); "
                "raise nodesPerEngine",
            )
        return gpus // per_node, per_node
    if gpus_per_engine > MAX_GPUS_PER_ROLLOUT_POD:
        raise RenderError(
            "spec.rollout.gpusPerEngine",
            f"engines of {gpus_per_engine} GPUs span several pods (a rollout pod holds at most "
            f"{MAX_GPUS_PER_ROLLOUT_POD} GPUs): set rollout.nodesPerEngine to the pods each engine spans",
        )
    per_pod = max(
        d for d in range(gpus_per_engine, MAX_GPUS_PER_ROLLOUT_POD + 1, gpus_per_engine) if gpus % d == 0
    )
    return gpus // per_pod, per_pod


def ray_resources_param(resources: dict[str, int]) -> str:
    """rayStartParams.resources: single-quoted JSON, the form KubeRay itself writes."""
    return "'" + json.dumps(resources, sort_keys=True, separators=(",", ":")) + "'"


def render_rayjob(
    ref: JobRef,
    spec: RLJobSpec,
    *,
    attempt: int,
    settings: OperatorSettings,
    active_deadline_seconds: int | None = None,
) -> dict[str, Any]:
    """The RayJob of attempt `attempt`.

    `active_deadline_seconds` is what is left of spec.activeDeadlineSeconds for this attempt (the
    deadline covers the whole job, restarts included). KubeRay's own retries are off
    (backoffLimit 0): the operator restarts failed attempts itself, resuming from a checkpoint.
    With spec.queueName the RayJob starts suspended: Kueue admits it by unsuspending it.
    """
    check_name(ref.name)
    check_volumes(spec)
    groups = worker_groups(spec, settings)
    name = rayjob_name(ref.name, attempt)
    extra = {KUEUE_QUEUE_LABEL: spec.queue_name} if spec.queue_name else {}
    head_image = spec.resources.trainer.image or settings.trainer_image
    job_spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        "backoffLimit": 0,
        "shutdownAfterJobFinishes": True,
        # The Ray cluster goes as soon as the job ends: idle GPUs help no one. The RLJob's own
        # ttlSecondsAfterFinished (deleting the RLJob and everything it owns) is the operator's.
        "ttlSecondsAfterFinished": 0,
        "suspend": spec.suspend or bool(spec.queue_name),
        "rayClusterSpec": {
            # Ray's token authentication: KubeRay makes the token (a Secret named after the cluster)
            # and gives it to every Ray container, the submitter and its own dashboard client, so
            # nothing outside the job may use Ray's GCS, dashboard or job API.
            "rayVersion": MIN_RAY_VERSION,
            "authOptions": {"mode": "token"},
            "headGroupSpec": _head_group(ref, spec, attempt, head_image, settings),
            "workerGroupSpecs": [_worker_group(ref, spec, attempt, g, settings) for g in groups],
        },
        "submitterPodTemplate": _submitter_template(ref, spec, attempt, head_image, settings),
    }
    if active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = max(1, int(active_deadline_seconds))
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": RAYJOB_KIND,
        "metadata": _metadata(ref, name, **{LABEL_ATTEMPT: str(attempt)}, **extra),
        "spec": job_spec,
    }


def check_volumes(spec: RLJobSpec) -> None:
    """Raise RenderError for user volumes that collide with the ones rlkube adds to every pod."""
    res = spec.resources
    for i, volume in enumerate(res.volumes):
        if volume.get("name") in RESERVED_VOLUMES:
            raise RenderError(
                f"spec.resources.volumes[{i}].name",
                f"{volume.get('name')!r} is reserved for rlkube's own volumes ({', '.join(RESERVED_VOLUMES)}); "
                "pick another volume name",
            )
    for i, mount in enumerate(res.volume_mounts):
        if str(mount.get("mountPath", "")).rstrip("/") in RESERVED_MOUNT_PATHS:
            raise RenderError(
                f"spec.resources.volumeMounts[{i}].mountPath",
                f"{mount.get('mountPath')!r} is where rlkube mounts the job's spec file and its writable /tmp "
                f"({', '.join(RESERVED_MOUNT_PATHS)}); mount the volume elsewhere",
            )
    if res.shared_memory_size is None:
        return
    for i, mount in enumerate(res.volume_mounts):
        if str(mount.get("mountPath", "")).rstrip("/") == SHM_MOUNT_DIR:
            raise RenderError(
                "spec.resources.sharedMemorySize",
                f"sharedMemorySize({res.shared_memory_size}) mounts {SHM_MOUNT_DIR}, and so does "
                f"resources.volumeMounts[{i}] ({mount.get('name')!r}); keep one of the two",
            )


def _head_group(ref: JobRef, spec: RLJobSpec, attempt: int, image: str, settings: OperatorSettings) -> dict[str, Any]:
    trainer = spec.resources.trainer
    container = _container(
        ref, spec, attempt, name="ray-head", image=image, resources=copy.deepcopy(spec.resources.head.resources), role="head",
        settings=settings,
    )
    container["ports"] = copy.deepcopy(RAY_PORTS) + [
        {"name": RUNTIME_METRICS_PORT_NAME, "containerPort": RUNTIME_METRICS_PORT}
    ]
    container["env"] += [{"name": ENV_METRICS_PORT, "value": str(RUNTIME_METRICS_PORT)},
                         {"name": ENV_DRIVER_PID_FILE, "value": DRIVER_PID_FILE}]
    # SIGTERM must reach the driver before Ray stops under it (spec/contract.py: ENV_DRIVER_PID_FILE);
    # the pod's grace period bounds the wait.
    container["lifecycle"] = {"preStop": {"exec": {"command": list(STOP_DRIVER_COMMAND)}}}
    container["readinessProbe"] = ray_readiness_probe(head=True)
    # The head runs no GPU work; it takes the trainer's tolerations so it can share tainted GPU
    # nodes when those are all there is, but not its nodeSelector or affinity (it needs no GPU node).
    pod = _pod_spec(ref, spec, container, settings, node_selector={}, tolerations=trainer.tolerations, affinity={})
    params = {"num-gpus": "0"}
    if spec.resources.placement != "colocated":
        # Separate: the rollout manager and its router live on the head, which the job cannot lose
        # without losing its driver too, so a lost rollout pod costs only its engines (restarted on
        # the pod KubeRay makes in its place), not the attempt.
        params["resources"] = ray_resources_param({ROUTER_RESOURCE: 1})
    return {
        "rayStartParams": params,
        "template": {"metadata": _template_metadata(ref, spec, attempt, "head"), "spec": pod},
    }


def _worker_group(
    ref: JobRef, spec: RLJobSpec, attempt: int, group: WorkerGroup, settings: OperatorSettings
) -> dict[str, Any]:
    pods = group.pods
    field = f"spec.resources.{group.name}.resources"
    resources = _with_gpus(pods.resources, group.gpus_per_pod, pods.gpu_resource_name, field)
    container = _container(ref, spec, attempt, name="ray-worker", image=group.image, resources=resources,
                           role=group.name, settings=settings)
    container["readinessProbe"] = ray_readiness_probe(head=False)
    pod = _pod_spec(
        ref, spec, container, settings, node_selector=pods.node_selector, tolerations=pods.tolerations,
        affinity=pods.affinity,
    )
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,
        "rayStartParams": {
            "num-gpus": str(group.gpus_per_pod),
            "resources": ray_resources_param(group.ray_resources),
        },
        "template": {"metadata": _template_metadata(ref, spec, attempt, group.name, pods), "spec": pod},
    }


def _submitter_template(
    ref: JobRef, spec: RLJobSpec, attempt: int, image: str, settings: OperatorSettings
) -> dict[str, Any]:
    """KubeRay's default submitter pod with the job's pod security and the job-wide pod settings.
    KubeRay's own has no securityContext, which a namespace enforcing the restricted Pod Security
    Standard refuses; and without the settings a private image could not be pulled for the
    submitter, and it would escape the job's priority and labels."""
    container = {
        "name": SUBMITTER_CONTAINER,
        "image": image,
        "resources": copy.deepcopy(SUBMITTER_RESOURCES),
        "env": [{"name": "HOME", "value": WRITABLE_DIR}],
        "workingDir": WRITABLE_DIR,
        "volumeMounts": [{"name": TMP_VOLUME, "mountPath": WRITABLE_DIR}],
        "securityContext": container_security_context(settings),
    }
    pod = {
        "restartPolicy": "Never",
        "securityContext": pod_security_context(settings),
        "containers": [container],
        "volumes": [{"name": TMP_VOLUME, "emptyDir": {}}],
        **_job_pod_settings(spec),
    }
    return {"metadata": _template_metadata(ref, spec, attempt, "submitter"), "spec": pod}


def pod_security_context(settings: OperatorSettings) -> dict[str, Any]:
    """The pod-level half of the restricted Pod Security Standard: a fixed non-root UID and GID
    (volumes group-owned by it, so a PVC is writable), seccomp RuntimeDefault."""
    uid = settings.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        # Only a volume whose root is not yet the job's group is chowned (a large PVC is not walked each start).
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(settings: OperatorSettings) -> dict[str, Any]:
    """The container-level half: no privilege, no escalation, every capability dropped, the root
    filesystem read-only (the process writes to /tmp and the volumes). GPUs come from the device
    plugin and /dev/shm from a memory emptyDir, neither of which needs a privilege. KubeRay copies
    this into the init container it adds to worker pods."""
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": settings.read_only_root_filesystem,
        "runAsNonRoot": True,
    }


def _template_metadata(
    ref: JobRef, spec: RLJobSpec, attempt: int, role: str, group: TrainerResources | RolloutResources | None = None
) -> dict[str, Any]:
    """Pod labels and annotations: job-wide, then the group's, then rlkube's own (the spec refuses
    user keys that would replace rlkube's)."""
    res = spec.resources
    group_labels = group.pod_labels if group else {}
    group_annotations = group.pod_annotations if group else {}
    meta: dict[str, Any] = {
        "labels": {**res.pod_labels, **group_labels, **labels(ref, **{LABEL_ATTEMPT: str(attempt), LABEL_ROLE: role})},
    }
    annotations = {**res.pod_annotations, **group_annotations}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _with_gpus(resources: dict[str, Any], gpus: int, gpu_resource: str, field: str) -> dict[str, Any]:
    out = copy.deepcopy(resources) if resources else {}
    for section in ("requests", "limits"):
        if gpu_resource in (out.get(section) or {}):
            raise RenderError(
                f"{field}.{section}",
                f"{gpu_resource} is set from the GPU count (gpusPerNode / rollout.gpus) under gpuResourceName; "
                "remove it here",
            )
    if gpus:
        out.setdefault("limits", {})[gpu_resource] = str(gpus)
        if "requests" in out:
            out["requests"][gpu_resource] = str(gpus)
    return out


def _container(
    ref: JobRef, spec: RLJobSpec, attempt: int, *, name: str, image: str, resources: dict[str, Any], role: str,
    settings: OperatorSettings,
) -> dict[str, Any]:
    env = [
        {"name": ENV_RLJOB_NAME, "value": ref.name},
        {"name": ENV_RLJOB_NAMESPACE, "value": ref.namespace},
        {"name": ENV_ATTEMPT, "value": str(attempt)},
        {"name": "RLKUBE_ROLE", "value": role},
        {"name": ENV_API_KEY, "valueFrom": {"secretKeyRef": {"name": api_key_secret_name(ref.name),
                                                              "key": API_KEY_SECRET_KEY}}},
        # Caches (Hugging Face, Triton, torch) go under $HOME; the root filesystem is read-only.
        {"name": "HOME", "value": WRITABLE_DIR},
    ]
    env += copy.deepcopy(spec.resources.env)
    env += [secret_env_var(var) for var in spec.resources.secret_env]
    mounts = [
        {"name": SPEC_VOLUME, "mountPath": SPEC_MOUNT_DIR, "readOnly": True},
        {"name": TMP_VOLUME, "mountPath": WRITABLE_DIR},
    ]
    if spec.resources.shared_memory_size is not None:
        # KubeRay adds its own /dev/shm only where none is mounted yet, so this one replaces it.
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_MOUNT_DIR})
    mounts += copy.deepcopy(spec.resources.volume_mounts)
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # The driver writes its output under the working directory when spec.model.save is unset.
        "workingDir": WRITABLE_DIR,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": container_security_context(settings),
    }
    if resources:
        container["resources"] = resources
    return container


def secret_env_var(var: SecretEnvVar) -> dict[str, Any]:
    """One of spec.resources.secretEnv as the container's EnvVar (the admission policy has checked
    that the RLJob's author may read the Secret)."""
    ref = {"name": var.secret_name, "key": var.key}
    if var.optional:
        ref["optional"] = True
    return {"name": var.name, "valueFrom": {"secretKeyRef": ref}}


def _pod_spec(
    ref: JobRef,
    spec: RLJobSpec,
    container: dict[str, Any],
    settings: OperatorSettings,
    *,
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    affinity: dict[str, Any],
) -> dict[str, Any]:
    volumes = [
        {"name": SPEC_VOLUME, "configMap": {"name": configmap_name(ref.name)}},
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    shm_size = spec.resources.shared_memory_size
    if shm_size is not None:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
    volumes += copy.deepcopy(spec.resources.volumes)
    pod: dict[str, Any] = {
        "serviceAccountName": runtime_account_name(ref.name),
        "securityContext": pod_security_context(settings),
        "containers": [container],
        "volumes": volumes,
        # On SIGTERM the runtime saves a checkpoint of everything trained before it exits.
        "terminationGracePeriodSeconds": spec.fault_tolerance.termination_grace_period_seconds,
        # No <SERVICE>_PORT variables from the namespace's Services: a Service named rlkube-metrics
        # (the chart's, released as "rlkube") would set RLKUBE_METRICS_PORT=tcp://... in the pods.
        "enableServiceLinks": False,
        **_job_pod_settings(spec),
    }
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = copy.deepcopy(tolerations)
    if affinity:
        pod["affinity"] = copy.deepcopy(affinity)
    return pod


def _job_pod_settings(spec: RLJobSpec) -> dict[str, Any]:
    """imagePullSecrets and priorityClassName: the same on every pod of the job."""
    res = spec.resources
    out: dict[str, Any] = {}
    if res.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": secret.name} for secret in res.image_pull_secrets]
    if res.priority_class_name:
        out["priorityClassName"] = res.priority_class_name
    return out

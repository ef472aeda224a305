"""The hostile-spec corpus: RLJobs a careless or hostile author might write, each of which must be
refused, by `rlkube validate` and by the API server (the chart's admission policy, the CRD's rules or
strict field validation), with the field named.

Each case is a change to one small valid RLJob (`base_rljob`), the field path the refusal must name,
and a fragment of `rlkube validate`'s message. The corpus's namespace has tests/security/values.yaml's
policy: Secret `shared-hf-token` allowed, images only from registry.example.com/rl/."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

CORPUS_NAMESPACE = "rlkube-sec-corpus"
ALLOWED_IMAGE = "registry.example.com/rl/trainer:1"


def base_rljob(name: str, namespace: str = CORPUS_NAMESPACE) -> dict[str, Any]:
    """A small colocated job on the built-in tiny model that every check accepts."""
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"promptData": "builtin:digit-successor"},
            "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2},
            "reward": {"type": "exact"},
            "training": {"numRollout": 3},
            "resources": {"placement": "colocated", "trainer": {"gpusPerNode": 2, "image": ALLOWED_IMAGE}},
        },
    }


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in change.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class Hostile:
    id: str
    change: dict[str, Any]  # merged into spec
    field: str  # the path both refusals name
    message: str  # a fragment of rlkube validate's message
    why: str = ""
    server_message: str = ""  # a fragment of the API server's message, when it words it apart

    def rljob(self) -> dict[str, Any]:
        doc = base_rljob(self.id)
        doc["spec"] = merged(doc["spec"], self.change)
        return doc


def res(**resources: Any) -> dict[str, Any]:
    return {"resources": resources}


PVC = {"name": "data", "persistentVolumeClaim": {"claimName": "rl-data"}}
UNKNOWN = "unknown field"

HOSTILE: list[Hostile] = [
    # The host, through volumes.
    Hostile("hostpath-root", res(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
            "spec.resources.volumes[0].hostPath", "hostPath volumes are not allowed", "the node's files"),
    Hostile("hostpath-containerd-socket", res(volumes=[PVC, {"name": "sock", "hostPath": {
        "path": "/run/containerd/containerd.sock", "type": "Socket"}}]),
            "spec.resources.volumes[1].hostPath", "hostPath volumes are not allowed", "the container runtime"),
    Hostile("nfs-without-allowance", res(volumes=[{"name": "nas", "nfs": {"server": "nas", "path": "/"}}]),
            "spec.resources.volumes[0].nfs", "nfs volumes are not allowed", "a share the namespace was not given"),
    Hostile("csi-secrets-store", res(volumes=[{"name": "vault", "csi": {
        "driver": "secrets-store.csi.k8s.io", "volumeAttributes": {"secretProviderClass": "prod"}}}]),
            "spec.resources.volumes[0].csi", "csi volumes are not allowed", "a secrets store driver"),
    Hostile("iscsi-disk", res(volumes=[{"name": "disk", "iscsi": {"targetPortal": "10.0.0.1:3260", "iqn": "x",
                                                                 "lun": 0}}]),
            "spec.resources.volumes[0].iscsi", "iscsi volumes are not allowed", "someone's block device"),
    # Secrets and tokens the author may not have.
    Hostile("secret-volume-of-another-team", res(volumes=[{"name": "s", "secret": {"secretName": "team-b-db"}}]),
            "spec.resources.volumes[0].secret.secretName", "Secret 'team-b-db' may not be read through a secret volume",
            "another team's Secret"),
    Hostile("projected-service-account-token", res(volumes=[{"name": "tok", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "audience": "vault"}}]}}]),
            "spec.resources.volumes[0].projected", "projected volumes are not allowed", "a token for another audience"),
    Hostile("projected-secret", res(volumes=[{"name": "p", "projected": {"sources": [
        {"secret": {"name": "team-b-db"}}]}}]),
            "spec.resources.volumes[0].projected", "projected volumes are not allowed", "a Secret, projected"),
    Hostile("env-secret-key-ref", res(env=[{"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": "team-b-db", "key": "password"}}}]),
            "spec.resources.env[0].valueFrom.secretKeyRef.name",
            "Secret 'team-b-db' may not be read through an env secretKeyRef", "a Secret's value in the env"),
    Hostile("env-secret-key-ref-second", res(env=[{"name": "OK", "value": "1"}, {"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "registry-admin", "key": ".dockerconfigjson"}}}]),
            "spec.resources.env[1].valueFrom.secretKeyRef.name", "Secret 'registry-admin' may not be read",
            "a registry credential"),
    # The runtime's own variables.
    Hostile("env-rlkube-rljob-name", res(env=[{"name": "RLKUBE_RLJOB_NAME", "value": "someone-elses-job"}]),
            "spec.resources.env[0].name", "variables starting with RLKUBE_ or RAY_",
            "report status to another RLJob"),
    Hostile("env-rlkube-api-key", res(env=[{"name": "RLKUBE_API_KEY", "value": "known"}]),
            "spec.resources.env[0].name", "variables starting with RLKUBE_ or RAY_", "a key the author chose"),
    Hostile("env-ray-auth-off", res(env=[{"name": "A", "value": "b"}, {"name": "RAY_AUTH_MODE", "value": "disabled"}]),
            "spec.resources.env[1].name", "variables starting with RLKUBE_ or RAY_", "Ray's authentication off"),
    Hostile("env-ray-address", res(env=[{"name": "RAY_ADDRESS", "value": "ray://elsewhere:10001"}]),
            "spec.resources.env[0].name", "variables starting with RLKUBE_ or RAY_", "the driver on another cluster"),
    Hostile("secret-env-ray-token", res(secretEnv=[{"name": "RAY_AUTH_TOKEN", "secretName": "mine", "key": "t"}]),
            "spec.resources.secretEnv[0].name", "variables starting with RLKUBE_ or RAY_", "Ray's token replaced"),
    Hostile("credential-written-into-the-spec", res(env=[{"name": "WANDB_API_KEY", "value": "0123abcd"}]),
            "spec.resources.env[0].value", "holds a credential", "a key stored in the RLJob and its ConfigMap"),
    # Privileges through a mount.
    Hostile("bidirectional-mount", res(volumes=[PVC], volumeMounts=[{"name": "data", "mountPath": "/data",
                                                                    "mountPropagation": "Bidirectional"}]),
            "spec.resources.volumeMounts[0].mountPropagation", "Bidirectional propagation needs a privileged container"),
    # Pod fields that do not exist in the spec: refused, never passed on.
    Hostile("host-network", res(trainer={"hostNetwork": True}), "spec.resources.trainer.hostNetwork", UNKNOWN,
            "the node's network"),
    Hostile("host-pid", res(hostPID=True), "spec.resources.hostPID", UNKNOWN, "the node's processes"),
    Hostile("privileged-container", res(rollout={"securityContext": {"privileged": True}}),
            "spec.resources.rollout.securityContext", UNKNOWN, "root on the node"),
    Hostile("other-service-account", res(serviceAccountName="operator-admin"), "spec.resources.serviceAccountName",
            UNKNOWN, "another identity's API rights"),
    Hostile("added-capabilities", res(trainer={"capabilities": {"add": ["SYS_ADMIN"]}}),
            "spec.resources.trainer.capabilities", UNKNOWN),
    # Images from registries the namespace may not use.
    Hostile("image-from-elsewhere", res(trainer={"image": "docker.io/someone/miner:latest"}),
            "spec.resources.trainer.image", "is not from an allowed registry", "unvetted code"),
    Hostile("rollout-image-from-elsewhere", {"resources": {"placement": "separate", "rollout": {
        "gpus": 1, "image": "ghcr.io/x/rollout:1"}}, "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2}},
            "spec.resources.rollout.image", "is not from an allowed registry"),
    # Code the spec does not own up to, and the job's key.
    Hostile("trust-remote-code-in-sglang-args", {"rollout": {"sglangArgs": {"--trust-remote-code": True}}},
            "spec.rollout.sglangArgs.--trust-remote-code", "from spec.model.trustRemoteCode",
            "the checkpoint's code, unannounced"),
    Hostile("trust-remote-code-underscored", {"rollout": {"sglangArgs": {"trust_remote_code": True}}},
            "spec.rollout.sglangArgs.trust_remote_code", "from spec.model.trustRemoteCode"),
    Hostile("engine-api-key", {"rollout": {"sglangArgs": {"api-key": "known"}}}, "spec.rollout.sglangArgs.api-key",
            "rlkube sets --api-key itself", "an engine key the author knows", server_message="rlkube sets this flag"),
    Hostile("router-api-key", {"rollout": {"routerArgs": {"api_key": "known"}}}, "spec.rollout.routerArgs.api_key",
            "rlkube sets --api-key itself", server_message="rlkube sets this flag"),
    # Spec honesty.
    Hostile("preset-and-checkpoint", {"model": {"preset": "tiny", "hfCheckpoint": "/data/models/Qwen3-4B"}},
            "spec.model.preset", "preset and hfCheckpoint both give the starting weights"),
    Hostile("queue-name-not-a-label", {"queueName": "team a/gpus"}, "spec.queueName", "must be a label value",
            "a RayJob the API server would refuse forever", server_message="should match"),
]

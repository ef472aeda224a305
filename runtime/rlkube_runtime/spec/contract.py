"""What the operator and the runtime must agree on, in the one place both import.

The operator renders pods, environment and mounts; the runtime, inside those pods, finds its spec,
its RLJob and its Ray resources by the same names. Each side writes its own part of the RLJob's
status. Change a value here and both sides change together.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .rljob import NAME_MAX_LENGTH, RLJobSpec

# Ray custom resources the operator gives each worker group, one unit per GPU (or per pod without
# GPUs), and the router's to the head of a separate job (to the trainer pods of a colocated one);
# the runtime's placement-group bundles ask for them, so trainer ranks, engines and the router
# land on the pods meant for them.
TRAINER_RESOURCE = "rlkube_trainer"
ROLLOUT_RESOURCE = "rlkube_rollout"
ROUTER_RESOURCE = "rlkube_router"

# Environment the operator sets in every pod of an attempt.
ENV_RLJOB_NAME = "RLKUBE_RLJOB_NAME"  # which RLJob the runtime reports status to
ENV_RLJOB_NAMESPACE = "RLKUBE_RLJOB_NAMESPACE"
ENV_METRICS_PORT = "RLKUBE_METRICS_PORT"  # where the driver serves its Prometheus series
ENV_ATTEMPT = "RLKUBE_ATTEMPT"  # the attempt number n of RayJob `<name>-n` (status.lastPreemption.attempt)
# The job's API key, from the Secret the operator generates for each RLJob (API_KEY_SECRET_KEY in
# it): the router and every engine require it (`Authorization: Bearer <key>`) for generation and
# every weight and admin endpoint, and the runtime's clients send it. Unset (a local run): no key.
ENV_API_KEY = "RLKUBE_API_KEY"
API_KEY_SECRET_KEY = "api-key"

# Ray token authentication (KubeRay's RayCluster authOptions, mode token) needs Ray 2.52 or later in
# the images; KubeRay refuses the cluster unless rayVersion says so.
MIN_RAY_VERSION = "2.52.0"

# `rlkube run`'s exit status when it stopped on SIGTERM after saving every trained rollout (128 +
# SIGTERM, as a shell reports a process SIGTERM ended). Ray's job server puts it in the RayJob's
# message, so the operator still sees a preemption when status.lastPreemption could not be written.
PREEMPTED_EXIT_CODE = 143

# The head pod serves the training metrics on this port, named for the chart's PodMonitor.
METRICS_PORT = 9464
METRICS_PORT_NAME = "rlkube-metrics"

# The user every rlkube image runs as (USER in Dockerfile.trainer, Dockerfile.rollout and
# images/operator.Dockerfile, with a passwd entry `rlkube`), and so the non-root user and group the
# job's pods run as by default (runAsUser/runAsGroup/fsGroup; the chart's jobPods.runAsUser for images
# of one's own): a pod that runs as it finds its name and home, and volumes a job mounts (a
# checkpoint claim whose filesystem root belongs to root) are writable through fsGroup.
IMAGE_UID = 65532
# What the pods may write to, their root filesystem being read-only: an emptyDir here, which is
# also the working directory and $HOME (Ray's session files, compiler and model caches, a run's
# output when spec.model.save is unset).
WRITABLE_DIR = "/tmp"

# How SIGTERM reaches the driver on the head pod. The head's PID 1 is `ray start`, whose SIGTERM
# stops Ray under the driver (it would die mid-step without saving); so the head's preStop hook,
# `rlkube stop-driver`, sends SIGTERM to the driver itself, found by the pid file the driver writes
# where this variable says, and waits until it has saved and exited. Only then does the kubelet
# SIGTERM PID 1, and the pod ends.
ENV_DRIVER_PID_FILE = "RLKUBE_DRIVER_PID_FILE"
DRIVER_PID_FILE = f"{WRITABLE_DIR}/rlkube-driver.pid"
STOP_DRIVER_COMMAND = ("rlkube", "stop-driver")

# The RLJob's spec, as a file from its ConfigMap, and the command that runs it on the head pod.
SPEC_MOUNT_DIR = "/etc/rlkube"
SPEC_FILE = "rljob.yaml"
ENTRYPOINT = f"rlkube run {SPEC_MOUNT_DIR}/{SPEC_FILE}"

# Longest RLJob name: its RayJob is `<name>-<attempt>`, which KubeRay keeps to 47 characters.
MAX_NAME_LENGTH = NAME_MAX_LENGTH

# Status fields the runtime writes (through its narrow Role); the operator owns all the others
# and never writes these (restarts is shared: the runtime writes `engine`, the operator `job` and
# `preemptions`). `invalidSpec` is the runtime's refusal of the spec at an attempt's start: the
# operator fails the job for good (reason InvalidSpec) instead of retrying a spec that will be
# refused again. `lastPreemption` is how an attempt tells the operator it stopped on SIGTERM with a
# checkpoint, so that its end is resumed as a preemption rather than counted as a failure.
RUNTIME_STATUS_FIELDS = ("progress", "lastCheckpoint", "metrics", "restarts.engine", "invalidSpec", "lastPreemption")


def fixed_fields() -> tuple[str, ...]:
    """The spec fields fixed after creation (camelCase paths under spec), read from the spec's own
    `self == oldSelf` transition rules: the CRD refuses changes to them, and the operator holds
    them at their running values should an older CRD let a change through."""
    return tuple(_fixed(RLJobSpec, ""))


def _fixed(model: type[BaseModel], prefix: str) -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        if _is_fixed(info.json_schema_extra):
            paths.append(path)
            continue
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _fixed(annotation, f"{path}.")
    return paths


def _is_fixed(extra: Any) -> bool:
    rules = extra.get("x-kubernetes-validations", []) if isinstance(extra, dict) else []
    return any(rule.get("rule") == "self == oldSelf" for rule in rules)

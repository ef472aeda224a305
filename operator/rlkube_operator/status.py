"""What KubeRay reports about an attempt -> the RLJob's phase, conditions and message.

Pure. `observe_rayjob` reads one RayJob (and, for a failure, its pods) into an `Attempt`;
`conditions_for` turns a phase into the standard conditions, keeping each condition's
lastTransitionTime while its status stays the same.

Conditions (one per type):
- Ready: True while the Ray job runs (phase Running).
- Progressing: True while the job moves toward completion (Pending, Queued, Starting, Running,
  Restarting); False once it is Suspended, Succeeded or Failed.
- Suspended: True while spec.suspend holds the job (phase Suspended).
- Failed: True once the job has failed for good (phase Failed); the reason says why.
- SpecChangeIgnored: True while the spec asks for a change the running job cannot take (a field
  that is fixed for the job's life); the message names the fields. Absent otherwise.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from enum import Enum
from datetime import datetime, timezone
from typing import Any

from rlkube_runtime.spec import RLJobPhase

# KubeRay's JobDeploymentStatus values (ray-operator/apis/ray/v1/rayjob_types.go, v1.5).
DEPLOYMENT_NEW = ""
DEPLOYMENT_INITIALIZING = "Initializing"
DEPLOYMENT_RUNNING = "Running"
DEPLOYMENT_COMPLETE = "Complete"
DEPLOYMENT_FAILED = "Failed"
DEPLOYMENT_VALIDATION_FAILED = "ValidationFailed"
DEPLOYMENT_SUSPENDING = "Suspending"
DEPLOYMENT_SUSPENDED = "Suspended"
DEPLOYMENT_RETRYING = "Retrying"
DEPLOYMENT_WAITING = "Waiting"
DEPLOYMENT_SCHEDULING = "Scheduling"
DEPLOYMENT_SCHEDULED = "Scheduled"

# Ray's JobStatus values.
JOB_NEW = ""
JOB_PENDING = "PENDING"
JOB_RUNNING = "RUNNING"
JOB_STOPPED = "STOPPED"
JOB_SUCCEEDED = "SUCCEEDED"
JOB_FAILED = "FAILED"

# KubeRay failure reasons after which another attempt cannot help.
PERMANENT_RAYJOB_REASONS = frozenset({"DeadlineExceeded", "ValidationFailed"})

CONDITION_TYPES = ("Ready", "Progressing", "Suspended", "Failed")
SPEC_CHANGE_IGNORED = "SpecChangeIgnored"  # the condition type; its Event's reason is Reason.SPEC_CHANGE_IGNORED


class Reason(str, Enum):
    """Every reason the operator writes: of status.reason and the conditions, and of its Events
    (an Event also takes a phase's name). CamelCase, as Kubernetes writes
    them; a status patch holds the plain string (`str(reason)`)."""

    # The attempt, as its RayJob reports it (observe_rayjob).
    RAYJOB_CREATED = "RayJobCreated"  # created; KubeRay has not picked it up yet
    CLUSTER_STARTING = "ClusterStarting"  # the Ray cluster is coming up
    JOB_SUBMITTED = "JobSubmitted"  # the Ray job is submitted, not running yet
    RUNNING = "Running"
    COMPLETED = "Completed"
    RAYJOB_RETRYING = "RayJobRetrying"  # KubeRay retries the RayJob itself
    RAYJOB_FAILED = "RayJobFailed"
    RAYJOB_INVALID = "RayJobInvalid"  # KubeRay refused the RayJob (ValidationFailed)
    RAYJOB_STOPPED = "RayJobStopped"  # the Ray job was stopped outside rlkube
    DEADLINE_EXCEEDED = "DeadlineExceeded"  # activeDeadlineSeconds passed
    # What the operator decided.
    INVALID_SPEC = "InvalidSpec"  # the spec is refused (by the operator's validation or the runtime's)
    BACKOFF_WAITING = "BackoffWaiting"  # a failed attempt; the next one starts after its backoff
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    ATTEMPT_STARTED = "AttemptStarted"  # the next attempt after a failure
    PREEMPTED = "Preempted"  # the next attempt after a preemption, at once and not counted as a failure
    PREEMPTION_BACKOFF_WAITING = "PreemptedBackoffWaiting"  # preempted again; the next attempt starts after a backoff
    PREEMPTION_LIMIT_EXCEEDED = "PreemptionLimitExceeded"  # preempted more often than faultTolerance.maxPreemptions
    NAME_CONFLICT = "NameConflict"  # a RayJob of that name exists and is not this job's
    RAYJOB_DELETING = "RayJobDeleting"
    QUEUED = "Queued"  # Kueue has not admitted it yet
    ADMITTED = "Admitted"
    SUSPENDING = "Suspending"
    RESUMING = "Resuming"
    SUSPENDED = "Suspended"
    NOT_SUSPENDED = "NotSuspended"
    NOT_FAILED = "NotFailed"
    IMMUTABLE_FIELD = "ImmutableField"  # a change to a field fixed for the job's life, ignored
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"  # the Event of that: the condition SpecChangeIgnored was raised
    DELETING = "Deleting"  # ttlSecondsAfterFinished passed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Attempt:
    """One attempt (RayJob) as observed.

    phase is what the attempt alone says (Failed here may still become Restarting: reconcile
    decides); reason is CamelCase, message is for people.
    """

    phase: RLJobPhase
    reason: Reason
    message: str
    failed: bool = False
    permanent: bool = False
    ray_cluster_name: str | None = None
    dashboard_url: str | None = None
    exit_code: int | None = None  # the driver's, when Ray's job server reported it


# Ray's job server on an entrypoint that failed: "Job entrypoint command failed with exit code 143, ..."
_EXIT_CODE = re.compile(r"exit code (-?\d+)")


def observe_rayjob(rayjob: dict[str, Any], pods: list[dict[str, Any]] = ()) -> Attempt:
    """Map a RayJob's (jobDeploymentStatus, jobStatus) to a phase.

    | jobDeploymentStatus                    | jobStatus            | phase      |
    |----------------------------------------|----------------------|------------|
    | "" (KubeRay has not seen it yet)       | any                  | Pending    |
    | Initializing, Scheduling, Scheduled,   | any                  | Starting   |
    |   Waiting                              |                      |            |
    | Running                                | "", PENDING          | Starting   |
    | Running                                | RUNNING, SUCCEEDED   | Running    |
    | Running                                | FAILED, STOPPED      | Failed     |
    | Complete                               | SUCCEEDED (or other) | Succeeded  |
    | Complete                               | FAILED, STOPPED      | Failed     |
    | Failed, ValidationFailed               | any                  | Failed     |
    | Suspending, Suspended                  | any                  | Suspended  |
    | Retrying                               | any                  | Restarting |

    Running + FAILED covers KubeRay reporting the Ray job failed before the deployment status
    follows (ray-project/kuberay#2314): the attempt is over either way.
    """
    status = rayjob.get("status") or {}
    deployment = status.get("jobDeploymentStatus") or DEPLOYMENT_NEW
    job = status.get("jobStatus") or JOB_NEW
    name = rayjob.get("metadata", {}).get("name", "?")
    ray_reason = status.get("reason") or ""
    ray_message = status.get("message") or ""
    common = {
        "ray_cluster_name": status.get("rayClusterName") or None,
        "dashboard_url": status.get("dashboardURL") or None,
    }

    def failed(reason: Reason, what: str) -> Attempt:
        detail = "; ".join(x for x in (ray_reason, ray_message, pod_failures(pods)) if x)
        message = f"RayJob {name} {what}" + (f": {detail}" if detail else "")
        code = _EXIT_CODE.search(ray_message)
        return Attempt(
            RLJobPhase.FAILED, reason, message, failed=True,
            permanent=ray_reason in PERMANENT_RAYJOB_REASONS or deployment == DEPLOYMENT_VALIDATION_FAILED,
            exit_code=int(code.group(1)) if code else None,
            **common,
        )

    if deployment in (DEPLOYMENT_FAILED, DEPLOYMENT_VALIDATION_FAILED):
        reason = Reason.DEADLINE_EXCEEDED if ray_reason == "DeadlineExceeded" else Reason.RAYJOB_FAILED
        if deployment == DEPLOYMENT_VALIDATION_FAILED:
            reason = Reason.RAYJOB_INVALID
        return failed(reason, "failed")
    if job == JOB_FAILED:
        return failed(Reason.RAYJOB_FAILED, "reports the Ray job FAILED")
    if job == JOB_STOPPED:
        return failed(Reason.RAYJOB_STOPPED, "reports the Ray job STOPPED (stopped outside rlkube)")
    if deployment == DEPLOYMENT_COMPLETE:
        return Attempt(RLJobPhase.SUCCEEDED, Reason.COMPLETED, f"RayJob {name} completed", **common)
    if deployment in (DEPLOYMENT_SUSPENDING, DEPLOYMENT_SUSPENDED):
        what = "suspending: its pods are being deleted" if deployment == DEPLOYMENT_SUSPENDING else "suspended"
        return Attempt(RLJobPhase.SUSPENDED, Reason(deployment), f"RayJob {name} {what}", **common)
    if deployment == DEPLOYMENT_RETRYING:
        return Attempt(RLJobPhase.RESTARTING, Reason.RAYJOB_RETRYING, f"KubeRay is retrying RayJob {name}", **common)
    if deployment == DEPLOYMENT_RUNNING:
        if job in (JOB_RUNNING, JOB_SUCCEEDED):
            return Attempt(RLJobPhase.RUNNING, Reason.RUNNING, f"the Ray job of RayJob {name} is running", **common)
        return Attempt(
            RLJobPhase.STARTING, Reason.JOB_SUBMITTED, f"RayJob {name} submitted the Ray job; waiting for it to start", **common
        )
    if deployment == DEPLOYMENT_NEW:
        return Attempt(RLJobPhase.PENDING, Reason.RAYJOB_CREATED, f"RayJob {name} created; waiting for KubeRay", **common)
    # Initializing, Scheduling, Scheduled, Waiting, or a status newer than this operator knows.
    return Attempt(
        RLJobPhase.STARTING, Reason.CLUSTER_STARTING,
        f"RayJob {name} is {deployment or 'starting'}: the Ray cluster is coming up", **common,
    )


def pod_failures(pods: list[dict[str, Any]]) -> str:
    """'pod p (container c) exited 137: OOMKilled' for each failed container of failed pods."""
    out = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Failed":
            continue
        pod_name = pod.get("metadata", {}).get("name", "?")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        terminated = [
            (s.get("name"), (s.get("state") or {}).get("terminated") or {})
            for s in statuses
            if ((s.get("state") or {}).get("terminated") or {}).get("exitCode", 0) != 0
        ]
        if not terminated:
            out.append(f"pod {pod_name} failed: {(pod.get('status') or {}).get('reason') or 'unknown reason'}")
        for container, t in terminated:
            text = f"pod {pod_name} (container {container}) exited {t.get('exitCode')}"
            why = ": ".join(x for x in (t.get("reason"), t.get("message")) if x)
            out.append(f"{text}: {why}" if why else text)
    return "; ".join(out)


def spec_refused_by_runtime(status: dict[str, Any], attempt: int) -> str | None:
    """Why the runtime of `attempt` refused the spec at its start (status.invalidSpec, which the
    runtime writes before it exits), or None. A refusal recorded for another attempt is stale."""
    refusal = status.get("invalidSpec") or {}
    if refusal.get("attempt") == attempt and refusal.get("message"):
        return str(refusal["message"])
    return None


# --- conditions --------------------------------------------------------------------------------


def now_rfc3339(now: datetime) -> str:
    return now.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ConditionSpec:
    type: str
    status: str
    reason: str
    message: str = ""


def desired_conditions(phase: RLJobPhase, reason: Reason, message: str) -> list[ConditionSpec]:
    """The four standard conditions for a phase (see the module docstring)."""
    ready = phase == RLJobPhase.RUNNING
    progressing = phase in (
        RLJobPhase.PENDING, RLJobPhase.QUEUED, RLJobPhase.STARTING, RLJobPhase.RUNNING, RLJobPhase.RESTARTING
    )
    suspended = phase == RLJobPhase.SUSPENDED
    failed = phase == RLJobPhase.FAILED
    return [
        ConditionSpec("Ready", _tf(ready), reason if ready else f"{phase.value}", message if ready else ""),
        ConditionSpec("Progressing", _tf(progressing), reason, message),
        ConditionSpec("Suspended", _tf(suspended), Reason.SUSPENDED if suspended else Reason.NOT_SUSPENDED,
                      message if suspended else ""),
        ConditionSpec("Failed", _tf(failed), reason if failed else Reason.NOT_FAILED, message if failed else ""),
    ]


def _tf(value: bool) -> str:
    return "True" if value else "False"


def merge_conditions(
    previous: list[dict[str, Any]],
    wanted: list[ConditionSpec],
    *,
    now: datetime,
    generation: int | None,
    drop: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The conditions to write: `wanted` in order, each keeping its previous lastTransitionTime
    when its status did not change; previous conditions of other types are kept unless in `drop`."""
    by_type = {c.get("type"): c for c in previous or []}
    wanted_types = {w.type for w in wanted}
    out = []
    for w in wanted:
        old = by_type.get(w.type) or {}
        changed = old.get("status") != w.status
        cond = {
            "type": w.type,
            "status": w.status,
            "reason": str(w.reason),
            "message": w.message,
            "lastTransitionTime": now_rfc3339(now) if changed or not old.get("lastTransitionTime") else old["lastTransitionTime"],
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    for c in previous or []:
        if c.get("type") not in wanted_types and c.get("type") not in drop:
            out.append(dict(c))
    return out


OPERATOR_STATUS_KEYS = (
    "phase", "message", "conditions", "observedGeneration", "rayJobName", "rayClusterName", "dashboardUrl", "progressText",
)

OPERATOR_RESTART_COUNTERS = ("job", "preemptions")


def status_changes(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The merge patch taking `current` status to `desired` on operator-owned keys; {} if none.

    None in `desired` means 'absent'. restarts is compared on the operator's counters only (job
    and preemptions; the runtime owns restarts.engine).
    """
    patch: dict[str, Any] = {}
    for key in OPERATOR_STATUS_KEYS:
        want = desired.get(key)
        if current.get(key) != want:
            patch[key] = want
    have, want = current.get("restarts") or {}, desired.get("restarts") or {}
    wanted = {counter: want.get(counter, 0) for counter in OPERATOR_RESTART_COUNTERS}
    if any(have.get(counter, 0) != value for counter, value in wanted.items()) or "restarts" not in current:
        patch["restarts"] = wanted
    return patch

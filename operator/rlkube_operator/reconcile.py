"""Decide what to do for one RLJob, given everything observed about it. Pure: no API calls.

`reconcile(observed, settings) -> Plan`. The controller gathers `Observed` (the RLJob, its
RayJobs, ConfigMap, RBAC objects and the current attempt's pods), calls this, and carries the
plan out. Being a function of observed state only (nothing remembered between calls), it is safe
across operator restarts: the same cluster state gives the same plan, and nothing is created twice.

Attempts. Attempt n runs as RayJob `<rljob>-n`; n is status.restarts.job, or the highest attempt
label among the RLJob's RayJobs when that is ahead (a restart whose status write was lost). When
attempt n fails, fault tolerance is on and n < backoffLimit, the job is Restarting: the failure
time is stamped on the failed RayJob (annotation FAILED_AT_ANNOTATION, so a restarted operator
waits out the same backoff), and after backoffSeconds x 2^n (capped) the failed RayJob is deleted,
`<rljob>-(n+1)` is created and restarts.job becomes n+1. The runtime resumes from the latest
complete checkpoint by itself. An attempt whose runtime refused the spec at start (it writes
status.invalidSpec with its attempt number, then exits) is not restarted: the job is Failed with
reason InvalidSpec, as a spec the operator itself refuses is, since every attempt would be refused.

Preemptions. An attempt whose driver stopped on SIGTERM (preemption, a node drain) after saving
every trained rollout exits 143, and the Ray job reads as failed; the runtime says so first in
status.lastPreemption {attempt: n, rollout}. Such an attempt is resumed at once, without backoff
and without counting against backoffLimit: restarts.preemptions counts them, and the failures
that backoffLimit bounds are restarts.job - restarts.preemptions. Each RayJob carries the count
of preemptions before it (PREEMPTIONS_ANNOTATION), so a lost status write is recovered from the
RayJob as attempts are. The Progressing condition's reason is then Preempted, with a Normal
Preempted event.

Kueue (spec.queueName). Each RayJob is created suspended with Kueue's queue-name label, and from
then on its suspend flag is Kueue's: Kueue unsuspends it to admit it and suspends it again to
preempt it, and an operator that set the flag back would fight it. The RLJob shows Queued while
the RayJob waits. spec.suspend: true deletes the queued RayJob instead (Kueue would unsuspend an
admitted one), which also gives its quota back; resuming creates it again, suspended and queued.
Whether a RayJob is Kueue's is read from its own label, so a queueName set on a running job
applies from its next RayJob on.

Spec changes. The runtime reads the spec once, from the ConfigMap, when an attempt starts; the
ConfigMap is rewritten from the live spec only when an attempt starts or resumes. Fields in
IMMUTABLE_FIELDS are refused by the CRD's CEL transition rules; should a change get past them
(an older CRD), the operator keeps the running values, raises SpecChangeIgnored and carries on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from rlkube_runtime.spec import TERMINAL_PHASES, RLJob, RLJobPhase, format_progress
from rlkube_runtime.spec.contract import fixed_fields
from rlkube_runtime.spec.load import SpecError, parse_rljob

from . import render
from .settings import OperatorSettings
from .status import (
    SPEC_CHANGE_IGNORED,
    Attempt,
    ConditionSpec,
    desired_conditions,
    merge_conditions,
    now_rfc3339,
    observe_rayjob,
    spec_refused_by_runtime,
)

# The reason of a job failed for its spec, by the operator's validation or the runtime's.
INVALID_SPEC = "InvalidSpec"

# Stamped on a failed RayJob when the operator first sees the failure (RFC 3339).
FAILED_AT_ANNOTATION = "rlkube.io/failed-at"
# On each RayJob: how many preemptions came before its attempt (see Preemptions above).
PREEMPTIONS_ANNOTATION = "rlkube.io/preemptions"
PREEMPTED = "Preempted"  # the reason of a restart after a preemption

# Fixed for the life of a job (camelCase paths under spec): the checkpoint layout, the data
# position and the partial-rollout buffer in a checkpoint all depend on them. Read from the
# spec's own transition rules, the ones the CRD enforces.
IMMUTABLE_FIELDS = fixed_fields()

_MISSING = object()


@dataclass(frozen=True)
class Observed:
    rljob: dict[str, Any]
    rayjobs: list[dict[str, Any]]  # RayJobs labelled with this RLJob and owned by its uid
    configmap: dict[str, Any] | None
    service_account: bool
    role: bool
    role_binding: bool
    pods: list[dict[str, Any]]  # pods of the current attempt (for failure details)
    now: datetime
    conflicts: tuple[str, ...] = ()  # 'Kind name' of children's names taken by objects this RLJob does not own


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Plan:
    """What the controller does, in this order: create, update the ConfigMap, patch RayJobs,
    delete RayJobs, patch the RLJob status, post events, delete the RLJob (TTL)."""

    create: list[dict[str, Any]] = field(default_factory=list)
    update_configmap: dict[str, Any] | None = None
    patch_rayjobs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    delete_rayjobs: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)  # the full operator-owned status wanted
    events: list[Event] = field(default_factory=list)
    delete_rljob: bool = False
    requeue_after: float | None = None
    permanent_error: str | None = None  # set when the spec itself is the problem


def backoff_seconds(restarts: int, base: float, cap: float) -> float:
    """Delay before attempt restarts+1: base x 2^restarts, at most cap."""
    return min(cap, base * (2 ** restarts))


def current_attempt(status: dict[str, Any], rayjobs: list[dict[str, Any]]) -> int:
    counted = int((status.get("restarts") or {}).get("job") or 0)
    labelled = [a for a in (render.attempt_of(rj) for rj in rayjobs) if a is not None]
    return max([counted, *labelled])


def preemptions_so_far(status: dict[str, Any], rayjobs: list[dict[str, Any]]) -> int:
    """status.restarts.preemptions, or the count a RayJob carries when that is ahead (a restart
    after a preemption whose status write was lost)."""
    counted = int((status.get("restarts") or {}).get("preemptions") or 0)
    carried = []
    for rj in rayjobs:
        value = ((rj.get("metadata") or {}).get("annotations") or {}).get(PREEMPTIONS_ANNOTATION)
        if value is not None and str(value).isdigit():
            carried.append(int(value))
    return max([counted, *carried])


def preemption_of(status: dict[str, Any], attempt: int) -> dict[str, Any] | None:
    """The runtime's status.lastPreemption when it is about `attempt`, else None."""
    record = status.get("lastPreemption")
    if not isinstance(record, dict):
        return None
    try:
        return record if int(record.get("attempt")) == attempt else None
    except (TypeError, ValueError):
        return None


def get_path(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    if value is _MISSING:
        obj.pop(parts[-1], None)
    else:
        obj[parts[-1]] = copy.deepcopy(value)


def immutable_changes(running: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """The IMMUTABLE_FIELDS whose live value differs from the running spec's."""
    return [f"spec.{p}" for p in IMMUTABLE_FIELDS if get_path(running, p) != get_path(live, p)]


def effective_spec(running: dict[str, Any] | None, live: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The live spec with the immutable fields held at their running values; and what was held."""
    if running is None:
        return copy.deepcopy(live), []
    changed = immutable_changes(running, live)
    spec = copy.deepcopy(live)
    for path in changed:
        set_path(spec, path.removeprefix("spec."), get_path(running, path.removeprefix("spec.")))
    return spec, changed


# --- the decision ------------------------------------------------------------------------------


def reconcile(obs: Observed, settings: OperatorSettings) -> Plan:
    body = obs.rljob
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    ref = render.JobRef.from_body(body)
    plan = Plan()
    prev_phase = status.get("phase")

    try:
        render.check_name(ref.name)
        job = parse_rljob(_spec_object(body))
        # Rendered once up front so a spec that cannot become pods creates nothing at all.
        render.render_rayjob(ref, job.spec, attempt=0, settings=settings)
    except (SpecError, render.RenderError) as exc:
        return _fail_permanently(obs, plan, _first_error(exc))

    if prev_phase in {p.value for p in TERMINAL_PHASES}:
        return _finished(obs, job, plan)

    if obs.conflicts:
        message = (
            f"{', '.join(obs.conflicts)} already exist(s) and is not owned by this RLJob; delete or rename it "
            "(retrying)"
        )
        _status(obs, job, plan, _phase(prev_phase) if prev_phase else RLJobPhase.PENDING, "NameConflict", message,
                current_attempt(status, obs.rayjobs), None)
        if status.get("message") != message:
            plan.events.append(Event("Warning", "NameConflict", message))
        plan.requeue_after = settings.resync_seconds
        return plan

    running = configmap_spec_or_none(obs.configmap)
    spec_dict, held = effective_spec(running, body.get("spec") or {})
    if held:
        try:
            job = parse_rljob({**_spec_object(body), "spec": spec_dict})
        except SpecError as exc:
            return _fail_permanently(obs, plan, _first_error(exc))
    desired_cm = render.render_configmap(ref, spec_dict)

    _plan_children(obs, ref, desired_cm, plan)

    def refresh_configmap() -> None:
        # The runtime reads the spec when an attempt starts: bring the file up to date then.
        if obs.configmap is not None and obs.configmap.get("data") != desired_cm["data"]:
            plan.update_configmap = desired_cm

    n = current_attempt(status, obs.rayjobs)
    name = render.rayjob_name(ref.name, n)
    current = next((rj for rj in obs.rayjobs if rj["metadata"]["name"] == name), None)
    for rj in obs.rayjobs:
        if rj is not current and not rj["metadata"].get("deletionTimestamp"):
            plan.delete_rayjobs.append(rj["metadata"]["name"])

    deadline_left = _deadline_left(job, meta, obs.now)
    if deadline_left is not None and deadline_left <= 0:
        if current is not None:
            plan.delete_rayjobs.append(name)
        message = f"spec.activeDeadlineSeconds({job.spec.active_deadline_seconds}) passed; the job ran out of time"
        return _finish_status(obs, job, plan, RLJobPhase.FAILED, "DeadlineExceeded", message, n, current)

    if current is None and job.spec.suspend and job.spec.queue_name:
        message = f"suspended: no RayJob while spec.suspend is true; resuming queues {name} in {job.spec.queue_name}"
        _status(obs, job, plan, RLJobPhase.SUSPENDED, "Suspended", message, n, None)
        plan.requeue_after = settings.resync_seconds
        return plan

    if current is None:
        try:
            rayjob = render.render_rayjob(
                ref, job.spec, attempt=n, settings=settings, active_deadline_seconds=deadline_left
            )
        except render.RenderError as exc:  # only when held fixed fields make a different spec
            return _fail_permanently(obs, plan, (exc.field, exc.message))
        refresh_configmap()
        plan.create.append(rayjob)
        _status(obs, job, plan, *_created_phase(job, name, n), n, None)
        plan.requeue_after = settings.resync_seconds
        return plan

    if current["metadata"].get("deletionTimestamp"):
        # Someone deleted the current attempt's RayJob; make it again once it is gone.
        _status(obs, job, plan, _phase(prev_phase), "RayJobDeleting", f"RayJob {name} is being deleted", n, None)
        plan.requeue_after = min(2.0, settings.resync_seconds)
        return plan

    attempt = observe_rayjob(current, obs.pods)
    if attempt.failed:
        return _attempt_failed(obs, job, plan, settings, n, current, attempt, refresh_configmap, deadline_left)
    if attempt.phase == RLJobPhase.SUCCEEDED:
        return _finish_status(obs, job, plan, RLJobPhase.SUCCEEDED, attempt.reason, attempt.message, n, current, attempt)

    if is_queued_by_kueue(current):
        phase, reason, message = _leave_suspend_to_kueue(job, current, attempt, plan, refresh_configmap)
    else:
        phase, reason, message = _check_suspend_and_update_if_needed(job, current, attempt, plan, refresh_configmap)
    _status(obs, job, plan, phase, reason, message, n, current, attempt)
    plan.requeue_after = settings.resync_seconds
    return plan


def _plan_children(obs: Observed, ref: render.JobRef, configmap: dict[str, Any], plan: Plan) -> None:
    """Create whichever of the ConfigMap, ServiceAccount, Role and RoleBinding is missing."""
    if obs.configmap is None:
        plan.create.append(configmap)
    if not obs.service_account:
        plan.create.append(render.render_service_account(ref))
    if not obs.role:
        plan.create.append(render.render_role(ref))
    if not obs.role_binding:
        plan.create.append(render.render_role_binding(ref))


def _created_phase(job: RLJob, name: str, n: int) -> tuple[RLJobPhase, str, str]:
    """Phase, reason and message right after creating RayJob `name` of attempt n."""
    created = f"created RayJob {name} (attempt {n})"
    if job.spec.suspend:
        return RLJobPhase.SUSPENDED, "Suspended", f"{created}, suspended"
    if job.spec.queue_name:
        queue = job.spec.queue_name
        return RLJobPhase.QUEUED, "Queued", f"{created}, suspended until Kueue admits it from LocalQueue {queue}"
    return RLJobPhase.PENDING, "RayJobCreated", created


def is_queued_by_kueue(rayjob: dict[str, Any]) -> bool:
    """Whether the RayJob carries Kueue's queue-name label, which makes its suspend flag Kueue's."""
    return bool((rayjob.get("metadata", {}).get("labels") or {}).get(render.KUEUE_QUEUE_LABEL))


def _leave_suspend_to_kueue(
    job: RLJob, current: dict[str, Any], attempt: Attempt, plan: Plan, refresh_configmap: Any
) -> tuple[RLJobPhase, str, str]:
    """The phase of a Kueue-managed RayJob, whose suspend flag the operator never writes.

    spec.suspend deletes it: setting its flag would be undone by Kueue while the workload stays
    admitted, and deleting also frees the quota. Suspended by Kueue (not yet admitted, or
    preempted) is Queued; the spec file is kept current then, as the runtime reads it when Kueue
    starts the job. Just admitted (KubeRay not caught up yet) is Starting.
    """
    name = current["metadata"]["name"]
    queue = current["metadata"]["labels"][render.KUEUE_QUEUE_LABEL]
    if job.spec.suspend:
        plan.delete_rayjobs.append(name)
        return (RLJobPhase.SUSPENDED, "Suspending",
                f"deleting RayJob {name} and its place in LocalQueue {queue}; resuming queues it again")
    if (current.get("spec") or {}).get("suspend"):
        refresh_configmap()
        return RLJobPhase.QUEUED, "Queued", f"RayJob {name} waits for Kueue to admit it from LocalQueue {queue}"
    if attempt.phase in (RLJobPhase.SUSPENDED, RLJobPhase.PENDING):
        return RLJobPhase.STARTING, "Admitted", f"Kueue admitted RayJob {name}; the Ray cluster is coming up"
    return attempt.phase, attempt.reason, attempt.message


def _check_suspend_and_update_if_needed(
    job: RLJob, current: dict[str, Any], attempt: Attempt, plan: Plan, refresh_configmap: Any
) -> tuple[RLJobPhase, str, str]:
    """Bring the RayJob's suspend flag to spec.suspend (a RayJob without Kueue); the phase, reason
    and message to show."""
    name = current["metadata"]["name"]
    want = bool(job.spec.suspend)
    if bool((current.get("spec") or {}).get("suspend")) != want:
        if not want:
            refresh_configmap()  # a resumed attempt starts the runtime again: it reads the spec then
        plan.patch_rayjobs.append((name, {"spec": {"suspend": want}}))
    if want and attempt.phase != RLJobPhase.SUSPENDED:
        return RLJobPhase.SUSPENDED, "Suspending", f"suspending RayJob {name}: its pods are being deleted"
    if not want and attempt.phase == RLJobPhase.SUSPENDED:
        return RLJobPhase.STARTING, "Resuming", f"resuming RayJob {name} from the latest checkpoint"
    return attempt.phase, attempt.reason, attempt.message


def _attempt_failed(
    obs: Observed,
    job: RLJob,
    plan: Plan,
    settings: OperatorSettings,
    n: int,
    current: dict[str, Any],
    attempt: Attempt,
    refresh_configmap: Any,
    deadline_left: float | None,
) -> Plan:
    ft = job.spec.fault_tolerance
    name = current["metadata"]["name"]
    refused = spec_refused_by_runtime(obs.rljob.get("status") or {}, n)
    if refused is not None:
        message = (
            f"the runtime of attempt {n} (RayJob {name}) refused the spec: {refused}. Another attempt would be "
            "refused too: fix the spec and create the RLJob again"
        )
        plan.permanent_error = message
        return _finish_status(obs, job, plan, RLJobPhase.FAILED, INVALID_SPEC, message, n, current, attempt)
    if attempt.permanent:
        return _finish_status(obs, job, plan, RLJobPhase.FAILED, attempt.reason, attempt.message, n, current, attempt)
    if not ft.enabled:
        message = f"{attempt.message} (faultTolerance.enabled is false: no restart)"
        return _finish_status(obs, job, plan, RLJobPhase.FAILED, attempt.reason, message, n, current, attempt)
    status = obs.rljob.get("status") or {}
    preemptions = preemptions_so_far(status, obs.rayjobs)
    record = preemption_of(status, n)
    if record is not None:
        return _resume_after_preemption(obs, job, plan, settings, n, name, record, preemptions, refresh_configmap,
                                        deadline_left)
    failures = n - preemptions  # restarts after failures so far; backoffLimit bounds these
    if failures >= ft.backoff_limit:
        message = f"{attempt.message}; faultTolerance.backoffLimit({ft.backoff_limit}) restarts used up"
        return _finish_status(obs, job, plan, RLJobPhase.FAILED, "BackoffLimitExceeded", message, n, current, attempt)

    annotations = current["metadata"].get("annotations") or {}
    failed_at = _parse_time(annotations.get(FAILED_AT_ANNOTATION))
    if failed_at is None:
        failed_at = obs.now
        plan.patch_rayjobs.append(
            (name, {"metadata": {"annotations": {FAILED_AT_ANNOTATION: now_rfc3339(obs.now)}}})
        )
    delay = backoff_seconds(failures, ft.backoff_seconds, settings.max_backoff_seconds)
    restart_at = failed_at + timedelta(seconds=delay)
    if obs.now < restart_at:
        wait = (restart_at - obs.now).total_seconds()
        # No countdown in the message: status must not change on every reconcile.
        message = (
            f"{attempt.message}; attempt {n + 1} (restart {failures + 1} of {ft.backoff_limit}) starts at "
            f"{now_rfc3339(restart_at)} after a {delay:g}s backoff, from the latest checkpoint"
        )
        _status(obs, job, plan, RLJobPhase.RESTARTING, "BackoffWaiting", message, n, current, attempt)
        plan.requeue_after = max(wait, 0.1)
        return plan

    # Backoff over: the next attempt replaces the failed one.
    new = render.render_rayjob(
        render.JobRef.from_body(obs.rljob), job.spec, attempt=n + 1, settings=settings,
        active_deadline_seconds=deadline_left,
    )
    refresh_configmap()
    plan.create.append(new)
    plan.delete_rayjobs.append(name)
    message = f"{attempt.message}; started attempt {n + 1} as RayJob {new['metadata']['name']}, resuming from the latest checkpoint"
    _status(obs, job, plan, RLJobPhase.RESTARTING, "AttemptStarted", message, n + 1, None)
    plan.status["rayJobName"] = new["metadata"]["name"]
    plan.requeue_after = settings.resync_seconds
    return plan


def _resume_after_preemption(
    obs: Observed,
    job: RLJob,
    plan: Plan,
    settings: OperatorSettings,
    n: int,
    name: str,
    record: dict[str, Any],
    preemptions: int,
    refresh_configmap: Any,
    deadline_left: float | None,
) -> Plan:
    """Attempt n stopped on SIGTERM with its checkpoint saved: attempt n+1 starts now, counted as
    a preemption, not as a failure (no backoff, backoffLimit untouched)."""
    count = preemptions + 1
    new = render.render_rayjob(
        render.JobRef.from_body(obs.rljob), job.spec, attempt=n + 1, settings=settings,
        active_deadline_seconds=deadline_left,
    )
    new["metadata"].setdefault("annotations", {})[PREEMPTIONS_ANNOTATION] = str(count)
    refresh_configmap()
    plan.create.append(new)
    plan.delete_rayjobs.append(name)
    rollout = record.get("rollout")
    saved = f"the checkpoint of rollout {rollout}" if rollout is not None else "nothing (no rollout was trained yet)"
    limit = job.spec.fault_tolerance.backoff_limit
    message = (
        f"RayJob {name} was preempted: its driver stopped on SIGTERM after saving {saved}; started attempt {n + 1} "
        f"as RayJob {new['metadata']['name']}, resuming from it (preemption {count}, not counted against "
        f"faultTolerance.backoffLimit({limit}))"
    )
    _status(obs, job, plan, RLJobPhase.RESTARTING, PREEMPTED, message, n + 1, None, preemptions=count)
    plan.status["rayJobName"] = new["metadata"]["name"]
    plan.requeue_after = settings.resync_seconds
    return plan


def _finished(obs: Observed, job: RLJob, plan: Plan) -> Plan:
    """Succeeded or Failed already: keep the status, delete the RLJob once its TTL has passed."""
    status = obs.rljob.get("status") or {}
    plan.status = _carry(status, generation=obs.rljob["metadata"].get("generation"), num_rollout=job.spec.training.num_rollout)
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is None:
        return plan
    finished = _finished_at(status) or obs.now
    left = (finished + timedelta(seconds=ttl) - obs.now).total_seconds()
    if left <= 0:
        plan.delete_rljob = True
        plan.events.append(Event("Normal", "Deleting", f"ttlSecondsAfterFinished({ttl}) passed since the job finished"))
    else:
        plan.requeue_after = left
    return plan


def _finish_status(
    obs: Observed,
    job: RLJob,
    plan: Plan,
    phase: RLJobPhase,
    reason: str,
    message: str,
    n: int,
    current: dict[str, Any] | None,
    attempt: Attempt | None = None,
) -> Plan:
    _status(obs, job, plan, phase, reason, message, n, current, attempt)
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is not None:
        plan.requeue_after = max(float(ttl), 0.1)
    return plan


def _fail_permanently(obs: Observed, plan: Plan, error: tuple[str, str]) -> Plan:
    path, text = error
    message = f"{path}: {text}" if path else text
    status = obs.rljob.get("status") or {}
    plan.permanent_error = message
    phase = RLJobPhase.FAILED
    conditions = merge_conditions(
        status.get("conditions") or [],
        desired_conditions(phase, INVALID_SPEC, message),
        now=obs.now,
        generation=obs.rljob["metadata"].get("generation"),
    )
    plan.status = {
        **_carry(status, generation=obs.rljob["metadata"].get("generation"), num_rollout=None),
        "phase": phase.value,
        "message": message,
        "conditions": conditions,
    }
    _transition_event(status, plan, phase, message)
    return plan


def _status(
    obs: Observed,
    job: RLJob,
    plan: Plan,
    phase: RLJobPhase,
    reason: str,
    message: str,
    n: int,
    current: dict[str, Any] | None,
    attempt: Attempt | None = None,
    *,
    preemptions: int | None = None,
) -> None:
    """Fill plan.status (the whole operator-owned status) and the phase-transition event."""
    body = obs.rljob
    status = body.get("status") or {}
    generation = body["metadata"].get("generation")
    live = body.get("spec") or {}
    running = configmap_spec_or_none(obs.configmap)
    held = immutable_changes(running, live) if running is not None else []
    wanted = desired_conditions(phase, reason, message)
    drop: tuple[str, ...] = ()
    if held:
        note = (
            f"{', '.join(held)} cannot change while the job exists; the job keeps running with the values "
            "it started with (delete and re-create the RLJob to change them)"
        )
        wanted.append(ConditionSpec(SPEC_CHANGE_IGNORED, "True", "ImmutableField", note))
        old = next((c for c in status.get("conditions") or [] if c.get("type") == SPEC_CHANGE_IGNORED), {})
        if old.get("status") != "True" or old.get("message") != note:
            plan.events.append(Event("Warning", SPEC_CHANGE_IGNORED, note))
    else:
        drop = (SPEC_CHANGE_IGNORED,)
    conditions = merge_conditions(status.get("conditions") or [], wanted, now=obs.now, generation=generation, drop=drop)
    rj_name = current["metadata"]["name"] if current is not None else render.rayjob_name(body["metadata"]["name"], n)
    cluster = attempt.ray_cluster_name if attempt else None
    plan.status = {
        **_carry(status, generation=generation, num_rollout=job.spec.training.num_rollout),
        "phase": phase.value,
        "message": message,
        "conditions": conditions,
        "rayJobName": rj_name,
        "rayClusterName": cluster,
        "dashboardUrl": attempt.dashboard_url if attempt else None,
        "restarts": {"job": n, "preemptions": preemptions if preemptions is not None
                     else preemptions_so_far(status, obs.rayjobs)},
    }
    _transition_event(status, plan, phase, message, reason)


def _carry(status: dict[str, Any], *, generation: int | None, num_rollout: int | None) -> dict[str, Any]:
    """The operator-owned status fields as they are, with observedGeneration and progressText updated."""
    out = {k: status.get(k) for k in (
        "phase", "message", "conditions", "rayJobName", "rayClusterName", "dashboardUrl",
    )}
    out["observedGeneration"] = generation
    restarts = status.get("restarts") or {}
    out["restarts"] = {"job": int(restarts.get("job") or 0), "preemptions": int(restarts.get("preemptions") or 0)}
    progress = status.get("progress") or {}
    total = progress.get("numRollout") or num_rollout
    out["progressText"] = format_progress(int(progress.get("rollout") or 0), total) if total else status.get("progressText")
    return out


def _transition_event(status: dict[str, Any], plan: Plan, phase: RLJobPhase, message: str, reason: str = "") -> None:
    if reason == PREEMPTED:
        # Each preemption is news (the phase may already be Restarting), and not a fault.
        plan.events.append(Event("Normal", PREEMPTED, message))
        return
    if status.get("phase") == phase.value:
        return
    warning = phase in (RLJobPhase.RESTARTING, RLJobPhase.FAILED)
    plan.events.append(Event("Warning" if warning else "Normal", phase.value, message))


def _phase(value: str | None) -> RLJobPhase:
    try:
        return RLJobPhase(value)
    except ValueError:
        return RLJobPhase.PENDING


def _spec_object(body: dict[str, Any]) -> dict[str, Any]:
    """The parts of the body parse_rljob reads (status is the operator's, not the user's)."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": body.get("spec"),
    }


def _first_error(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, render.RenderError):
        return exc.field, exc.message
    if isinstance(exc, SpecError) and exc.errors:
        if len(exc.errors) == 1:
            return exc.errors[0]
        return "", "; ".join(f"{p}: {m}" if p else m for p, m in exc.errors)
    return "", str(exc)


def configmap_spec_or_none(configmap: dict[str, Any] | None) -> dict[str, Any] | None:
    if configmap is None:
        return None
    try:
        return render.configmap_spec(configmap)
    except Exception:  # a ConfigMap someone edited into non-YAML: treat as absent  # noqa: BLE001
        return None


def _deadline_left(job: RLJob, meta: dict[str, Any], now: datetime) -> float | None:
    deadline = job.spec.active_deadline_seconds
    created = _parse_time(meta.get("creationTimestamp"))
    if deadline is None or created is None:
        return None
    return deadline - (now - created).total_seconds()


def _finished_at(status: dict[str, Any]) -> datetime | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False":
            return _parse_time(cond.get("lastTransitionTime"))
    return None


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None

"""Decide what to do for one RLJob, given everything observed about it. Pure: no API calls.

`reconcile(observed, settings) -> Plan`. The controller gathers `Observed` (the RLJob, its
RayJobs, ConfigMap, RBAC objects and the current attempt's pods), calls this, and carries the
plan out. Each branch of the decision names its outcome through one `_Decision` (what this
reconcile decides from, worked out once), which makes the whole frozen Plan of it. Being a function of observed state only (nothing remembered between calls), it is safe
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
that backoffLimit bounds are restarts.job - restarts.preemptions. When that status write failed (the
API server unreachable at that moment), the driver's exit code 143 in the RayJob's message, which
Ray's job server reports, says the same. Each RayJob carries the count
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
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from rlkube_runtime.spec import TERMINAL_PHASES, RLJob, RLJobPhase, format_progress
from rlkube_runtime.spec.contract import PREEMPTED_EXIT_CODE, fixed_fields
from rlkube_runtime.spec.load import SpecError, parse_rljob

from . import render
from .settings import OperatorSettings
from .status import (
    SPEC_CHANGE_IGNORED,
    Attempt,
    ConditionSpec,
    Reason,
    desired_conditions,
    merge_conditions,
    now_rfc3339,
    observe_rayjob,
    spec_refused_by_runtime,
)

INVALID_SPEC = Reason.INVALID_SPEC  # kept by name: the operator's tests and the chart read it

# Stamped on a failed RayJob when the operator first sees the failure (RFC 3339).
FAILED_AT_ANNOTATION = "rlkube.io/failed-at"
# On each RayJob: how many preemptions came before its attempt (see Preemptions above).
PREEMPTIONS_ANNOTATION = "rlkube.io/preemptions"
PREEMPTED = Reason.PREEMPTED
PREEMPTION_LIMIT_EXCEEDED = Reason.PREEMPTION_LIMIT_EXCEEDED
PREEMPTION_BACKOFF = Reason.PREEMPTION_BACKOFF_WAITING

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
    # Fresh random text for the job's API key, used if its Secret is created now (one that exists is kept).
    new_api_key: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: Reason | str  # a Reason, or the name of the phase the job entered
    message: str


@dataclass(frozen=True)
class Plan:
    """What the controller does, in this order: create, update the ConfigMap, patch RayJobs,
    delete RayJobs, patch the RLJob status, post events, delete the RLJob (TTL). Built whole by
    one branch of the decision; the controller only reads it."""

    create: tuple[dict[str, Any], ...] = ()
    update_configmap: dict[str, Any] | None = None
    patch_rayjobs: tuple[tuple[str, dict[str, Any]], ...] = ()
    delete_rayjobs: tuple[str, ...] = ()
    status: dict[str, Any] = field(default_factory=dict)  # the full operator-owned status wanted
    events: tuple[Event, ...] = ()
    delete_rljob: bool = False
    requeue_after: float | None = None
    permanent_error: str | None = None  # set when the spec itself is the problem
    # Why the RayJob this plan creates starts another attempt: "failure" or "preemption" (None:
    # the first attempt, or the current one made again). The restart counter's label.
    restart: str | None = None


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
    ref = render.JobRef.from_body(body)
    try:
        render.check_name(ref.name)
        job = parse_rljob(_spec_object(body), pod_policy=settings.pod_policy.allowance(ref.namespace))
        # Rendered once up front so a spec that cannot become pods creates nothing at all.
        render.render_rayjob(ref, job.spec, attempt=0, settings=settings)
    except (SpecError, render.RenderError) as exc:
        return _fail_permanently(obs, _first_error(exc))

    if (body.get("status") or {}).get("phase") in {p.value for p in TERMINAL_PHASES}:
        return _finished(obs, job)

    d = _Decision.of(obs, settings, ref, job)
    if obs.conflicts:
        return d.name_conflict()
    if d.held:
        try:
            job = parse_rljob({**_spec_object(body), "spec": d.spec},
                              pod_policy=settings.pod_policy.allowance(ref.namespace))
        except SpecError as exc:
            return _fail_permanently(obs, _first_error(exc))
    d = d.going_ahead(job)

    if d.deadline_left is not None and d.deadline_left <= 0:
        message = f"spec.activeDeadlineSeconds({job.spec.active_deadline_seconds}) passed; the job ran out of time"
        return d.finish(RLJobPhase.FAILED, Reason.DEADLINE_EXCEEDED, message,
                        delete=(d.name,) if d.current is not None else ())

    if d.current is None and job.spec.suspend and job.spec.queue_name:
        message = f"suspended: no RayJob while spec.suspend is true; resuming queues {d.name} in {job.spec.queue_name}"
        return d.active(RLJobPhase.SUSPENDED, Reason.SUSPENDED, message)
    if d.current is None:
        return d.start_attempt()
    if d.current["metadata"].get("deletionTimestamp"):
        # Someone deleted the current attempt's RayJob; make it again once it is gone.
        return d.active(_phase(d.status.get("phase")), Reason.RAYJOB_DELETING, f"RayJob {d.name} is being deleted",
                        requeue_after=min(2.0, settings.resync_seconds))

    attempt = observe_rayjob(d.current, obs.pods)
    if attempt.failed:
        return d.after_failure(attempt)
    if attempt.phase == RLJobPhase.SUCCEEDED:
        return d.finish(RLJobPhase.SUCCEEDED, attempt.reason, attempt.message, attempt=attempt)
    if is_queued_by_kueue(d.current):
        return d.under_kueue(attempt)
    return d.with_own_suspend(attempt)


@dataclass(frozen=True)
class _Decision:
    """What one reconcile decides from, worked out once: the observed state, the job, the current
    attempt n and its RayJob, the spec in force. Each branch of the decision names its outcome (a
    phase, reason and message, and the actions it takes) and these methods make the Plan of it,
    with the status, the events and the requeue that go with it."""

    obs: Observed
    settings: OperatorSettings
    job: RLJob
    ref: render.JobRef
    status: dict[str, Any]  # the RLJob's status as observed
    n: int  # the current attempt
    current: dict[str, Any] | None  # its RayJob, when it exists
    preemptions: int  # restarts after preemptions so far
    spec: dict[str, Any]  # the live spec with the immutable fields held at their running values
    held: tuple[str, ...]  # the immutable fields (spec.* paths) whose change was held back
    # Set by going_ahead: what every plan from then on also does, and the spec file wanted.
    create: tuple[dict[str, Any], ...] = ()
    delete: tuple[str, ...] = ()
    configmap: dict[str, Any] | None = None
    deadline_left: float | None = None

    @classmethod
    def of(cls, obs: Observed, settings: OperatorSettings, ref: render.JobRef, job: RLJob) -> _Decision:
        status = obs.rljob.get("status") or {}
        n = current_attempt(status, obs.rayjobs)
        name = render.rayjob_name(ref.name, n)
        current = next((rj for rj in obs.rayjobs if rj["metadata"]["name"] == name), None)
        spec, held = effective_spec(configmap_spec_or_none(obs.configmap), obs.rljob.get("spec") or {})
        return cls(obs, settings, job, ref, status, n, current, preemptions_so_far(status, obs.rayjobs), spec,
                   tuple(held))

    def going_ahead(self, job: RLJob) -> _Decision:
        """The job (parsed from the spec in force) goes ahead: every plan from here on creates the
        missing children and deletes the RayJobs of other attempts."""
        configmap = render.render_configmap(self.ref, self.spec)
        obs = self.obs
        missing = (
            (configmap, obs.configmap is None),
            (render.render_service_account(self.ref), not obs.service_account),
            (render.render_role(self.ref), not obs.role),
            (render.render_role_binding(self.ref), not obs.role_binding),
        )
        stale = tuple(rj["metadata"]["name"] for rj in obs.rayjobs
                      if rj is not self.current and not rj["metadata"].get("deletionTimestamp"))
        return replace(
            self, job=job, configmap=configmap, create=tuple(obj for obj, absent in missing if absent), delete=stale,
            deadline_left=_deadline_left(job, obs.rljob.get("metadata") or {}, obs.now),
        )

    @property
    def name(self) -> str:
        """The current attempt's RayJob."""
        return render.rayjob_name(self.ref.name, self.n)

    # --- the branches ---

    def name_conflict(self) -> Plan:
        message = (
            f"{', '.join(self.obs.conflicts)} already exist(s) and is not owned by this RLJob; delete or rename it "
            "(retrying)"
        )
        news = (Event("Warning", Reason.NAME_CONFLICT, message),) if self.status.get("message") != message else ()
        return self.active(_phase(self.status.get("phase")), Reason.NAME_CONFLICT, message, events=news)

    def start_attempt(self) -> Plan:
        """Create attempt n's RayJob."""
        try:
            rayjob = self._rayjob(self.n)
        except render.RenderError as exc:  # only when held fixed fields make a different spec
            return _fail_permanently(self.obs, (exc.field, exc.message), create=self.create, delete=self.delete)
        return self.active(*_created_phase(self.job, self.name, self.n), create=self._with_attempt_objects(rayjob),
                           refresh_configmap=True)

    def after_failure(self, attempt: Attempt) -> Plan:
        """Attempt n failed: Failed for good, a restart after its backoff, or a resume after a preemption."""
        ft = self.job.spec.fault_tolerance
        name, n = self.name, self.n
        refused = spec_refused_by_runtime(self.status, n)
        if refused is not None:
            message = (
                f"the runtime of attempt {n} (RayJob {name}) refused the spec: {refused}. Another attempt would be "
                "refused too: fix the spec and create the RLJob again"
            )
            return self.finish(RLJobPhase.FAILED, INVALID_SPEC, message, attempt=attempt, permanent_error=message)
        if attempt.permanent:
            return self.finish(RLJobPhase.FAILED, attempt.reason, attempt.message, attempt=attempt)
        if not ft.enabled:
            message = f"{attempt.message} (faultTolerance.enabled is false: no restart)"
            return self.finish(RLJobPhase.FAILED, attempt.reason, message, attempt=attempt)
        record = preemption_of(self.status, n)
        if record is None and attempt.exit_code == PREEMPTED_EXIT_CODE:
            record = {"attempt": n}  # stopped on SIGTERM, but its status.lastPreemption write failed
        if record is not None:
            return self.resume_after_preemption(record, attempt)
        failures = n - self.preemptions  # restarts after failures so far; backoffLimit bounds these
        if failures >= ft.backoff_limit:
            message = f"{attempt.message}; faultTolerance.backoffLimit({ft.backoff_limit}) restarts used up"
            return self.finish(RLJobPhase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED, message, attempt=attempt)

        delay = backoff_seconds(failures, ft.backoff_seconds, self.settings.max_backoff_seconds)
        restart_at, stamp = self._failed_at_plus(delay)
        if self.obs.now < restart_at:
            # No countdown in the message: status must not change on every reconcile.
            message = (
                f"{attempt.message}; attempt {n + 1} (restart {failures + 1} of {ft.backoff_limit}) starts at "
                f"{now_rfc3339(restart_at)} after a {delay:g}s backoff, from the latest checkpoint"
            )
            return self._wait_until(restart_at, Reason.BACKOFF_WAITING, message, attempt, stamp)

        # Backoff over: the next attempt replaces the failed one.
        new = self._rayjob(n + 1)
        message = (f"{attempt.message}; started attempt {n + 1} as RayJob {new['metadata']['name']}, resuming from "
                   "the latest checkpoint")
        return self._next_attempt(new, Reason.ATTEMPT_STARTED, message, self.preemptions, restart="failure", patch=stamp)

    def resume_after_preemption(self, record: dict[str, Any], attempt: Attempt) -> Plan:
        """Attempt n stopped on SIGTERM with its checkpoint saved: attempt n+1 resumes from it, counted
        as a preemption, not as a failure (backoffLimit untouched). The first preemption resumes at
        once; each further one waits backoffSeconds x 2^(p-1) for the p-th preemption before it
        (capped), so a job preempted again and again does not churn the cluster; past
        faultTolerance.maxPreemptions the job is Failed."""
        ft = self.job.spec.fault_tolerance
        count = self.preemptions + 1
        rollout = record.get("rollout")
        if "rollout" not in record:
            saved = f"its latest checkpoint (exit code {PREEMPTED_EXIT_CODE}; status.lastPreemption was not written)"
        elif rollout is None:
            saved = "nothing (no rollout was trained yet)"
        else:
            saved = f"the checkpoint of rollout {rollout}"
        preempted = f"RayJob {self.name} was preempted: its driver stopped on SIGTERM after saving {saved}"
        if count > ft.max_preemptions:
            message = (f"{preempted}; faultTolerance.maxPreemptions({ft.max_preemptions}) used up: the job was "
                       f"preempted {count} times. Its checkpoints are kept: raise maxPreemptions and create it again "
                       "to resume")
            return self.finish(RLJobPhase.FAILED, PREEMPTION_LIMIT_EXCEEDED, message, attempt=attempt)
        stamp: tuple[tuple[str, dict[str, Any]], ...] = ()
        if self.preemptions:
            delay = backoff_seconds(self.preemptions - 1, ft.backoff_seconds, self.settings.max_backoff_seconds)
            restart_at, stamp = self._failed_at_plus(delay)
            if self.obs.now < restart_at:
                message = (f"{preempted}; attempt {self.n + 1} starts at {now_rfc3339(restart_at)} after a {delay:g}s "
                           f"backoff (preemption {count} of at most {ft.max_preemptions}), from that checkpoint")
                return self._wait_until(restart_at, PREEMPTION_BACKOFF, message, attempt, stamp)
        new = self._rayjob(self.n + 1)
        new["metadata"].setdefault("annotations", {})[PREEMPTIONS_ANNOTATION] = str(count)
        message = (
            f"{preempted}; started attempt {self.n + 1} as RayJob {new['metadata']['name']}, resuming from it "
            f"(preemption {count} of at most {ft.max_preemptions}, not counted against "
            f"faultTolerance.backoffLimit({ft.backoff_limit}))"
        )
        return self._next_attempt(new, PREEMPTED, message, count, restart="preemption", patch=stamp)

    def _failed_at_plus(self, delay: float) -> tuple[datetime, tuple[tuple[str, dict[str, Any]], ...]]:
        """When the current attempt's restart is due, `delay` seconds after it was first seen ended
        (stamped on its RayJob, so a restarted operator waits out the same backoff), and the stamp
        to write when it is not there yet."""
        now = self.obs.now
        failed_at = _parse_time((self.current["metadata"].get("annotations") or {}).get(FAILED_AT_ANNOTATION))
        stamp: tuple[tuple[str, dict[str, Any]], ...] = ()
        if failed_at is None:
            failed_at = now
            stamp = ((self.name, {"metadata": {"annotations": {FAILED_AT_ANNOTATION: now_rfc3339(now)}}}),)
        return failed_at + timedelta(seconds=delay), stamp

    def _wait_until(self, restart_at: datetime, reason: Reason, message: str, attempt: Attempt,
                    stamp: tuple[tuple[str, dict[str, Any]], ...]) -> Plan:
        """Restarting, the next attempt due at `restart_at`."""
        return self.active(RLJobPhase.RESTARTING, reason, message, attempt=attempt, patch=stamp,
                           requeue_after=max((restart_at - self.obs.now).total_seconds(), 0.1))

    def under_kueue(self, attempt: Attempt) -> Plan:
        """A Kueue-managed RayJob, whose suspend flag the operator never writes.

        spec.suspend deletes it: setting its flag would be undone by Kueue while the workload stays
        admitted, and deleting also frees the quota. Suspended by Kueue (not yet admitted, or
        preempted) is Queued; the spec file is kept current then, as the runtime reads it when Kueue
        starts the job. Just admitted (KubeRay not caught up yet) is Starting.
        """
        name = self.name
        queue = self.current["metadata"]["labels"][render.KUEUE_QUEUE_LABEL]
        if self.job.spec.suspend:
            message = f"deleting RayJob {name} and its place in LocalQueue {queue}; resuming queues it again"
            return self.active(RLJobPhase.SUSPENDED, Reason.SUSPENDING, message, attempt=attempt, delete=(name,))
        if (self.current.get("spec") or {}).get("suspend"):
            message = f"RayJob {name} waits for Kueue to admit it from LocalQueue {queue}"
            return self.active(RLJobPhase.QUEUED, Reason.QUEUED, message, attempt=attempt, refresh_configmap=True)
        if attempt.phase in (RLJobPhase.SUSPENDED, RLJobPhase.PENDING):
            message = f"Kueue admitted RayJob {name}; the Ray cluster is coming up"
            return self.active(RLJobPhase.STARTING, Reason.ADMITTED, message, attempt=attempt)
        return self.active(attempt.phase, attempt.reason, attempt.message, attempt=attempt)

    def with_own_suspend(self, attempt: Attempt) -> Plan:
        """A RayJob without Kueue: bring its suspend flag to spec.suspend."""
        name = self.name
        want = bool(self.job.spec.suspend)
        patch: tuple[tuple[str, dict[str, Any]], ...] = ()
        if bool((self.current.get("spec") or {}).get("suspend")) != want:
            patch = ((name, {"spec": {"suspend": want}}),)
        # A resumed attempt starts the runtime again: it reads the spec then.
        resuming = bool(patch) and not want
        if want and attempt.phase != RLJobPhase.SUSPENDED:
            phase, reason, message = (RLJobPhase.SUSPENDED, Reason.SUSPENDING,
                                      f"suspending RayJob {name}: its pods are being deleted")
        elif not want and attempt.phase == RLJobPhase.SUSPENDED:
            phase, reason, message = RLJobPhase.STARTING, Reason.RESUMING, f"resuming RayJob {name} from the latest checkpoint"
        else:
            phase, reason, message = attempt.phase, attempt.reason, attempt.message
        return self.active(phase, reason, message, attempt=attempt, patch=patch, refresh_configmap=resuming)

    # --- making the plan ---

    def active(self, phase: RLJobPhase, reason: Reason, message: str, *, requeue_after: float | None = None,
               **actions: Any) -> Plan:
        """A job still going: looked at again after requeue_after seconds, the resync period by default."""
        wait = self.settings.resync_seconds if requeue_after is None else requeue_after
        return self._plan(phase, reason, message, requeue_after=wait, **actions)

    def finish(self, phase: RLJobPhase, reason: Reason, message: str, **actions: Any) -> Plan:
        """A job ending: looked at again when its ttlSecondsAfterFinished passes, to delete it (see _finished)."""
        ttl = self.job.spec.ttl_seconds_after_finished
        return self._plan(phase, reason, message, requeue_after=None if ttl is None else max(float(ttl), 0.1),
                          **actions)

    def _next_attempt(self, new: dict[str, Any], reason: Reason, message: str, preemptions: int, *, restart: str,
                      patch: tuple[tuple[str, dict[str, Any]], ...] = ()) -> Plan:
        """RayJob `new` of attempt n+1 replaces attempt n's, after its failure or preemption (`restart`)."""
        return self.active(RLJobPhase.RESTARTING, reason, message, n=self.n + 1, preemptions=preemptions,
                           create=self._with_attempt_objects(new), delete=(self.name,), patch=patch,
                           refresh_configmap=True, restart=restart)

    def _with_attempt_objects(self, rayjob: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        """An attempt's RayJob after what its pods need to exist first: the job's API key and its
        NetworkPolicy (created with every attempt, kept where they exist: the operator may create
        Secrets but not read them, so it cannot look)."""
        return (render.render_api_key_secret(self.ref, self.obs.new_api_key),
                render.render_network_policy(self.ref, self.settings), rayjob)

    def _rayjob(self, attempt: int) -> dict[str, Any]:
        return render.render_rayjob(self.ref, self.job.spec, attempt=attempt, settings=self.settings,
                                    active_deadline_seconds=self.deadline_left)

    def _plan(
        self,
        phase: RLJobPhase,
        reason: Reason,
        message: str,
        *,
        requeue_after: float | None,
        attempt: Attempt | None = None,
        n: int | None = None,
        preemptions: int | None = None,
        create: tuple[dict[str, Any], ...] = (),
        delete: tuple[str, ...] = (),
        patch: tuple[tuple[str, dict[str, Any]], ...] = (),
        refresh_configmap: bool = False,
        events: tuple[Event, ...] = (),
        permanent_error: str | None = None,
        restart: str | None = None,
    ) -> Plan:
        """The plan: this branch's actions after the standing ones, the whole operator-owned status
        for attempt n (the current one unless given), its events, then the branch's own events."""
        status, status_events = self._status(phase, reason, message, attempt, self.n if n is None else n,
                                             self.preemptions if preemptions is None else preemptions)
        return Plan(
            create=self.create + create,
            update_configmap=self._configmap_update() if refresh_configmap else None,
            patch_rayjobs=patch,
            delete_rayjobs=self.delete + delete,
            status=status,
            events=status_events + events,
            requeue_after=requeue_after,
            permanent_error=permanent_error,
            restart=restart,
        )

    def _configmap_update(self) -> dict[str, Any] | None:
        """The spec file brought up to date, when it exists and is not: the runtime reads it when an
        attempt starts or resumes."""
        existing = self.obs.configmap
        if existing is None or self.configmap is None or existing.get("data") == self.configmap["data"]:
            return None
        return self.configmap

    def _status(self, phase: RLJobPhase, reason: Reason, message: str, attempt: Attempt | None, n: int,
                preemptions: int) -> tuple[dict[str, Any], tuple[Event, ...]]:
        """The whole operator-owned status, and the events of its changes."""
        status = self.status
        generation = self.obs.rljob["metadata"].get("generation")
        wanted = desired_conditions(phase, reason, message)
        events: tuple[Event, ...] = ()
        drop: tuple[str, ...] = ()
        if self.held:
            note = (
                f"{', '.join(self.held)} cannot change while the job exists; the job keeps running with the values "
                "it started with (delete and re-create the RLJob to change them)"
            )
            wanted.append(ConditionSpec(SPEC_CHANGE_IGNORED, "True", Reason.IMMUTABLE_FIELD, note))
            old = next((c for c in status.get("conditions") or [] if c.get("type") == SPEC_CHANGE_IGNORED), {})
            if old.get("status") != "True" or old.get("message") != note:
                events = (Event("Warning", Reason.SPEC_CHANGE_IGNORED, note),)
        else:
            drop = (SPEC_CHANGE_IGNORED,)
        conditions = merge_conditions(status.get("conditions") or [], wanted, now=self.obs.now, generation=generation,
                                      drop=drop)
        new = {
            **_carry(status, generation=generation, num_rollout=self.job.spec.training.num_rollout),
            "phase": phase.value,
            "message": message,
            "conditions": conditions,
            "rayJobName": render.rayjob_name(self.ref.name, n),
            "rayClusterName": attempt.ray_cluster_name if attempt else None,
            "dashboardUrl": attempt.dashboard_url if attempt else None,
            "restarts": {"job": n, "preemptions": preemptions},
        }
        return new, events + _transition_events(status, phase, message, reason)


def _created_phase(job: RLJob, name: str, n: int) -> tuple[RLJobPhase, Reason, str]:
    """Phase, reason and message right after creating RayJob `name` of attempt n."""
    created = f"created RayJob {name} (attempt {n})"
    if job.spec.suspend:
        return RLJobPhase.SUSPENDED, Reason.SUSPENDED, f"{created}, suspended"
    if job.spec.queue_name:
        queue = job.spec.queue_name
        return RLJobPhase.QUEUED, Reason.QUEUED, f"{created}, suspended until Kueue admits it from LocalQueue {queue}"
    return RLJobPhase.PENDING, Reason.RAYJOB_CREATED, created


def is_queued_by_kueue(rayjob: dict[str, Any]) -> bool:
    """Whether the RayJob carries Kueue's queue-name label, which makes its suspend flag Kueue's."""
    return bool((rayjob.get("metadata", {}).get("labels") or {}).get(render.KUEUE_QUEUE_LABEL))


def _finished(obs: Observed, job: RLJob) -> Plan:
    """Succeeded or Failed already: keep the status, delete the RLJob once its TTL has passed."""
    status = obs.rljob.get("status") or {}
    kept = _carry(status, generation=obs.rljob["metadata"].get("generation"), num_rollout=job.spec.training.num_rollout)
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is None:
        return Plan(status=kept)
    finished = _finished_at(status) or obs.now
    left = (finished + timedelta(seconds=ttl) - obs.now).total_seconds()
    if left <= 0:
        passed = Event("Normal", Reason.DELETING, f"ttlSecondsAfterFinished({ttl}) passed since the job finished")
        return Plan(status=kept, events=(passed,), delete_rljob=True)
    return Plan(status=kept, requeue_after=left)


def refused_by_api_server(obs: Observed, kind: str, name: str, message: str) -> Plan:
    """The API server refused to create `kind` `name` as invalid (422) while this RLJob's plan was
    carried out: the job is Failed (InvalidSpec) with the server's message, never retried."""
    text = (f"the API server refused {kind} {name} as invalid: {message}. The spec renders it the same way on "
            "every try: fix the spec and create the RLJob again")
    return _fail_permanently(obs, ("", text))


def _fail_permanently(obs: Observed, error: tuple[str, str], *, create: tuple[dict[str, Any], ...] = (),
                      delete: tuple[str, ...] = ()) -> Plan:
    """Failed for the spec itself (InvalidSpec), after `create` and `delete` where the job had gone that far."""
    path, text = error
    message = f"{path}: {text}" if path else text
    status = obs.rljob.get("status") or {}
    phase = RLJobPhase.FAILED
    generation = obs.rljob["metadata"].get("generation")
    conditions = merge_conditions(
        status.get("conditions") or [], desired_conditions(phase, INVALID_SPEC, message), now=obs.now,
        generation=generation,
    )
    failed = {
        **_carry(status, generation=generation, num_rollout=None),
        "phase": phase.value,
        "message": message,
        "conditions": conditions,
    }
    return Plan(create=create, delete_rayjobs=delete, status=failed, events=_transition_events(status, phase, message),
                permanent_error=message)


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


def _transition_events(status: dict[str, Any], phase: RLJobPhase, message: str,
                       reason: Reason | None = None) -> tuple[Event, ...]:
    if reason == PREEMPTED:
        # Each preemption is news (the phase may already be Restarting), and not a fault.
        return (Event("Normal", PREEMPTED, message),)
    if status.get("phase") == phase.value:
        return ()
    if reason == PREEMPTION_BACKOFF:
        return (Event("Normal", PREEMPTED, message),)
    warning = phase in (RLJobPhase.RESTARTING, RLJobPhase.FAILED)
    return (Event("Warning" if warning else "Normal", phase.value, message),)


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

"""What the operator decides to do for one RLJob, given what it observed."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta

import pytest
from operator_testutil import CREATED, NOW, make_body, observed, rayjob_with_status
from rlkube_operator import render
from rlkube_operator.reconcile import (
    FAILED_AT_ANNOTATION,
    PREEMPTIONS_ANNOTATION,
    backoff_seconds,
    current_attempt,
    preemptions_so_far,
    reconcile,
)
from rlkube_operator.status import status_changes

RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": "tiny-0-x1y2z"}
FAILED = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed", "message": "trainer crashed"}


def _kinds(plan):
    return [(o["kind"], o["metadata"]["name"]) for o in plan.create]


def _attempt(rayjob):
    """What creating an attempt's RayJob comes with: the job's API key and its NetworkPolicy first."""
    return [("Secret", "tiny-api-key"), ("NetworkPolicy", "tiny"), ("RayJob", rayjob)]


def _conditions(plan):
    return {c["type"]: c for c in plan.status["conditions"]}


def _apply_status(body, plan):
    """The body as it looks after the controller wrote plan.status."""
    body = copy.deepcopy(body)
    status = body.setdefault("status", {})
    for key, value in status_changes(status, plan.status).items():
        if value is None:
            status.pop(key, None)
        elif key == "restarts":
            status.setdefault("restarts", {}).update(value)
        else:
            status[key] = value
    return body


def test_a_new_rljob_gets_its_configmap_rbac_and_first_rayjob(settings):
    body = make_body()
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert _kinds(plan) == [
        ("ConfigMap", "tiny-spec"), ("ServiceAccount", "tiny-runtime"), ("Role", "tiny-runtime"),
        ("RoleBinding", "tiny-runtime"), *_attempt("tiny-0"),
    ]
    assert plan.status["phase"] == "Pending"
    assert plan.status["rayJobName"] == "tiny-0"
    assert plan.status["restarts"] == {"job": 0, "preemptions": 0}
    assert plan.status["progressText"] == "0/10"
    assert plan.status["observedGeneration"] == 1
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Pending")]
    assert plan.requeue_after == settings.resync_seconds


def test_missing_children_are_recreated_without_touching_the_running_rayjob(settings):
    body = make_body(status={"phase": "Running"})
    rj = rayjob_with_status(body, 0, RUNNING)
    plan = reconcile(observed(body, [rj], children=False), settings)
    assert _kinds(plan) == [("ServiceAccount", "tiny-runtime"), ("Role", "tiny-runtime"), ("RoleBinding", "tiny-runtime")]
    assert not plan.delete_rayjobs and not plan.patch_rayjobs


def test_a_plan_is_decided_once_and_cannot_be_changed_afterwards(settings):
    plan = reconcile(observed(make_body()), settings)
    assert isinstance(plan.create, tuple) and isinstance(plan.events, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.requeue_after = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.status_patch = {}  # the controller reports what it wrote apart from the plan


def test_running_rayjob_makes_the_rljob_running_and_ready(settings):
    body = make_body(status={"phase": "Starting", "progress": {"rollout": 3, "numRollout": 10}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)]), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Running"
    assert plan.status["rayClusterName"] == "tiny-0-x1y2z"
    assert plan.status["progressText"] == "3/10"
    assert _conditions(plan)["Ready"]["status"] == "True"
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Running")]


def test_reconciling_again_after_writing_the_status_changes_nothing(settings):
    body = make_body()
    first = reconcile(observed(body, configmap=None, children=False), settings)
    body = _apply_status(body, first)
    rj = rayjob_with_status(body, 0, RUNNING)
    second = reconcile(observed(body, [rj], now=NOW + timedelta(seconds=5)), settings)
    body = _apply_status(body, second)
    third = reconcile(observed(body, [rj], now=NOW + timedelta(seconds=10)), settings)
    assert third.create == () and third.delete_rayjobs == () and third.patch_rayjobs == ()
    assert status_changes(body["status"], third.status) == {}
    assert third.events == ()


def test_a_failed_attempt_waits_its_backoff_stamping_the_failure_on_the_rayjob(settings):
    body = make_body({"faultTolerance": {"backoffSeconds": 10, "backoffLimit": 3}}, status={"phase": "Running"})
    rj = rayjob_with_status(body, 0, FAILED)
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.status["phase"] == "Restarting"
    assert plan.create == () and plan.delete_rayjobs == ()
    assert plan.patch_rayjobs == (("tiny-0", {"metadata": {"annotations": {FAILED_AT_ANNOTATION: "2026-03-01T12:00:00Z"}}}),)
    assert plan.requeue_after == pytest.approx(10)
    assert "attempt 1 (restart 1 of 3) starts at 2026-03-01T12:00:10Z" in plan.status["message"]
    assert "trainer crashed" in plan.status["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Restarting")]


def test_the_backoff_survives_an_operator_restart(settings):
    body = make_body({"faultTolerance": {"backoffSeconds": 10}}, status={"phase": "Restarting"})
    stamped = (NOW - timedelta(seconds=4)).strftime("%Y-%m-%dT%H:%M:%SZ")
    rj = rayjob_with_status(body, 0, FAILED, annotations={FAILED_AT_ANNOTATION: stamped})
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.patch_rayjobs == ()
    assert plan.requeue_after == pytest.approx(6)


def test_after_the_backoff_the_next_attempt_replaces_the_failed_one(settings):
    body = make_body({"faultTolerance": {"backoffSeconds": 10}}, status={"phase": "Restarting", "restarts": {"job": 1}})
    stamped = (NOW - timedelta(seconds=21)).strftime("%Y-%m-%dT%H:%M:%SZ")  # attempt 1 waits 10 x 2^1 = 20 s
    rj = rayjob_with_status(body, 1, FAILED, annotations={FAILED_AT_ANNOTATION: stamped})
    plan = reconcile(observed(body, [rj]), settings)
    assert _kinds(plan) == _attempt("tiny-2")
    assert plan.create[-1]["metadata"]["labels"][render.LABEL_ATTEMPT] == "2"
    assert plan.delete_rayjobs == ("tiny-1",)
    assert plan.status["restarts"] == {"job": 2, "preemptions": 0}
    assert plan.status["rayJobName"] == "tiny-2"


def test_a_restart_whose_status_write_was_lost_is_not_done_twice(settings):
    body = make_body(status={"phase": "Restarting", "restarts": {"job": 0}})
    old = rayjob_with_status(body, 0, FAILED)
    new = rayjob_with_status(body, 1, {"jobDeploymentStatus": "Initializing"})
    plan = reconcile(observed(body, [old, new]), settings)
    assert plan.create == ()
    assert plan.delete_rayjobs == ("tiny-0",)
    assert plan.status["restarts"] == {"job": 1, "preemptions": 0}
    assert plan.status["phase"] == "Starting"
    assert current_attempt(body["status"], [old, new]) == 1


def test_restarts_stop_at_the_backoff_limit(settings):
    body = make_body({"faultTolerance": {"backoffLimit": 2}}, status={"phase": "Running", "restarts": {"job": 2}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 2, FAILED)]), settings)
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit(2) restarts used up" in plan.status["message"]
    assert plan.create == () and plan.delete_rayjobs == ()
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Failed")]


def test_without_fault_tolerance_the_first_failure_is_final(settings):
    body = make_body({"faultTolerance": {"enabled": False}}, status={"phase": "Running"})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, FAILED)]), settings)
    assert plan.status["phase"] == "Failed"
    assert "faultTolerance.enabled is false" in plan.status["message"]


def test_a_deadline_failure_is_not_retried(settings):
    body = make_body(status={"phase": "Running"})
    rj = rayjob_with_status(body, 0, {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"})
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "DeadlineExceeded"


# Ray's job server after `rlkube run` exited 143 on SIGTERM: the Ray job failed like any other.
PREEMPTED_EXIT = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
                  "message": "Job entrypoint command failed with exit code 143"}


def test_a_preempted_attempt_resumes_at_once_without_counting_against_the_backoff_limit(settings):
    # backoffLimit 1 with one failure already used: a failure now would be final.
    body = make_body({"faultTolerance": {"backoffSeconds": 60, "backoffLimit": 1}},
                     status={"phase": "Running", "restarts": {"job": 1},
                             "lastPreemption": {"attempt": 1, "rollout": 7, "time": "2026-03-01T11:59:58Z"}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 1, PREEMPTED_EXIT)]), settings)
    assert _kinds(plan) == _attempt("tiny-2")  # no backoff wait
    assert plan.create[-1]["metadata"]["annotations"][PREEMPTIONS_ANNOTATION] == "1"
    assert plan.delete_rayjobs == ("tiny-1",)
    assert plan.patch_rayjobs == ()  # no failure time stamped: there is no backoff to wait out
    assert plan.status["phase"] == "Restarting"
    assert plan.status["restarts"] == {"job": 2, "preemptions": 1}
    assert plan.status["rayJobName"] == "tiny-2"
    assert _conditions(plan)["Progressing"]["reason"] == "Preempted"
    assert "after saving the checkpoint of rollout 7" in plan.status["message"]
    assert "not counted against faultTolerance.backoffLimit(1)" in plan.status["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Preempted")]


def test_a_preemption_whose_status_write_failed_is_known_by_the_drivers_exit_code(settings):
    # The runtime could not write status.lastPreemption (API server unreachable); Ray's job server
    # still reported `rlkube run`'s exit code 143.
    body = make_body({"faultTolerance": {"backoffSeconds": 60, "backoffLimit": 1}},
                     status={"phase": "Running", "restarts": {"job": 1}})
    exit_143 = PREEMPTED_EXIT | {"message": PREEMPTED_EXIT["message"] + ", last available logs: rlkube run: stopped"}
    plan = reconcile(observed(body, [rayjob_with_status(body, 1, exit_143)]), settings)
    assert _kinds(plan) == _attempt("tiny-2")  # at once, and not the failure that would end the job
    assert plan.status["restarts"] == {"job": 2, "preemptions": 1}
    assert _conditions(plan)["Progressing"]["reason"] == "Preempted"
    assert "after saving its latest checkpoint (exit code 143; status.lastPreemption was not written)" in (
        plan.status["message"])
    # Any other exit code is a failure: backoffLimit 1 is used up, so the job fails.
    exit_1 = PREEMPTED_EXIT | {"message": "Job entrypoint command failed with exit code 1"}
    plan = reconcile(observed(body, [rayjob_with_status(body, 1, exit_1)]), settings)
    assert _conditions(plan)["Failed"]["reason"] == "BackoffLimitExceeded"


def test_after_a_preemption_the_failures_alone_count_against_the_backoff_limit(settings):
    # Attempts 0 and 1 were preempted, attempt 2 fails: that is the first failure of backoffLimit 1.
    body = make_body({"faultTolerance": {"backoffSeconds": 10, "backoffLimit": 1}},
                     status={"phase": "Running", "restarts": {"job": 2, "preemptions": 2},
                             "lastPreemption": {"attempt": 1, "rollout": 3}})  # about an older attempt
    plan = reconcile(observed(body, [rayjob_with_status(body, 2, FAILED)]), settings)
    assert plan.status["phase"] == "Restarting"
    assert plan.create == ()
    assert plan.requeue_after == pytest.approx(10)  # 10 x 2^0: the backoff of the first failure
    assert "attempt 3 (restart 1 of 1)" in plan.status["message"]
    assert plan.status["restarts"] == {"job": 2, "preemptions": 2}
    # Its second failure is final.
    body["status"] |= {"restarts": {"job": 3, "preemptions": 2}}
    plan = reconcile(observed(body, [rayjob_with_status(body, 3, FAILED)]), settings)
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "BackoffLimitExceeded"


def test_repeated_preemptions_back_off_exponentially_from_the_second_on(settings):
    # Two preemptions so far; the third waits backoffSeconds x 2^(2-1) = 20 s after the attempt ended.
    body = make_body({"faultTolerance": {"backoffSeconds": 10}},
                     status={"phase": "Running", "restarts": {"job": 2, "preemptions": 2},
                             "lastPreemption": {"attempt": 2, "rollout": 9}})
    current = rayjob_with_status(body, 2, PREEMPTED_EXIT)
    plan = reconcile(observed(body, [current]), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Restarting"
    assert plan.requeue_after == pytest.approx(20)
    assert plan.patch_rayjobs == (("tiny-2", {"metadata": {"annotations": {FAILED_AT_ANNOTATION: "2026-03-01T12:00:00Z"}}}),)
    assert "after a 20s backoff (preemption 3 of at most 10)" in plan.status["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Preempted")]  # news, not a fault
    # 20 s after the stamped end, attempt 3 starts; its reconciles meanwhile post nothing new.
    current["metadata"]["annotations"] = {FAILED_AT_ANNOTATION: "2026-03-01T12:00:00Z"}
    waiting = _apply_status(body, plan)
    plan = reconcile(observed(waiting, [current], now=NOW + timedelta(seconds=5)), settings)
    assert (plan.create, plan.events) == ((), ())
    plan = reconcile(observed(waiting, [current], now=NOW + timedelta(seconds=20)), settings)
    assert _kinds(plan) == _attempt("tiny-3")
    assert plan.status["restarts"] == {"job": 3, "preemptions": 3}


def test_the_backoff_between_preemptions_is_capped_by_the_operator(settings):
    body = make_body({"faultTolerance": {"backoffSeconds": 10, "maxPreemptions": 100}},
                     status={"phase": "Running", "restarts": {"job": 30, "preemptions": 30},
                             "lastPreemption": {"attempt": 30, "rollout": 9}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 30, PREEMPTED_EXIT)]), settings)
    assert plan.requeue_after == pytest.approx(settings.max_backoff_seconds)


def test_a_job_preempted_more_than_max_preemptions_fails_keeping_its_checkpoints(settings):
    body = make_body({"faultTolerance": {"maxPreemptions": 2}},
                     status={"phase": "Running", "restarts": {"job": 2, "preemptions": 2},
                             "lastPreemption": {"attempt": 2, "rollout": 9}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 2, PREEMPTED_EXIT)]), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "PreemptionLimitExceeded"
    assert "faultTolerance.maxPreemptions(2) used up: the job was preempted 3 times" in plan.status["message"]


def test_a_preemption_restart_whose_status_write_was_lost_is_counted_once(settings):
    body = make_body(status={"phase": "Running", "restarts": {"job": 0},
                             "lastPreemption": {"attempt": 0, "rollout": 4}})
    old = rayjob_with_status(body, 0, PREEMPTED_EXIT)
    new = rayjob_with_status(body, 1, {"jobDeploymentStatus": "Initializing"},
                             annotations={PREEMPTIONS_ANNOTATION: "1"})
    assert preemptions_so_far(body["status"], [old, new]) == 1
    plan = reconcile(observed(body, [old, new]), settings)
    assert plan.create == ()
    assert plan.delete_rayjobs == ("tiny-0",)
    assert plan.status["restarts"] == {"job": 1, "preemptions": 1}
    assert plan.status["phase"] == "Starting"


def test_a_preempted_attempt_is_not_restarted_when_fault_tolerance_is_off(settings):
    body = make_body({"faultTolerance": {"enabled": False}},
                     status={"phase": "Running", "lastPreemption": {"attempt": 0, "rollout": 4}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, PREEMPTED_EXIT)]), settings)
    assert plan.status["phase"] == "Failed"
    assert plan.create == ()


def test_a_preemption_record_of_the_running_attempt_changes_nothing_until_it_ends(settings):
    body = make_body(status={"phase": "Running", "lastPreemption": {"attempt": 0, "rollout": 4}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)]), settings)
    assert plan.create == () and plan.delete_rayjobs == ()
    assert plan.status["phase"] == "Running"
    assert plan.events == ()


@pytest.mark.parametrize(("restarts", "base", "cap", "expected"), [
    (0, 10, 300, 10), (1, 10, 300, 20), (3, 10, 300, 80), (5, 10, 300, 300), (2, 0, 300, 0), (1, 1, 300, 2),
])
def test_backoff_doubles_per_restart_up_to_the_cap(restarts, base, cap, expected):
    assert backoff_seconds(restarts, base, cap) == expected


def test_suspending_a_running_job_suspends_its_rayjob(settings):
    body = make_body({"suspend": True}, status={"phase": "Running"})
    rj = rayjob_with_status(body, 0, RUNNING)
    rj["spec"]["suspend"] = False  # as it was created, before the user set spec.suspend
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.patch_rayjobs == (("tiny-0", {"spec": {"suspend": True}}),)
    assert plan.status["phase"] == "Suspended"
    assert _conditions(plan)["Suspended"]["status"] == "True"
    assert _conditions(plan)["Progressing"]["reason"] == "Suspending"


def test_a_suspended_rayjob_stays_quietly_suspended(settings):
    body = make_body({"suspend": True}, status={"phase": "Suspended"})
    rj = rayjob_with_status(body, 0, {"jobDeploymentStatus": "Suspended"})
    rj["spec"]["suspend"] = True
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.patch_rayjobs == () and plan.events == ()
    assert plan.status["phase"] == "Suspended"


def test_resuming_unsuspends_the_rayjob_and_refreshes_the_spec_file(settings):
    old_body = make_body()
    body = make_body({"suspend": False, "training": {"numRollout": 20}}, status={"phase": "Suspended"})
    rj = rayjob_with_status(body, 0, {"jobDeploymentStatus": "Suspended"})
    rj["spec"]["suspend"] = True
    cm = render.render_configmap(render.JobRef.from_body(old_body), old_body["spec"])
    plan = reconcile(observed(body, [rj], configmap=cm), settings)
    assert plan.patch_rayjobs == (("tiny-0", {"spec": {"suspend": False}}),)
    assert plan.status["phase"] == "Starting"
    assert plan.update_configmap is not None
    assert render.configmap_spec(plan.update_configmap)["training"]["numRollout"] == 20


def test_a_job_created_suspended_gets_a_suspended_rayjob(settings):
    body = make_body({"suspend": True})
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    rayjob = plan.create[-1]
    assert rayjob["spec"]["suspend"] is True
    assert plan.status["phase"] == "Suspended"


# --- Kueue (spec.queueName): the RayJob's suspend flag is Kueue's -----------------------------------

QUEUE = {"queueName": "team-a-gpus"}
KUEUE_SUSPENDED = {"jobDeploymentStatus": "Suspended"}


def _queued_rayjob(body, status, *, suspend):
    """The RayJob of a queued RLJob as Kueue left it: suspended (waiting, preempted) or admitted."""
    rj = rayjob_with_status(body, 0, status)
    assert rj["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "team-a-gpus"
    rj["spec"]["suspend"] = suspend
    return rj


def test_a_queued_job_gets_a_suspended_rayjob_labelled_for_kueue(settings):
    body = make_body(QUEUE)
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    rayjob = plan.create[-1]
    assert rayjob["spec"]["suspend"] is True
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert plan.status["phase"] == "Queued"
    assert "until Kueue admits it from LocalQueue team-a-gpus" in plan.status["message"]
    # Waiting in a queue is progress toward running, not a suspension the user asked for.
    assert _conditions(plan)["Progressing"]["status"] == "True"
    assert _conditions(plan)["Suspended"]["status"] == "False"
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Queued")]


@pytest.mark.parametrize("status", [{}, {"jobDeploymentStatus": "Initializing"}, KUEUE_SUSPENDED],
                         ids=["new", "initializing", "suspended"])
def test_a_rayjob_waiting_for_kueue_is_queued_and_left_suspended(settings, status):
    body = make_body(QUEUE, status={"phase": "Queued"})
    plan = reconcile(observed(body, [_queued_rayjob(body, status, suspend=True)]), settings)
    assert plan.patch_rayjobs == () and plan.delete_rayjobs == () and plan.create == ()
    assert plan.status["phase"] == "Queued"
    assert plan.status["message"] == "RayJob tiny-0 waits for Kueue to admit it from LocalQueue team-a-gpus"
    assert plan.events == ()


@pytest.mark.parametrize("status", [KUEUE_SUSPENDED, {}], ids=["kuberay-not-caught-up", "kuberay-reset-to-new"])
def test_admission_by_kueue_is_not_undone_and_the_job_starts(settings, status):
    body = make_body(QUEUE, status={"phase": "Queued"})
    plan = reconcile(observed(body, [_queued_rayjob(body, status, suspend=False)]), settings)
    assert plan.patch_rayjobs == ()  # the RLJob's suspend (false) is not pushed onto Kueue's flag
    assert plan.status["phase"] == "Starting"
    assert _conditions(plan)["Progressing"]["reason"] == "Admitted"


def test_an_admitted_rayjob_runs_and_its_phase_follows_kuberay(settings):
    body = make_body(QUEUE, status={"phase": "Starting"})
    plan = reconcile(observed(body, [_queued_rayjob(body, RUNNING, suspend=False)]), settings)
    assert plan.patch_rayjobs == ()
    assert plan.status["phase"] == "Running"


def test_preemption_by_kueue_queues_the_job_again_without_a_fight(settings):
    body = make_body(QUEUE, status={"phase": "Running"})
    plan = reconcile(observed(body, [_queued_rayjob(body, RUNNING, suspend=True)]), settings)
    assert plan.patch_rayjobs == () and plan.delete_rayjobs == ()
    assert plan.status["phase"] == "Queued"


def test_a_queued_job_keeps_its_spec_file_current_for_when_kueue_starts_it(settings):
    old_body = make_body(QUEUE)
    body = make_body({**QUEUE, "training": {"numRollout": 20}}, status={"phase": "Queued"})
    cm = render.render_configmap(render.JobRef.from_body(old_body), old_body["spec"])
    plan = reconcile(observed(body, [_queued_rayjob(body, KUEUE_SUSPENDED, suspend=True)], configmap=cm), settings)
    assert render.configmap_spec(plan.update_configmap)["training"]["numRollout"] == 20


@pytest.mark.parametrize("status, suspend", [(KUEUE_SUSPENDED, True), (RUNNING, False)], ids=["queued", "admitted"])
def test_suspending_a_queued_job_deletes_its_rayjob_instead_of_touching_kueues_flag(settings, status, suspend):
    body = make_body({**QUEUE, "suspend": True}, status={"phase": "Running"})
    plan = reconcile(observed(body, [_queued_rayjob(body, status, suspend=suspend)]), settings)
    assert plan.patch_rayjobs == ()
    assert plan.delete_rayjobs == ("tiny-0",)
    assert plan.status["phase"] == "Suspended"
    assert _conditions(plan)["Suspended"]["status"] == "True"


def test_a_suspended_queued_job_has_no_rayjob_and_resuming_queues_a_new_one(settings):
    body = make_body({**QUEUE, "suspend": True}, status={"phase": "Suspended"})
    plan = reconcile(observed(body, []), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Suspended"
    assert plan.status["rayJobName"] == "tiny-0"
    resumed = make_body(QUEUE, status={"phase": "Suspended"})
    plan = reconcile(observed(resumed, []), settings)
    assert _kinds(plan) == _attempt("tiny-0")
    assert plan.create[-1]["spec"]["suspend"] is True
    assert plan.status["phase"] == "Queued"
    assert plan.status["restarts"] == {"job": 0, "preemptions": 0}  # a resume is not a restart


def test_a_restarted_attempt_of_a_queued_job_waits_in_the_queue_again(settings):
    body = make_body({**QUEUE, "faultTolerance": {"backoffSeconds": 0}}, status={"phase": "Running"})
    rj = _queued_rayjob(body, FAILED, suspend=False)
    rj["metadata"]["annotations"] = {FAILED_AT_ANNOTATION: "2026-03-01T11:00:00Z"}
    plan = reconcile(observed(body, [rj]), settings)
    assert _kinds(plan) == _attempt("tiny-1")
    assert plan.create[-1]["spec"]["suspend"] is True
    assert plan.create[-1]["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "team-a-gpus"


def test_a_rayjob_made_before_queuename_was_set_keeps_the_operators_suspend(settings):
    body = make_body({**QUEUE, "suspend": True}, status={"phase": "Running"})
    rj = rayjob_with_status(make_body(), 0, RUNNING)  # rendered without the queue: no Kueue label
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.patch_rayjobs == (("tiny-0", {"spec": {"suspend": True}}),)
    assert plan.delete_rayjobs == ()


def test_a_running_job_keeps_its_spec_file_when_mutable_fields_change(settings):
    started = make_body()
    body = make_body({"training": {"numRollout": 99}}, status={"phase": "Running"})
    cm = render.render_configmap(render.JobRef.from_body(started), started["spec"])
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)], configmap=cm), settings)
    assert plan.update_configmap is None
    assert "SpecChangeIgnored" not in _conditions(plan)


def test_a_change_to_a_fixed_field_is_ignored_with_a_condition_and_an_event(settings):
    started = make_body()
    body = make_body({"model": {"preset": "other"}, "rollout": {"batchSize": 8}, "training": {"globalBatchSize": 16}},
                     status={"phase": "Running"})
    cm = render.render_configmap(render.JobRef.from_body(started), started["spec"])
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)], configmap=cm), settings)
    cond = _conditions(plan)["SpecChangeIgnored"]
    assert cond["status"] == "True"
    assert "spec.model, spec.rollout.batchSize, spec.training.globalBatchSize cannot change" in cond["message"]
    assert ("Warning", "SpecChangeIgnored") in [(e.type, e.reason) for e in plan.events]
    assert plan.status["phase"] == "Running"


def test_an_ignored_change_keeps_the_running_values_in_the_next_attempt(settings):
    started = make_body({"faultTolerance": {"backoffSeconds": 0}})
    body = make_body({"faultTolerance": {"backoffSeconds": 0}, "model": {"preset": "other"},
                      "training": {"numRollout": 30}}, status={"phase": "Running"})
    cm = render.render_configmap(render.JobRef.from_body(started), started["spec"])
    rj = rayjob_with_status(body, 0, FAILED, annotations={FAILED_AT_ANNOTATION: "2026-03-01T11:00:00Z"})
    plan = reconcile(observed(body, [rj], configmap=cm), settings)
    assert _kinds(plan) == _attempt("tiny-1")
    spec = render.configmap_spec(plan.update_configmap)
    assert spec["model"]["preset"] == "tiny"  # held
    assert spec["training"]["numRollout"] == 30  # mutable: taken at the new attempt


def test_an_invalid_spec_fails_at_once_naming_the_field(settings):
    body = make_body({"rollout": {"batchSize": 4, "nSamplesPerPrompt": 2}, "training": {"globalBatchSize": 3}})
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "InvalidSpec"
    assert plan.permanent_error.startswith("spec.training.globalBatchSize: ")
    assert "globalBatchSize(3)" in plan.permanent_error


REFUSAL = "spec.model.preset: 'qwen3-4b' has no built-in weights; known presets: ['tiny']"


def test_a_spec_the_runtime_refused_fails_the_job_instead_of_restarting(settings):
    body = make_body({"faultTolerance": {"backoffLimit": 3}},
                     status={"phase": "Running", "invalidSpec": {"attempt": 0, "message": REFUSAL}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, FAILED)]), settings)
    assert plan.status["phase"] == "Failed"
    assert _conditions(plan)["Failed"]["reason"] == "InvalidSpec"
    assert plan.status["message"] == (
        f"the runtime of attempt 0 (RayJob tiny-0) refused the spec: {REFUSAL}. Another attempt would be refused "
        "too: fix the spec and create the RLJob again"
    )
    assert plan.permanent_error == plan.status["message"]
    assert plan.create == () and plan.delete_rayjobs == () and plan.patch_rayjobs == ()
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Failed")]
    # Failed is final: the next reconcile starts nothing either.
    again = reconcile(observed(_apply_status(body, plan), [rayjob_with_status(body, 0, FAILED)]), settings)
    assert again.create == () and again.status["phase"] == "Failed" and again.events == ()


def test_a_refusal_is_acted_on_once_the_attempt_has_failed(settings):
    body = make_body(status={"phase": "Running", "invalidSpec": {"attempt": 0, "message": REFUSAL}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)]), settings)
    assert plan.status["phase"] == "Running" and plan.permanent_error is None


def test_a_refusal_recorded_by_an_earlier_attempt_does_not_stop_a_restart(settings):
    body = make_body({"faultTolerance": {"backoffSeconds": 10}},
                     status={"phase": "Running", "restarts": {"job": 1},
                             "invalidSpec": {"attempt": 0, "message": REFUSAL}})
    plan = reconcile(observed(body, [rayjob_with_status(body, 1, FAILED)]), settings)
    assert plan.status["phase"] == "Restarting"
    assert _conditions(plan)["Failed"]["status"] == "False"
    assert plan.permanent_error is None


def test_a_spec_that_cannot_become_pods_fails_naming_the_field(settings):
    # Engines wider than a pod: valid as a spec, but KubeRay pods cannot hold them.
    body = make_body({"resources": {"placement": "separate", "rollout": {"gpus": 32}}, "rollout": {"gpusPerEngine": 16}})
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert plan.status["phase"] == "Failed"
    assert plan.permanent_error.startswith("spec.rollout.gpusPerEngine: ")
    assert plan.create == ()


def test_a_too_long_name_fails_naming_metadata_name(settings):
    body = make_body(name="a" * 45)
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert plan.permanent_error.startswith("metadata.name: ")
    assert plan.create == ()


def test_the_deadline_covers_the_whole_job(settings):
    body = make_body({"activeDeadlineSeconds": 600}, status={"phase": "Running"})
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert plan.create[-1]["spec"]["activeDeadlineSeconds"] == 300  # created 5 minutes ago
    late = reconcile(observed(body, [rayjob_with_status(body, 0, RUNNING)], now=CREATED + timedelta(seconds=601)),
                     settings)
    assert late.status["phase"] == "Failed"
    assert _conditions(late)["Failed"]["reason"] == "DeadlineExceeded"
    assert late.delete_rayjobs == ("tiny-0",)


def test_success_is_final_and_the_ttl_deletes_the_rljob(settings):
    body = make_body({"ttlSecondsAfterFinished": 60}, status={"phase": "Running"})
    done = reconcile(observed(body, [rayjob_with_status(body, 0, {"jobDeploymentStatus": "Complete",
                                                                   "jobStatus": "SUCCEEDED"})]), settings)
    assert done.status["phase"] == "Succeeded"
    assert _conditions(done)["Progressing"]["status"] == "False"
    assert done.requeue_after == 60
    body = _apply_status(body, done)
    assert not reconcile(observed(body, now=NOW + timedelta(seconds=30)), settings).delete_rljob
    later = reconcile(observed(body, now=NOW + timedelta(seconds=61)), settings)
    assert later.delete_rljob
    assert later.create == ()


def test_finished_jobs_are_left_alone(settings):
    body = make_body(status={"phase": "Failed", "message": "x"})
    plan = reconcile(observed(body, configmap=None, children=False), settings)
    assert plan.create == () and plan.delete_rayjobs == () and plan.requeue_after is None


def test_names_taken_by_other_objects_are_reported_not_overwritten(settings):
    body = make_body()
    plan = reconcile(observed(body, configmap=None, conflicts=("ConfigMap tiny-spec",)), settings)
    assert plan.create == ()
    assert plan.status["phase"] == "Pending"
    assert "ConfigMap tiny-spec already exist(s) and is not owned by this RLJob" in plan.status["message"]
    assert ("Warning", "NameConflict") in [(e.type, e.reason) for e in plan.events]


def test_a_deleted_rayjob_of_the_current_attempt_is_recreated_once_gone(settings):
    body = make_body(status={"phase": "Running"})
    rj = rayjob_with_status(body, 0, RUNNING, deletionTimestamp="2026-03-01T11:59:00Z")
    plan = reconcile(observed(body, [rj]), settings)
    assert plan.create == () and plan.delete_rayjobs == ()
    again = reconcile(observed(body, []), settings)
    assert _kinds(again) == _attempt("tiny-0")

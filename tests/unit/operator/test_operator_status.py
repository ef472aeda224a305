"""RayJob status (+ pods) -> RLJob phase, conditions and the status patch."""

from __future__ import annotations

from datetime import timedelta

import pytest
from operator_testutil import NOW
from rlkube_operator import status as st
from rlkube_runtime.spec import RLJobPhase as P


def _rayjob(deployment=None, job=None, **extra):
    status = {k: v for k, v in {"jobDeploymentStatus": deployment, "jobStatus": job, **extra}.items() if v is not None}
    return {"metadata": {"name": "tiny-0"}, "status": status}


@pytest.mark.parametrize(
    ("deployment", "job", "phase", "failed"),
    [
        (None, None, P.PENDING, False),
        ("Initializing", "", P.STARTING, False),
        ("Scheduling", None, P.STARTING, False),
        ("Waiting", None, P.STARTING, False),
        ("Running", "", P.STARTING, False),
        ("Running", "PENDING", P.STARTING, False),
        ("Running", "RUNNING", P.RUNNING, False),
        ("Running", "SUCCEEDED", P.RUNNING, False),  # KubeRay marks Complete next
        ("Running", "FAILED", P.FAILED, True),  # kuberay#2314: job failed, deployment not yet
        ("Running", "STOPPED", P.FAILED, True),
        ("Complete", "SUCCEEDED", P.SUCCEEDED, False),
        ("Complete", "STOPPED", P.FAILED, True),
        ("Failed", "FAILED", P.FAILED, True),
        ("Failed", "RUNNING", P.FAILED, True),
        ("ValidationFailed", None, P.FAILED, True),
        ("Suspending", "RUNNING", P.SUSPENDED, False),
        ("Suspended", "", P.SUSPENDED, False),
        ("Retrying", "FAILED", P.FAILED, True),  # a failed Ray job ends the attempt whatever KubeRay does next
        ("Retrying", "", P.RESTARTING, False),
        ("SomethingNew", "", P.STARTING, False),
    ],
)
def test_rayjob_status_maps_to_a_phase(deployment, job, phase, failed):
    attempt = st.observe_rayjob(_rayjob(deployment, job))
    assert attempt.phase == phase
    assert attempt.failed == failed


def test_failures_after_which_a_retry_cannot_help_are_permanent():
    assert st.observe_rayjob(_rayjob("Failed", "FAILED", reason="DeadlineExceeded")).permanent
    assert st.observe_rayjob(_rayjob("ValidationFailed", reason="ValidationFailed")).permanent
    assert not st.observe_rayjob(_rayjob("Failed", "FAILED", reason="AppFailed")).permanent
    assert not st.observe_rayjob(_rayjob("Failed", reason="SubmissionFailed")).permanent


def test_cluster_name_and_dashboard_come_from_the_rayjob():
    attempt = st.observe_rayjob(_rayjob("Running", "RUNNING", rayClusterName="tiny-0-abcde",
                                        dashboardURL="tiny-0-abcde-head-svc.team-a.svc.cluster.local:8265"))
    assert attempt.ray_cluster_name == "tiny-0-abcde"
    assert attempt.dashboard_url.endswith(":8265")


def test_failure_message_quotes_kuberay_and_the_failed_containers():
    pods = [
        {"metadata": {"name": "tiny-0-abcde-trainer-x"},
         "status": {"phase": "Failed", "containerStatuses": [
             {"name": "ray-worker", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}},
        {"metadata": {"name": "tiny-0-abcde-head"}, "status": {"phase": "Running"}},
    ]
    attempt = st.observe_rayjob(_rayjob("Failed", "FAILED", reason="AppFailed", message="trainer died"), pods)
    assert attempt.reason == "RayJobFailed"
    assert attempt.message == (
        "RayJob tiny-0 failed: AppFailed; trainer died; "
        "pod tiny-0-abcde-trainer-x (container ray-worker) exited 137: OOMKilled"
    )


@pytest.mark.parametrize(
    ("phase", "ready", "progressing", "suspended", "failed"),
    [
        (P.PENDING, "False", "True", "False", "False"),
        (P.STARTING, "False", "True", "False", "False"),
        (P.RUNNING, "True", "True", "False", "False"),
        (P.RESTARTING, "False", "True", "False", "False"),
        (P.SUSPENDED, "False", "False", "True", "False"),
        (P.SUCCEEDED, "False", "False", "False", "False"),
        (P.FAILED, "False", "False", "False", "True"),
    ],
)
def test_each_phase_sets_the_four_conditions(phase, ready, progressing, suspended, failed):
    conds = {c.type: c for c in st.desired_conditions(phase, "Why", "what happened")}
    assert [c for c in conds] == ["Ready", "Progressing", "Suspended", "Failed"]
    assert (conds["Ready"].status, conds["Progressing"].status, conds["Suspended"].status, conds["Failed"].status) == (
        ready, progressing, suspended, failed
    )
    assert conds["Progressing"].reason == "Why"
    if failed == "True":
        assert conds["Failed"].reason == "Why" and conds["Failed"].message == "what happened"


def test_condition_transition_time_changes_only_with_its_status():
    earlier = NOW - timedelta(hours=1)
    first = st.merge_conditions([], st.desired_conditions(P.STARTING, "ClusterStarting", "m"), now=earlier, generation=1)
    second = st.merge_conditions(first, st.desired_conditions(P.RUNNING, "Running", "m2"), now=NOW, generation=2)
    by_type = {c["type"]: c for c in second}
    assert by_type["Ready"]["lastTransitionTime"] == "2026-03-01T12:00:00Z"  # False -> True
    assert by_type["Progressing"]["lastTransitionTime"] == "2026-03-01T11:00:00Z"  # True -> True
    assert by_type["Progressing"]["reason"] == "Running"
    assert by_type["Ready"]["observedGeneration"] == 2


def test_conditions_of_other_types_are_kept_unless_dropped():
    extra = {"type": "SpecChangeIgnored", "status": "True", "reason": "ImmutableField"}
    kept = st.merge_conditions([extra], st.desired_conditions(P.RUNNING, "Running", ""), now=NOW, generation=1)
    assert extra in kept
    dropped = st.merge_conditions([extra], st.desired_conditions(P.RUNNING, "Running", ""), now=NOW, generation=1,
                                  drop=("SpecChangeIgnored",))
    assert all(c["type"] != "SpecChangeIgnored" for c in dropped)


def test_status_patch_touches_only_operator_fields_and_only_when_they_differ():
    current = {
        "phase": "Running", "message": "m", "conditions": [], "observedGeneration": 1, "rayJobName": "tiny-0",
        "progressText": "3/10", "restarts": {"engine": 2, "job": 0},
        "progress": {"rollout": 3, "numRollout": 10}, "metrics": {"rewardMean": 0.5},
    }
    desired = {k: current[k] for k in ("phase", "message", "conditions", "observedGeneration", "rayJobName", "progressText")}
    desired |= {"rayClusterName": None, "dashboardUrl": None, "restarts": {"job": 0}}
    assert st.status_changes(current, desired) == {}
    desired["phase"] = "Restarting"
    desired["restarts"] = {"job": 1, "preemptions": 0}
    assert st.status_changes(current, desired) == {"phase": "Restarting", "restarts": {"job": 1, "preemptions": 0}}
    # A preemption restart changes both operator counters; the runtime's engine count is left alone.
    desired["restarts"] = {"job": 1, "preemptions": 1}
    assert st.status_changes(current, desired)["restarts"] == {"job": 1, "preemptions": 1}

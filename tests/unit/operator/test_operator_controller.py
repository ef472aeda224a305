"""The controller's read -> decide -> act loop over an in-memory stand-in for the API (the real
API server is exercised in tests/integration/test_operator.py)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from datetime import timedelta

import pytest
from operator_testutil import NOW, default_settings, make_body
from rlkube_operator import metrics, render
from rlkube_operator.controller import Controller


class MemoryKube:
    """Objects by (kind, namespace, name); merge patches applied one level deep, as the tests need."""

    def __init__(self, rljob):
        self.objects = {("RLJob", rljob["metadata"]["namespace"], rljob["metadata"]["name"]): rljob}
        self.calls = []
        self.status_patches = []

    def _key(self, kind, ns, name):
        return (kind, ns, name)

    def get_rljob(self, ns, name):
        return copy.deepcopy(self.objects.get(("RLJob", ns, name)))

    def patch_rljob_status(self, ns, name, patch):
        self.calls.append(("patch-status", name))
        self.status_patches.append(copy.deepcopy(patch))
        status = self.objects[("RLJob", ns, name)].setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            elif isinstance(v, dict) and isinstance(status.get(k), dict):
                status[k].update(v)
            else:
                status[k] = copy.deepcopy(v)

    def delete_rljob(self, ns, name):
        self.objects.pop(("RLJob", ns, name), None)

    def list_rayjobs(self, ns, selector):
        key, value = selector.split("=")
        return [copy.deepcopy(o) for (kind, n, _), o in self.objects.items()
                if kind == "RayJob" and n == ns and o["metadata"]["labels"].get(key) == value]

    def patch_rayjob(self, ns, name, patch):
        obj = self.objects[("RayJob", ns, name)]
        for section, values in patch.items():
            target = obj.setdefault(section, {})
            for k, v in values.items():
                if isinstance(v, dict):
                    target.setdefault(k, {}).update(v)
                else:
                    target[k] = v

    def delete_rayjob(self, ns, name):
        self.calls.append(("delete", "RayJob", name))
        self.objects.pop(("RayJob", ns, name), None)

    def get(self, kind, ns, name):
        return copy.deepcopy(self.objects.get((kind, ns, name)))

    def update_configmap_data(self, ns, name, data):
        self.objects[("ConfigMap", ns, name)]["data"] = dict(data)

    def list_pods(self, ns, selector):
        return []

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.objects[key] = copy.deepcopy(obj)
        return True


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self):
        return self.now


def _run(coro):
    return asyncio.run(coro)


def _controller(body):
    kube = MemoryKube(body)
    events = []
    clock = Clock()
    controller = Controller(kube, default_settings(), emit=lambda b, e: events.append((e.type, e.reason)), clock=clock)
    return controller, kube, events, clock


async def _reconcile(controller, name="tiny"):
    try:
        return await controller.reconcile("team-a", name)
    finally:
        controller.stop()


def test_reconciling_twice_creates_each_object_once():
    controller, kube, events, _ = _controller(make_body())
    for _ in range(3):
        _run(_reconcile(controller))
    creates = [c for c in kube.calls if c[0] == "create"]
    assert creates == [("create", "ConfigMap", "tiny-spec"), ("create", "ServiceAccount", "tiny-runtime"),
                       ("create", "Role", "tiny-runtime"), ("create", "RoleBinding", "tiny-runtime"),
                       ("create", "Secret", "tiny-api-key"), ("create", "NetworkPolicy", "tiny"),
                       ("create", "RayJob", "tiny-0")]
    # Written after creating, again once the RayJob is seen, then left alone.
    assert [c for c in kube.calls if c[0] == "patch-status"] == [("patch-status", "tiny")] * 2
    assert events == [("Normal", "Pending")]
    assert kube.objects[("RLJob", "team-a", "tiny")]["status"]["phase"] == "Pending"


def test_the_status_patch_returned_is_the_one_written_and_the_plan_is_left_as_decided():
    controller, kube, _, _ = _controller(make_body())
    first = _run(_reconcile(controller))
    assert kube.status_patches == [first.status_patch]
    assert first.status_patch["phase"] == "Pending" and first.status_patch["rayJobName"] == "tiny-0"
    assert first.plan.status["phase"] == "Pending"
    _run(_reconcile(controller))  # the RayJob is seen now: its conditions are written
    third = _run(_reconcile(controller))
    assert third.status_patch == {} and len(kube.status_patches) == 2  # nothing left to write
    with pytest.raises(dataclasses.FrozenInstanceError):
        third.plan.requeue_after = 0


def test_a_failure_then_the_backoff_then_the_next_attempt():
    controller, kube, events, clock = _controller(make_body({"faultTolerance": {"backoffSeconds": 10}}))
    _run(_reconcile(controller))
    kube.objects[("RayJob", "team-a", "tiny-0")]["status"] = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}
    applied = _run(_reconcile(controller))
    assert applied.plan.requeue_after == 10
    assert kube.objects[("RLJob", "team-a", "tiny")]["status"]["phase"] == "Restarting"
    restarts_before = metrics.RESTARTS.labels("failure")._value.get()
    clock.now = NOW + timedelta(seconds=11)
    _run(_reconcile(controller))
    assert ("RayJob", "team-a", "tiny-0") not in kube.objects
    assert kube.objects[("RayJob", "team-a", "tiny-1")]["metadata"]["labels"][render.LABEL_ATTEMPT] == "1"
    assert kube.objects[("RLJob", "team-a", "tiny")]["status"]["restarts"] == {"job": 1, "preemptions": 0}
    assert metrics.RESTARTS.labels("failure")._value.get() == restarts_before + 1
    assert events == [("Normal", "Pending"), ("Warning", "Restarting")]
    # Someone deletes the running attempt's RayJob: it is made again, and that is no restart.
    del kube.objects[("RayJob", "team-a", "tiny-1")]
    _run(_reconcile(controller))
    assert ("RayJob", "team-a", "tiny-1") in kube.objects
    assert metrics.RESTARTS.labels("failure")._value.get() == restarts_before + 1


def test_a_preemption_restart_is_counted_as_one_not_as_a_failure():
    controller, kube, events, _ = _controller(make_body())
    _run(_reconcile(controller))
    kube.objects[("RayJob", "team-a", "tiny-0")]["status"] = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}
    kube.objects[("RLJob", "team-a", "tiny")]["status"]["lastPreemption"] = {"attempt": 0, "rollout": 3}
    failures, preemptions = (metrics.RESTARTS.labels(r)._value.get() for r in ("failure", "preemption"))
    _run(_reconcile(controller))
    assert ("RayJob", "team-a", "tiny-1") in kube.objects
    assert metrics.RESTARTS.labels("preemption")._value.get() == preemptions + 1
    assert metrics.RESTARTS.labels("failure")._value.get() == failures


def test_an_object_the_api_server_refuses_as_invalid_fails_the_job_at_once_and_for_good():
    from rlkube_operator.kube import InvalidObject

    controller, kube, events, _ = _controller(make_body())
    create = kube.create

    def refuse_rayjobs(obj):
        if obj["kind"] == "RayJob":
            kube.calls.append(("refused", obj["kind"], obj["metadata"]["name"]))
            raise InvalidObject("RayJob", obj["metadata"]["name"], 'RayJob.ray.io "tiny-0" is invalid: spec.x: bad')
        return create(obj)

    kube.create = refuse_rayjobs
    spec_errors = metrics.RECONCILE_ERRORS.labels("spec")._value.get()
    applied = _run(_reconcile(controller))
    status = kube.objects[("RLJob", "team-a", "tiny")]["status"]
    assert status["phase"] == "Failed"
    assert status["message"].startswith('the API server refused RayJob tiny-0 as invalid: RayJob.ray.io "tiny-0" is '
                                        "invalid: spec.x: bad")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "InvalidSpec")
    assert events == [("Warning", "Failed")]
    assert applied.plan.permanent_error and applied.plan.requeue_after is None
    assert metrics.RECONCILE_ERRORS.labels("spec")._value.get() == spec_errors + 1
    # Never retried: later reconciles create nothing and write nothing.
    for _ in range(2):
        _run(_reconcile(controller))
    assert [c for c in kube.calls if c[0] == "refused"] == [("refused", "RayJob", "tiny-0")]
    assert events == [("Warning", "Failed")]


def test_objects_of_someone_else_are_not_taken_over():
    body = make_body()
    controller, kube, events, _ = _controller(body)
    kube.objects[("ConfigMap", "team-a", "tiny-spec")] = {"metadata": {"name": "tiny-spec", "ownerReferences": []}}
    _run(_reconcile(controller))
    assert not any(c[0] == "create" for c in kube.calls)
    assert ("Warning", "NameConflict") in events


def test_a_deleted_rljob_is_forgotten():
    controller, kube, _, _ = _controller(make_body())
    kube.objects.clear()
    assert _run(_reconcile(controller)) is None


def test_an_unreachable_api_server_is_one_warning_line_and_a_retry_not_a_traceback(caplog):
    import logging

    import urllib3

    controller, kube, _, _ = _controller(make_body())

    def refused(ns, name):
        cause = ConnectionRefusedError(111, "Connection refused")
        raise urllib3.exceptions.MaxRetryError(None, "/apis", urllib3.exceptions.ProtocolError("Connection aborted.", cause))

    kube.get_rljob = refused
    errors_before = metrics.RECONCILE_ERRORS.labels("internal")._value.get()
    with caplog.at_level(logging.WARNING):
        assert _run(_reconcile(controller)) is None
    [record] = [r for r in caplog.records if "tiny" in r.getMessage()]
    assert record.getMessage() == ("reconcile of RLJob team-a/tiny failed: the API server did not answer "
                                   "(Connection refused); retrying in 5s")
    assert record.exc_info is None
    assert metrics.RECONCILE_ERRORS.labels("internal")._value.get() == errors_before + 1

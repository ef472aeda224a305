"""Errors that stop: an RLJob whose RayJob the API server refuses as invalid (422) is Failed at once,
reason InvalidSpec, with the server's own message and one Warning event, and never retried."""

from __future__ import annotations

import json

import pytest
from operator_fixtures import OperatorProcess, get_or_none, kubectl_json

NAMESPACE = "rlkube-sec-invalid"


@pytest.mark.controlplane
@pytest.mark.slow
def test_a_rayjob_the_api_server_refuses_fails_the_job_once_with_the_servers_message(secured, tmp_path):
    cp = secured
    cp.create_namespace(NAMESPACE)
    operator = OperatorProcess(cp, tmp_path / "operator.log", env={"RLKUBE_RESYNC_SECONDS": "1"})
    # The spec passes every rlkube check; KubeRay's CRD refuses the quantity in the RayJob's pod template.
    job = {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "bad-cpu", "namespace": NAMESPACE},
           "spec": {"model": {"preset": "tiny"}, "data": {"promptData": "builtin:digit-successor"},
                    "rollout": {"batchSize": 4, "nSamplesPerPrompt": 2}, "reward": {"type": "exact"},
                    "training": {"numRollout": 3},
                    "resources": {"placement": "colocated",
                                  "trainer": {"gpusPerNode": 2, "resources": {"requests": {"cpu": "lots"}}}}}}
    try:
        operator.start()
        cp.kubectl("apply", "-f", "-", input=json.dumps(job))

        def failed():
            status = (get_or_none(cp, NAMESPACE, "rljob", "bad-cpu") or {}).get("status") or {}
            return status if status.get("phase") == "Failed" else None

        status = cp.wait_for(failed, 60, "the RLJob to fail")
        condition = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert (condition["status"], condition["reason"]) == ("True", "InvalidSpec")
        assert status["message"].startswith("the API server refused RayJob bad-cpu-0 as invalid: ")
        assert "spec.rayClusterSpec.headGroupSpec" in status["message"] or "requests" in status["message"], status
        assert get_or_none(cp, NAMESPACE, "rayjob", "bad-cpu-0") is None

        # Never retried: a failed job is not resynced, and the reconciles its changes still cause
        # (here three label changes) create nothing.
        for i in range(3):
            reconciled = operator.metric("rlkube_operator_reconcile_total", result="ok")
            cp.kubectl("-n", NAMESPACE, "label", "rljob", "bad-cpu", f"touched={i}", "--overwrite")
            cp.wait_for(lambda: operator.metric("rlkube_operator_reconcile_total", result="ok") > reconciled, 60,
                        "a reconcile of the labelled RLJob")
        assert operator.log_text().count(f"RLJob {NAMESPACE}/bad-cpu: the API server refused RayJob") == 1
        events = [e for e in kubectl_json(cp, "-n", NAMESPACE, "get", "events")["items"]
                  if e["involvedObject"].get("name") == "bad-cpu" and e["type"] == "Warning"]
        assert [(e["reason"], e.get("count", 1)) for e in events] == [("Failed", 1)], events
        assert events[0]["message"].startswith("the API server refused RayJob bad-cpu-0 as invalid")
    finally:
        operator.stop()
        cp.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)

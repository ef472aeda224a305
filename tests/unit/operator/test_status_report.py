"""The runtime's status reporter: what it writes (the real API server test is in
tests/integration/test_operator.py)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from rlkube_runtime.status_report import (
    RLJobStatusReporter,
    attempt_from_env,
    build_preemption_patch,
    build_status_patch,
)


def test_outside_a_cluster_there_is_no_reporter():
    assert RLJobStatusReporter.from_env({}) is None
    assert RLJobStatusReporter.from_env({"RLKUBE_RLJOB_NAME": "tiny"}) is None


def test_without_credentials_there_is_no_reporter(tmp_path, caplog):
    env = {"RLKUBE_RLJOB_NAME": "tiny", "RLKUBE_RLJOB_NAMESPACE": "a", "KUBECONFIG": str(tmp_path / "none")}
    with caplog.at_level(logging.WARNING):
        assert RLJobStatusReporter.from_env(env) is None
    assert "will not be reported" in caplog.text


def test_patch_holds_progress_checkpoint_and_known_finite_metrics_in_camel_case():
    patch = build_status_patch(
        5, 100,
        last_checkpoint={"rollout": 4, "path": "/ckpt/tiny/iter_4", "time": datetime(2026, 3, 1, 12, tzinfo=timezone.utc)},
        metrics={"reward_mean": 0.25, "kl": 0.01, "stepSeconds": 3, "loss": 1.0, "grad_norm": float("nan")},
    )
    assert patch == {
        "progress": {"rollout": 5, "numRollout": 100},
        "lastCheckpoint": {"rollout": 4, "path": "/ckpt/tiny/iter_4", "time": "2026-03-01T12:00:00Z"},
        "metrics": {"rewardMean": 0.25, "kl": 0.01, "stepSeconds": 3.0},
    }


def test_engine_restarts_are_reported_under_the_runtimes_own_key():
    assert build_status_patch(3, 10, engine_restarts=2)["restarts"] == {"engine": 2}
    assert "restarts" not in build_status_patch(3, 10)


def test_engine_restarts_so_far_reads_what_earlier_attempts_wrote():
    class Api:
        def __init__(self, status):
            self.status = status

        def get_namespaced_custom_object_status(self, *a, **kw):
            return {"status": self.status}

    reporter = RLJobStatusReporter.__new__(RLJobStatusReporter)
    reporter.name, reporter.namespace = "tiny", "a"
    reporter._api = Api({"restarts": {"job": 1, "engine": 3}})
    assert reporter.engine_restarts_so_far() == 3
    reporter._api = Api({})
    assert reporter.engine_restarts_so_far() == 0


def test_non_finite_metrics_are_left_out():
    assert "metrics" not in build_status_patch(1, 2, metrics={"reward_mean": float("inf")})


def test_a_failed_patch_is_logged_and_training_goes_on(caplog):
    class Broken:
        def patch_namespaced_custom_object_status(self, *a, **kw):
            raise ConnectionError("apiserver unreachable")

    reporter = RLJobStatusReporter.__new__(RLJobStatusReporter)
    reporter.name, reporter.namespace, reporter._api = "tiny", "a", Broken()
    with caplog.at_level(logging.WARNING):
        assert reporter.report(1, 10) is False
    assert "could not report status of RLJob a/tiny" in caplog.text


def test_a_refused_spec_is_reported_with_the_attempt_under_the_runtimes_own_key():
    from rlkube_runtime.spec.contract import RUNTIME_STATUS_FIELDS
    from rlkube_runtime.status_report import build_invalid_spec_patch

    patch = build_invalid_spec_patch("spec.model.preset: 'qwen3-4b' has no built-in weights", 2)
    assert patch == {"invalidSpec": {"message": "spec.model.preset: 'qwen3-4b' has no built-in weights", "attempt": 2}}
    assert set(patch) <= set(RUNTIME_STATUS_FIELDS)
    assert build_invalid_spec_patch("x", None) == {"invalidSpec": {"message": "x"}}


def test_report_invalid_spec_patches_the_status_as_a_merge_patch():
    class Api:
        calls = []

        def patch_namespaced_custom_object_status(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    reporter = RLJobStatusReporter.__new__(RLJobStatusReporter)
    reporter.name, reporter.namespace, reporter.attempt, reporter._api = "tiny", "a", 1, Api()
    assert reporter.report_invalid_spec("spec.training.backend: no") is True
    [(args, kwargs)] = Api.calls
    assert args[-2:] == ("tiny", {"status": {"invalidSpec": {"message": "spec.training.backend: no", "attempt": 1}}})
    assert kwargs["_content_type"] == "application/merge-patch+json"


def test_the_reporter_knows_its_attempt_from_the_pod_environment(tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    env = {"RLKUBE_RLJOB_NAME": "tiny", "RLKUBE_RLJOB_NAMESPACE": "a", "RLKUBE_ATTEMPT": "3"}
    assert RLJobStatusReporter.from_env(env, kubeconfig=str(kubeconfig)).attempt == 3
    del env["RLKUBE_ATTEMPT"]
    assert RLJobStatusReporter.from_env(env, kubeconfig=str(kubeconfig)).attempt is None


def test_a_preemption_is_reported_with_the_attempt_and_the_checkpoint_it_saved():
    when = datetime(2026, 3, 1, 12, 0, 5, 123, tzinfo=timezone.utc)
    assert build_preemption_patch(2, 7, when) == {
        "lastPreemption": {"attempt": 2, "rollout": 7, "time": "2026-03-01T12:00:05Z"}
    }
    # Nothing trained yet: the rollout of an earlier preemption is cleared (merge patch null).
    assert build_preemption_patch(0, None, when)["lastPreemption"]["rollout"] is None


def test_the_attempt_comes_from_the_pods_environment():
    assert attempt_from_env({"RLKUBE_ATTEMPT": "3"}) == 3
    assert attempt_from_env({}) is None
    assert attempt_from_env({"RLKUBE_ATTEMPT": "x"}) is None


def test_report_preempted_patches_last_preemption_only():
    class Api:
        patches = []

        def patch_namespaced_custom_object_status(self, *args, **kw):
            self.patches.append(args[-1])

    reporter = RLJobStatusReporter.__new__(RLJobStatusReporter)
    reporter.name, reporter.namespace, reporter._api = "tiny", "a", Api()
    assert reporter.report_preempted(1, 4) is True
    [body] = Api.patches
    assert list(body["status"]) == ["lastPreemption"]
    assert (body["status"]["lastPreemption"]["attempt"], body["status"]["lastPreemption"]["rollout"]) == (1, 4)

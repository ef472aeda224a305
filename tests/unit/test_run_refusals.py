"""`rlkube run` refusing its spec at start: exit 2, and on a cluster the refusal is written to the
RLJob's status (invalidSpec) so the operator fails the job instead of restarting it. A missing data
file is not a spec refusal: the operator may retry it."""

from __future__ import annotations

import pytest
import yaml

from rlkube_runtime import status_report
from rlkube_runtime.run import main

JOB = {
    "apiVersion": "rlkube.io/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "refused"},
    "spec": {
        "model": {"preset": "qwen3-4b"},  # a named architecture without hfCheckpoint: no weights to start from
        "data": {"promptData": "builtin:digit-successor"},
        "rollout": {"batchSize": 2, "nSamplesPerPrompt": 2, "maxResponseLen": 1, "engine": "builtin"},
        "reward": {"type": "exact"},
        "training": {"numRollout": 1},
        "resources": {"placement": "colocated"},
    },
}


class FakeReporter:
    def __init__(self):
        self.refusals = []

    def report_invalid_spec(self, message):
        self.refusals.append(message)
        return True


@pytest.fixture
def reporter(monkeypatch):
    fake = FakeReporter()
    monkeypatch.setattr(status_report.RLJobStatusReporter, "from_env", classmethod(lambda cls, *a, **k: fake))
    return fake


def _run(tmp_path, job):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return main.run_from_file(str(path), output_dir=str(tmp_path / "out"))


def test_a_spec_refused_at_start_is_reported_for_the_operator(tmp_path, reporter, capsys):
    assert _run(tmp_path, JOB) == 2
    expected = (
        "spec.model.preset: 'qwen3-4b' has no built-in weights; known presets: ['tiny']. For a named architecture "
        "give spec.model.hfCheckpoint instead"
    )
    assert reporter.refusals == [expected]
    assert f"rlkube run: {expected}" in capsys.readouterr().err


def test_a_spec_that_fails_validation_is_reported_with_its_fields(tmp_path, reporter):
    job = {**JOB, "spec": {**JOB["spec"], "training": {"numRollout": 1, "asyncBufferSize": 2}}}
    assert _run(tmp_path, job) == 2
    [message] = reporter.refusals
    assert message.startswith("doc 1 (refused): spec.training.asyncBufferSize: asyncBufferSize(2): only async mode (training.mode: async) generates ahead")


def test_a_missing_data_file_is_not_reported_as_a_spec_refusal(tmp_path, reporter, capsys):
    job = {**JOB, "spec": {**JOB["spec"], "model": {"preset": "tiny"},
                           "data": {"promptData": str(tmp_path / "missing.jsonl")}}}
    assert _run(tmp_path, job) == 2
    assert reporter.refusals == []
    assert "rlkube run: spec.data.promptData: " in capsys.readouterr().err


def test_parallel_sizes_the_model_cannot_be_split_into_are_refused_at_start(tmp_path, reporter):
    """The tiny model (2 layers) is built first; then its config.json is checked, as `rlkube
    validate` checks a local hfCheckpoint's (spec/model_fit.py)."""
    job = {**JOB, "spec": {**JOB["spec"], "model": {"preset": "tiny"}, "parallelism": {"pipeline": 4},
                           "resources": {"placement": "colocated", "trainer": {"gpusPerNode": 4}}}}
    assert _run(tmp_path, job) == 2
    assert reporter.refusals == ["spec.parallelism.pipeline: 4 does not divide the model's 2 layers"]

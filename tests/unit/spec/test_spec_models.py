"""The typed models: derived values, Python-side construction, round trips, status of live objects."""

from __future__ import annotations

import pytest

from rlkube_runtime.spec import (
    AlgorithmSpec,
    RLJob,
    RLJobPhase,
    RLJobStatus,
    RolloutSpec,
    TrainingSpec,
    format_progress,
)
from rlkube_runtime.spec.load import parse_documents, parse_rljob


def test_global_batch_size_is_derived_when_omitted(good_doc):
    good_doc["spec"]["training"].pop("globalBatchSize")
    good_doc["spec"]["training"]["numStepsPerRollout"] = 2
    job = parse_rljob(good_doc)
    assert job.spec.training.global_batch_size is None  # validators never fill values in
    assert job.spec.global_batch_size == 16 * 8 // 2
    assert job.spec.samples_per_rollout == 128


def test_global_batch_size_when_given(good_doc):
    assert parse_rljob(good_doc).spec.global_batch_size == 128


def test_eps_clip_high_defaults_to_eps_clip():
    assert AlgorithmSpec(eps_clip=0.3).effective_eps_clip_high == 0.3
    assert AlgorithmSpec(eps_clip=0.2, eps_clip_high=0.28).effective_eps_clip_high == 0.28
    assert AlgorithmSpec(eps_clip=0.3).eps_clip_high is None


def test_python_code_constructs_with_snake_case_names():
    rollout = RolloutSpec(batch_size=4, n_samples_per_prompt=2, over_sampling_batch_size=8)
    assert rollout.effective_over_sampling_batch_size == 8
    assert TrainingSpec(num_rollout=3).optimizer.lr == 1e-6


def test_manifest_round_trip_is_identity(good_doc):
    job = parse_rljob(good_doc)
    again = parse_rljob(job.to_manifest())
    assert again == job
    assert job.to_manifest()["spec"]["rollout"]["nSamplesPerPrompt"] == 8


def test_yaml_exponent_floats_are_numbers_as_in_kubectl():
    [(_, doc)] = parse_documents("lr: 1e-6\nn: 3\nv: 1.5\n")
    assert doc == {"lr": 1e-6, "n": 3, "v": 1.5}


def test_status_of_a_live_object_loads(good_doc):
    good_doc["metadata"].update({"uid": "abc", "generation": 2, "creationTimestamp": "2025-01-01T00:00:00Z"})
    good_doc["status"] = {
        "phase": "Running",
        "progress": {"rollout": 3, "numRollout": 60},
        "progressText": format_progress(3, 60),
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}],
        "lastCheckpoint": {"rollout": 2, "path": "/ckpt/2", "time": "2025-01-01T00:01:00Z"},
        "restarts": {"engine": 1, "job": 0},
        "metrics": {"rewardMean": 0.5},
        "kopf": {"progress": {}},  # kopf's own bookkeeping: ignored, not an error
    }
    job = RLJob.model_validate(good_doc)
    assert job.status.phase is RLJobPhase.RUNNING
    assert job.status.progress_text == "3/60"
    assert job.metadata.model_extra["uid"] == "abc"


def test_status_phase_rejects_unknown_values():
    with pytest.raises(ValueError, match="Pending"):
        RLJobStatus.model_validate({"phase": "Exploded"})

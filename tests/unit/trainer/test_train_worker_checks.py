"""The trainer's start-time guard refuses what the spec's validation refuses, in the same words."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlkube_runtime.spec import load_rljob, parse_rljob
from rlkube_runtime.spec.algorithm import NO_CRITIC_MESSAGE
from rlkube_runtime.spec.load import SpecError
from rlkube_runtime.actors.trainer import check_trainer_supports

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def test_a_critic_estimator_is_refused_at_start_with_the_validation_message():
    job = load_rljob(LOCAL_TINY)
    check_trainer_supports(job.spec)  # the example itself is fine
    # A spec that skipped validation (model_copy does not validate) still stops at the trainer.
    ppo = job.spec.model_copy(update={"algorithm": job.spec.algorithm.model_copy(update={"advantage_estimator": "ppo"})})
    with pytest.raises(ValueError) as info:
        check_trainer_supports(ppo)
    assert str(info.value) == f"spec.algorithm.advantageEstimator: {NO_CRITIC_MESSAGE}"

    doc = job.to_manifest()
    doc["spec"]["algorithm"]["advantageEstimator"] = "ppo"
    with pytest.raises(SpecError) as refused:
        parse_rljob(doc)
    assert refused.value.errors == [("spec.algorithm.advantageEstimator", NO_CRITIC_MESSAGE)]

"""Sample: token views, length checks and the JSON-safe round trip used by checkpoints and Ray."""

import json

import pytest
from rlkube_runtime.data import Sample, SampleStatus


def _generated_sample() -> Sample:
    return Sample(
        group_index=3,
        index=13,
        rollout_id=2,
        prompt=[{"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}],
        raw_prompt=[{"role": "user", "content": "2+2?"}],
        tools=[{"type": "function", "function": {"name": "calc"}}],
        tokens=[5, 6, 7, 8, 9, 10],
        response="4 done",
        response_length=4,
        label="4",
        reward={"score": 1.0, "acc": True},
        loss_mask=[1, 0, 0, 1],  # the two tool-output tokens do not train
        rollout_log_probs=[-0.1, -0.2, -0.3, -0.4],
        status=SampleStatus.TRUNCATED,
        metadata={"source": "gsm8k", "nested": {"k": [1, 2]}},
        weight_versions=["3", "4"],
    )


def test_prompt_and_response_tokens_split_tokens_at_response_length():
    sample = _generated_sample()
    assert sample.prompt_tokens == [5, 6]
    assert sample.response_tokens == [7, 8, 9, 10]
    assert sample.prompt_length == 2


def test_effective_response_length_counts_only_loss_mask_ones():
    assert _generated_sample().effective_response_length == 2
    assert Sample(tokens=[1, 2, 3], response_length=3).effective_response_length == 3


def test_to_dict_survives_json_and_from_dict_restores_an_equal_sample():
    sample = _generated_sample()
    restored = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert restored == sample
    assert restored.status is SampleStatus.TRUNCATED


def test_to_dict_is_a_copy_so_later_edits_do_not_leak_into_a_saved_state():
    sample = _generated_sample()
    saved = sample.to_dict()
    sample.metadata["nested"]["k"].append(3)
    sample.tokens.append(11)
    assert saved["metadata"]["nested"]["k"] == [1, 2]
    assert saved["tokens"] == [5, 6, 7, 8, 9, 10]


def test_from_dict_fills_missing_fields_with_defaults():
    sample = Sample.from_dict({"prompt": "hi", "status": "aborted"})
    assert sample.status is Sample.Status.ABORTED
    assert sample.tokens == [] and sample.metadata == {} and sample.reward is None


def test_from_dict_rejects_unknown_keys_and_names_them():
    with pytest.raises(ValueError, match=r"unknown keys \['spec_info'\]"):
        Sample.from_dict({"prompt": "hi", "spec_info": {}})


def test_from_dict_rejects_an_unknown_status_listing_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'done' is not one of \['pending', 'completed'"):
        Sample.from_dict({"status": "done"})


def test_check_lengths_accepts_consistent_fields():
    _generated_sample().check_lengths()


def test_check_lengths_names_each_per_token_field_that_disagrees():
    sample = _generated_sample()
    sample.loss_mask = [1, 1]
    sample.rollout_log_probs = [-1.0]
    with pytest.raises(
        ValueError,
        match=r"index=13.*len\(loss_mask\)=2 != response_length 4.*len\(rollout_log_probs\)=1",
    ):
        sample.check_lengths()


def test_check_lengths_rejects_a_response_longer_than_the_tokens():
    with pytest.raises(ValueError, match=r"response_length 5 is outside 0..len\(tokens\)=3"):
        Sample(tokens=[1, 2, 3], response_length=5).check_lengths()

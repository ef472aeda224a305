"""TrainBatch: validation names the field, slicing keeps samples whole."""

from __future__ import annotations

import pytest
import torch
from rlkube_runtime.trainer.batch import TrainBatch
from trainer_testutil import random_batch


def test_from_lists_builds_typed_tensors():
    batch = TrainBatch.from_lists(
        tokens=[[1, 2, 3, 4]], response_lengths=[2], loss_masks=[[1, 0]], advantages=[[0.5, 0.5]]
    )
    assert batch.tokens[0].dtype == torch.long
    assert batch.loss_masks[0].dtype == torch.float32
    assert batch.num_loss_tokens == 1
    assert batch.total_lengths == [4]


def test_response_must_leave_a_prompt_token():
    with pytest.raises(ValueError, match=r"response_lengths\[0\] = 4 must be in \[1, 3\]"):
        TrainBatch.from_lists(tokens=[[1, 2, 3, 4]], response_lengths=[4], loss_masks=[[1] * 4], advantages=[[0] * 4])


def test_per_token_fields_must_match_the_response_length():
    with pytest.raises(ValueError, match=r"TrainBatch.advantages\[0\] has shape \(3,\), expected \(2,\)"):
        TrainBatch.from_lists(tokens=[[1, 2, 3, 4]], response_lengths=[2], loss_masks=[[1, 1]], advantages=[[0] * 3])


def test_columns_must_have_one_entry_per_sample():
    batch = random_batch([(5, 2), (6, 3)])
    with pytest.raises(ValueError, match="TrainBatch.old_log_probs has 1 entries, tokens has 2"):
        batch.with_fields(old_log_probs=[torch.zeros(2)])


def test_global_batches_are_consecutive_and_must_divide():
    batch = random_batch([(5, 2)] * 6)
    steps = batch.global_batches(2)
    assert [len(s) for s in steps] == [2, 2, 2]
    assert steps[1].tokens[0] is batch.tokens[2]
    with pytest.raises(ValueError, match="6 samples does not split into global batches of 4"):
        batch.global_batches(4)


def test_select_keeps_optional_columns_aligned():
    batch = random_batch([(5, 2), (6, 3), (7, 4)])
    batch = batch.with_fields(old_log_probs=[torch.full((r,), float(i)) for i, r in enumerate(batch.response_lengths)])
    picked = batch.select([2, 0])
    assert picked.response_lengths == [4, 2]
    assert picked.old_log_probs[0][0].item() == 2.0
    assert picked.ref_log_probs is None

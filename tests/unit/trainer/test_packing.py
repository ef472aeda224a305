"""Packing plans and packed rows: limits, coverage, and exactly the unpacked model outputs."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from rlkube_runtime.trainer.packing import (
    DEFAULT_MAX_TOKENS_PER_GPU,
    first_fit_decreasing,
    pack_row,
    partition_for_ranks,
    plan_micro_batches,
)
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("seed", range(20))
def test_ffd_never_exceeds_the_limit_and_places_every_sample_once(seed):
    rng = random.Random(seed)
    capacity = rng.randint(8, 64)
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 40))]
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert all(b for b in bins)


def test_ffd_fills_rows_better_than_arrival_order():
    # Arrival-order greedy needs 3 rows for [6, 5, 5, 4] in 10; FFD finds 2: {6, 4} and {5, 5}.
    assert first_fit_decreasing([6, 5, 5, 4], 10) == [[0, 3], [1, 2]]


def test_a_sample_over_the_limit_goes_alone_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rlkube_runtime.trainer.packing"):
        bins = first_fit_decreasing([3, 50, 4], 10)
    assert [1] in bins
    assert sorted(i for b in bins for i in b) == [0, 1, 2]
    assert "sample 1 has 50 tokens, more than max_tokens_per_gpu=10" in caplog.text


def test_fixed_micro_batch_size_takes_consecutive_groups():
    assert plan_micro_batches([5] * 7, dynamic_batch_size=False, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_unset_token_limit_packs_short_samples_into_one_row_up_to_the_default_budget():
    plan = plan_micro_batches([4, 9, 3, 2], dynamic_batch_size=True, max_tokens_per_gpu=None)
    assert plan == [[0, 1, 2, 3]]
    lengths = [3000, 3000, 3000]  # 9000 tokens > the 8192 default: two rows
    plan = plan_micro_batches(lengths, dynamic_batch_size=True, max_tokens_per_gpu=None)
    assert sorted(len(b) for b in plan) == [1, 2] and DEFAULT_MAX_TOKENS_PER_GPU == 8192


def test_unset_token_limit_grows_to_hold_the_longest_sample():
    plan = plan_micro_batches([9000, 5], dynamic_batch_size=True, max_tokens_per_gpu=None)
    assert plan == [[0], [1]] or plan == [[0, 1]]
    assert all(sum([9000, 5][i] for i in b) <= 9000 for b in plan)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_rank_partition_covers_every_sample_once_and_balances_tokens(world_size):
    rng = random.Random(world_size)
    lengths = [rng.randint(2, 50) for _ in range(17)]
    shares = partition_for_ranks(lengths, world_size)
    assert sorted(i for s in shares for i in s) == list(range(17))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)
    assert all(s for s in shares)


def test_rank_partition_leaves_ranks_empty_only_when_samples_run_out():
    assert partition_for_ranks([7], 2) == [[0], []]


def test_packed_row_positions_restart_and_response_positions_precede_their_tokens():
    row = pack_row([torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30, 31, 32, 33])])
    assert row.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 33]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 0 + 3]]
    positions = row.response_positions([2, 1, 3])
    # Sample 0 response = [11, 12], predicted at positions 0, 1; sample 1 = [21] at 3; sample 2 = [31, 32, 33] at 5..7.
    assert positions.tolist() == [0, 1, 3, 5, 6, 7]
    assert row.input_ids[0, positions + 1].tolist() == [11, 12, 21, 31, 32, 33]


def test_attention_mask_is_block_diagonal_causal():
    mask = pack_row([torch.tensor([1, 2]), torch.tensor([3, 4, 5])]).attention_mask()[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    additive = pack_row([torch.tensor([1, 2]), torch.tensor([3, 4, 5])]).attention_mask(dtype=torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_equal_each_sample_run_alone(tiny_checkpoint, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, attn_implementation=attn_implementation, dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(8, 90, (n,), generator=g) for n in (7, 1, 12, 3)]
    row = pack_row(samples)
    mask = row.attention_mask() if attn_implementation == "sdpa" else row.attention_mask(dtype=torch.float32)
    with torch.no_grad():
        packed = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=mask).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    assert (packed - alone).abs().max().item() < 1e-5

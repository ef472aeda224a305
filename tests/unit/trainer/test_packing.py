"""Micro-batch plans and padded rows: limits, coverage, and exactly the model's outputs for each
sample alone."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from rlkube_runtime.trainer.packing import (
    DEFAULT_MAX_TOKENS_PER_GPU,
    length_sorted_bins,
    pad_rows,
    partition_for_ranks,
    plan_micro_batches,
)
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("seed", range(20))
def test_bins_never_exceed_the_padded_limit_and_place_every_sample_once(seed):
    rng = random.Random(seed)
    capacity = rng.randint(8, 64)
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 40))]
    bins = length_sorted_bins(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= capacity for b in bins)
    assert all(b for b in bins)


def test_bins_take_the_longest_first_so_rows_of_a_bin_have_similar_lengths():
    # Sorted: 9 (idx 1), 8 (3), 5 (0), 4 (4), 2 (2). Capacity 16: {9} alone (2 x 9 > 16), then
    # {8, 5} (2 x 8 = 16), then {4, 2} (2 x 4 = 8; padding 2 tokens).
    assert length_sorted_bins([5, 9, 2, 8, 4], 16) == [[1], [0, 3], [2, 4]]


def test_a_sample_over_the_limit_goes_alone_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rlkube_runtime.trainer.packing"):
        bins = length_sorted_bins([3, 50, 4], 10)
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


def test_padded_rows_and_response_positions_precede_their_tokens():
    rows = pad_rows([torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30, 31, 32, 33])])
    assert rows.input_ids.tolist() == [[10, 11, 12, 0], [20, 21, 0, 0], [30, 31, 32, 33]]
    assert rows.num_tokens == 9
    r, c = rows.response_index([2, 1, 3])
    # Sample 0 response = [11, 12], predicted at (0, 0), (0, 1); sample 1 = [21] at (1, 0); sample 2 = [31, 32, 33] at (2, 0..2).
    assert list(zip(r.tolist(), c.tolist())) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert rows.input_ids[r, c + 1].tolist() == [11, 12, 21, 31, 32, 33]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_padded_rows_give_each_sample_the_logits_it_has_alone(tiny_checkpoint, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, attn_implementation=attn_implementation, dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(8, 90, (n,), generator=g) for n in (7, 1, 12, 3)]
    rows = pad_rows(samples)
    with torch.no_grad():
        padded = model(input_ids=rows.input_ids).logits
        together = torch.cat([padded[j, :n] for j, n in enumerate(rows.seq_lens)])
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    assert (together - alone).abs().max().item() < 1e-5

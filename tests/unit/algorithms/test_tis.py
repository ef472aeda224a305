import math

import pytest
import torch

from rlkube_runtime.algorithms import tis_weights


def test_tis_weights_are_the_ratio_clamped_to_clip_low_and_clip():
    # ratio = exp(old - rollout) = [exp(0), exp(1), exp(-1)] = [1, 2.718, 0.368]; clamp to [0.5, 2] -> [1, 2, 0.5].
    old = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -2.0, 0.0])
    out = tis_weights(old, rollout, clip=2.0, clip_low=0.5)
    assert out.weights.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert out.ratio.tolist() == pytest.approx([1.0, math.e, math.exp(-1)])
    assert out.clipfrac.tolist() == [0.0, 1.0, 1.0]
    assert not out.weights.requires_grad


def test_tis_default_lower_bound_zero_keeps_small_ratios():
    out = tis_weights(torch.tensor([-3.0]), torch.tensor([-1.0]))
    assert out.weights.item() == pytest.approx(math.exp(-2))
    assert out.clipfrac.item() == 0.0


def test_tis_bounds_are_validated():
    with pytest.raises(ValueError, match="tis_clip_low=3"):
        tis_weights(torch.zeros(1), torch.zeros(1), clip=2.0, clip_low=3.0)
    with pytest.raises(ValueError, match="tis_clip=0"):
        tis_weights(torch.zeros(1), torch.zeros(1), clip=0.0)


# Two samples: A's tokens have log-ratios 0.2 and 0.3; B's 0.1 and 5.0, the second outside the loss mask.
OLD = torch.tensor([0.2, 0.3, 0.1, 5.0])
ROLLOUT = torch.zeros(4)
LAYOUT = {"mask": torch.tensor([1.0, 1.0, 1.0, 0.0]), "segment_ids": torch.tensor([0, 0, 1, 1]), "num_segments": 2}


def test_the_sequence_ratio_is_the_product_over_a_samples_counted_tokens():
    out = tis_weights(OLD, ROLLOUT, clip=10.0, level="sequence", **LAYOUT)
    assert out.ratio.tolist() == pytest.approx([math.exp(0.5)] * 2 + [math.exp(0.1)] * 2)


def test_the_geometric_ratio_is_the_mean_log_ratio_of_a_samples_counted_tokens():
    out = tis_weights(OLD, ROLLOUT, clip=10.0, level="geometric", **LAYOUT)
    assert out.ratio.tolist() == pytest.approx([math.exp(0.25)] * 2 + [math.exp(0.1)] * 2)


def test_mask_mode_drops_a_sample_out_of_bounds_where_truncate_clamps_it():
    masked = tis_weights(OLD, ROLLOUT, clip=1.5, clip_low=0.5, level="sequence", mode="mask", **LAYOUT)
    assert masked.weights.tolist() == pytest.approx([0.0, 0.0] + [math.exp(0.1)] * 2)  # exp(0.5) = 1.65 > 1.5
    assert masked.clipfrac.tolist() == [1.0, 1.0, 0.0, 0.0]
    truncated = tis_weights(OLD, ROLLOUT, clip=1.5, clip_low=0.5, level="sequence", **LAYOUT)
    assert truncated.weights.tolist() == pytest.approx([1.5, 1.5] + [math.exp(0.1)] * 2)


def test_a_long_sequences_log_ratio_is_bounded_before_exp():
    out = tis_weights(torch.full((100,), 1.0), torch.zeros(100), clip=2.0, level="sequence",
                      mask=torch.ones(100), segment_ids=torch.zeros(100, dtype=torch.long), num_segments=1)
    assert out.ratio[0].item() == pytest.approx(math.exp(20.0)) and out.weights[0].item() == 2.0


def test_per_sample_levels_need_the_layout():
    with pytest.raises(ValueError, match="tis level='sequence' needs mask, segment_ids and num_segments"):
        tis_weights(OLD, ROLLOUT, level="sequence")


def test_the_objective_applies_the_level_and_mode_the_config_names():
    from rlkube_runtime.algorithms.loss import PolicyLossConfig, policy_objective

    old = [OLD[:2], OLD[2:]]  # also the current policy: ratio 1, so each counted token's pg loss is -A * weight
    config = PolicyLossConfig(use_tis=True, tis_clip=1.5, tis_clip_low=0.5, tis_level="sequence", tis_mode="mask")
    _, metrics = policy_objective(
        log_probs=old, old_log_probs=old, advantages=[torch.ones(2), torch.ones(2)],
        loss_masks=[torch.ones(2), torch.tensor([1.0, 0.0])], rollout_log_probs=[torch.zeros(2), torch.zeros(2)],
        config=config, global_num_samples=2, global_num_tokens=3,
    )
    # Sample A (ratio exp(0.5) > 1.5) is dropped; B's one counted token weighs exp(0.1).
    assert metrics["pg_loss"].item() == pytest.approx((0.0 - math.exp(0.1)) / 2)
    assert metrics["tis_clipfrac"].item() == pytest.approx(0.5)

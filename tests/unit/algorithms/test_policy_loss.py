import math

import pytest
import torch

from rlkube_runtime.algorithms import (
    ADVANTAGE_ESTIMATORS,
    PPO_KL_FUNCTIONS,
    clipped_policy_loss,
    clipped_value_loss,
    segment_ids_from_lengths,
    sequence_ppo_kl,
)


def _ppo_kl(ratios):
    return -torch.log(torch.tensor(ratios, dtype=torch.float64))


def test_clipped_loss_inside_above_and_below_the_clip_range():
    # eps_clip 0.2, eps_clip_high 0.28 -> clip range [0.8, 1.28]; loss = max(-A r, -A clip(r))
    # A=+1 r=1.1 (inside):  max(-1.1, -1.1) = -1.1,  clipfrac 0
    # A=+1 r=1.5 (above):   max(-1.5, -1.28) = -1.28, clipfrac 1
    # A=-1 r=0.5 (below):   max(0.5, 0.8) = 0.8,      clipfrac 1
    # A=+1 r=0.5 (below, A>0: unclipped is larger): max(-0.5, -0.8) = -0.5, clipfrac 0
    # A=-1 r=1.5 (above, A<0: unclipped is larger): max(1.5, 1.28) = 1.5,   clipfrac 0
    losses, clipfrac = clipped_policy_loss(
        _ppo_kl([1.1, 1.5, 0.5, 0.5, 1.5]),
        torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0]),
        eps_clip=0.2,
        eps_clip_high=0.28,
    )
    assert losses.tolist() == pytest.approx([-1.1, -1.28, 0.8, -0.5, 1.5])
    assert clipfrac.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_dual_clip_caps_the_loss_of_negative_advantages_at_eps_clip_c():
    # A=-1 r=5: max(5, 1.28) = 5 -> min(5, -A * 3) = 3; A=+1 r=5 is unaffected: max(-5, -1.28) = -1.28
    # A=-1 r=2: max(2, 1.28) = 2 -> min(2, 3) = 2 (below the cap)
    losses, clipfrac = clipped_policy_loss(
        _ppo_kl([5.0, 5.0, 2.0]), torch.tensor([-1.0, 1.0, -1.0]), eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0
    )
    assert losses.tolist() == pytest.approx([3.0, -1.28, 2.0])
    assert clipfrac.tolist() == [0.0, 1.0, 0.0]


def test_eps_clip_high_none_means_symmetric_clip():
    # range [0.8, 1.2]: A=1 r=1.5 -> -1.2
    losses, _ = clipped_policy_loss(_ppo_kl([1.5]), torch.tensor([1.0]), eps_clip=0.2, eps_clip_high=None)
    assert losses.item() == pytest.approx(-1.2)


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="eps_clip_c=1.0"):
        clipped_policy_loss(_ppo_kl([1.0]), torch.tensor([1.0]), eps_clip=0.2, eps_clip_c=1.0)


def test_gspo_ratio_is_the_exp_of_the_masked_mean_log_ratio_per_sample():
    # sample 0: new [-1, -2, -3], old [-1.2, -2.2, -2.9], mask [1, 1, 0]
    #   old - new = [-0.2, -0.2, 0.1] -> masked mean -0.2 -> ratio exp(0.2) = 1.221403 on all 3 tokens
    # sample 1: new = old -> ratio 1
    new = torch.tensor([-1.0, -2.0, -3.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.2, -2.2, -2.9, -0.5], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    seg = segment_ids_from_lengths([3, 1])
    kl = sequence_ppo_kl(new, old, mask, seg, 2)
    assert (-kl).exp().tolist() == pytest.approx([math.exp(0.2)] * 3 + [1.0])
    # The gradient flows through the sequence mean (no detach, as slime): with A = 1 and no clipping,
    # sample 0's summed loss is -3 s, s = exp(mean(new - old)); d/d new_0 = -3 s / 2 = -1.832104; masked token: 0.
    losses, _ = clipped_policy_loss(kl, torch.ones(4, dtype=torch.float64), eps_clip=10.0, eps_clip_high=10.0)
    losses[:3].sum().backward()
    assert new.grad.tolist() == pytest.approx([-1.5 * math.exp(0.2), -1.5 * math.exp(0.2), 0.0, 0.0])


def test_every_advantage_estimator_has_a_policy_ratio():
    assert set(PPO_KL_FUNCTIONS) == set(ADVANTAGE_ESTIMATORS)


def test_clipped_value_loss_by_hand():
    # token 0: old 0.5, new 1.0 -> clipped 0.7 (value_clip 0.2);
    #   max((0.7-1.5)^2, (1.0-1.5)^2) = max(0.64, 0.25) = 0.64, clipped
    # token 1: old = new = 2.0 -> (2-1)^2 = 1, not clipped
    loss, clipfrac = clipped_value_loss(
        torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.0]), torch.tensor([1.5, 1.0]), value_clip=0.2
    )
    assert loss.tolist() == pytest.approx([0.64, 1.0])
    assert clipfrac.tolist() == [1.0, 0.0]

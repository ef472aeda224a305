import math

import pytest
import torch

from rlkube_runtime.algorithms import compute_advantages, discounted_cumsum, gae, group_normalize


def _ones(*lengths):
    return [torch.ones(n) for n in lengths]


def test_grpo_with_std_normalisation_uses_unbiased_std_and_eps_1e6():
    # rewards [1, 0, 0, 1] -> mean 0.5, centred +-0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # -> +-0.5 / (0.57735 + 1e-6) = +-0.866024, broadcast to every response token.
    adv, returns = compute_advantages("grpo", rewards=[1.0, 0.0, 0.0, 1.0], group_size=4, loss_masks=_ones(2, 3, 1, 2))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert [t.tolist() for t in adv] == [
        pytest.approx([a, a]),
        pytest.approx([-a] * 3),
        [pytest.approx(-a)],
        pytest.approx([a, a]),
    ]
    assert returns is None


def test_grpo_without_std_normalisation_only_centres():
    # groups of 2: [1, 0] -> mean 0.5 -> [0.5, -0.5]; [3, 1] -> mean 2 -> [1, -1]
    adv, _ = compute_advantages(
        "grpo", rewards=[1.0, 0.0, 3.0, 1.0], group_size=2, loss_masks=_ones(1, 1, 1, 1), grpo_std_normalization=False
    )
    assert [t.item() for t in adv] == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_grpo_group_with_equal_rewards_gives_zeros_not_nan():
    # second group [1, 1, 1, 1]: centred 0, std 0 -> 0 / (0 + 1e-6) = 0
    adv, _ = compute_advantages(
        "grpo", rewards=[1.0, 0.0, 0.0, 1.0] + [1.0] * 4, group_size=4, loss_masks=_ones(*[2] * 8)
    )
    assert all(t.tolist() == [0.0, 0.0] for t in adv[4:])


def test_grpo_group_of_one_sample_gives_zero():
    adv, _ = compute_advantages("grpo", rewards=[5.0, 2.0], group_size=1, loss_masks=_ones(2, 2))
    assert [t.tolist() for t in adv] == [[0.0, 0.0], [0.0, 0.0]]


def test_gspo_advantages_equal_grpo_advantages():
    kwargs = dict(rewards=[0.2, 0.9, 0.4, 0.4], group_size=2, loss_masks=_ones(3, 1, 2, 2))
    grpo, _ = compute_advantages("grpo", **kwargs)
    gspo, _ = compute_advantages("gspo", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(grpo, gspo, strict=True))


def test_reinforce_plus_plus_discounted_returns_by_hand_with_gamma_half():
    # kl [0.1, 0.2, 0.3], kl_coef 0.5 -> token rewards [-0.05, -0.1, -0.15 + 1.0 (reward on last token)]
    # G2 = 0.85; G1 = -0.1 + 0.5 * 0.85 = 0.325; G0 = -0.05 + 0.5 * 0.325 = 0.1125
    adv, returns = compute_advantages(
        "reinforce_plus_plus",
        rewards=[1.0],
        group_size=1,
        loss_masks=_ones(3),
        kl=[torch.tensor([0.1, 0.2, 0.3])],
        kl_coef=0.5,
        gamma=0.5,
        normalize_advantages=False,
    )
    assert returns[0].tolist() == pytest.approx([0.1125, 0.325, 0.85])
    assert adv[0].tolist() == pytest.approx([0.1125, 0.325, 0.85])


def test_reinforce_plus_plus_puts_reward_on_last_masked_token():
    # mask [1, 1, 0]: token rewards [-0.05, -0.1 + 1.0, -0.15]
    # G2 = -0.15; G1 = 0.9 + 0.5 * -0.15 = 0.825; G0 = -0.05 + 0.5 * 0.825 = 0.3625
    _, returns = compute_advantages(
        "reinforce_plus_plus",
        rewards=[1.0],
        group_size=1,
        loss_masks=[torch.tensor([1, 1, 0])],
        kl=[torch.tensor([0.1, 0.2, 0.3])],
        kl_coef=0.5,
        gamma=0.5,
    )
    assert returns[0].tolist() == pytest.approx([0.3625, 0.825, -0.15])


def test_reinforce_plus_plus_whitens_over_masked_tokens_by_default():
    # returns [0.1125, 0.325, 0.85]: mean 0.429167, unbiased var 0.288229 / 2 = 0.144115, std 0.379624
    # -> (x - mean) / sqrt(var + 1e-8) = [-0.834158, -0.274394, 1.108552]
    adv, returns = compute_advantages(
        "reinforce_plus_plus",
        rewards=[1.0],
        group_size=1,
        loss_masks=_ones(3),
        kl=[torch.tensor([0.1, 0.2, 0.3])],
        kl_coef=0.5,
        gamma=0.5,
    )
    assert adv[0].tolist() == pytest.approx([-0.834158, -0.274394, 1.108552], abs=1e-5)
    assert returns[0].tolist() == pytest.approx([0.1125, 0.325, 0.85])


def test_reinforce_plus_plus_baseline_centres_per_group_subtracts_kl_and_whitens():
    # group [1, 0] -> mean 0.5 -> [0.5, -0.5] (no std division even with grpo_std_normalization)
    # minus kl_coef * kl = 0.5 * [0.2, 0.4] and 0.5 * [0.0, 0.2] -> [0.4, 0.3], [-0.5, -0.6]
    kwargs = dict(
        rewards=[1.0, 0.0],
        group_size=2,
        loss_masks=_ones(2, 2),
        kl=[torch.tensor([0.2, 0.4]), torch.tensor([0.0, 0.2])],
        kl_coef=0.5,
    )
    raw, _ = compute_advantages("reinforce_plus_plus_baseline", normalize_advantages=False, **kwargs)
    assert [t.tolist() for t in raw] == [pytest.approx([0.4, 0.3]), pytest.approx([-0.5, -0.6])]
    # whitened: mean -0.1, deviations [0.5, 0.4, -0.4, -0.5], unbiased var 0.82 / 3 = 0.273333, std 0.522813
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", **kwargs)
    assert torch.cat(adv).tolist() == pytest.approx([0.956365, 0.765092, -0.765092, -0.956365], abs=1e-5)


def test_ppo_gae_by_hand_on_three_tokens():
    # gamma 0.9, lambda 0.8, values [0.5, 0.4, 0.3], reward 1 on the last token, kl_coef 0.1 with kl 1 per token
    # token rewards [-0.1, -0.1, 0.9]
    # delta2 = 0.9 + 0.9 * 0 - 0.3 = 0.6
    # delta1 = -0.1 + 0.9 * 0.3 - 0.4 = -0.23
    # delta0 = -0.1 + 0.9 * 0.4 - 0.5 = -0.24
    # gamma * lambda = 0.72: A2 = 0.6; A1 = -0.23 + 0.72 * 0.6 = 0.202; A0 = -0.24 + 0.72 * 0.202 = -0.09456
    # returns = A + V = [0.40544, 0.602, 0.9]
    adv, returns = compute_advantages(
        "ppo",
        rewards=[1.0],
        group_size=1,
        loss_masks=_ones(3),
        kl=[torch.ones(3)],
        values=[torch.tensor([0.5, 0.4, 0.3])],
        kl_coef=0.1,
        gamma=0.9,
        gae_lambda=0.8,
        normalize_advantages=False,
    )
    assert adv[0].tolist() == pytest.approx([-0.09456, 0.202, 0.6])
    assert returns[0].tolist() == pytest.approx([0.40544, 0.602, 0.9])


def test_ppo_whitens_advantages_but_not_returns_by_default():
    kwargs = dict(
        rewards=[1.0, 0.0],
        group_size=1,
        loss_masks=_ones(3, 2),
        values=[torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.1])],
    )
    adv, returns = compute_advantages("ppo", **kwargs)
    raw, raw_returns = compute_advantages("ppo", normalize_advantages=False, **kwargs)
    flat = torch.cat(adv)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std().item() == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(returns, raw_returns, strict=True))


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, torch.zeros(1, 3), gamma=0.5, gae_lambda=1.0)
    assert adv.tolist() == [[0.25, 0.5, 1.0]]
    assert ret.tolist() == [[0.25, 0.5, 1.0]]


def test_discounted_cumsum_matches_a_sequential_loop_across_chunks():
    x = torch.randn(3, 300, dtype=torch.float64)
    for factor in (0.0, 0.37, 0.99, 1.0):
        expected, running = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(300)):
            running = x[:, t] + factor * running
            expected[:, t] = running
        assert torch.allclose(discounted_cumsum(x, factor), expected)


def test_group_normalize_rejects_partial_groups():
    with pytest.raises(ValueError, match="group_size=4"):
        group_normalize(torch.ones(6), 4)


def test_compute_advantages_validates_its_inputs():
    with pytest.raises(ValueError, match=r"estimator='dapo'.*grpo, gspo, ppo, reinforce_plus_plus"):
        compute_advantages("dapo", rewards=[1.0], group_size=1, loss_masks=_ones(1))
    with pytest.raises(ValueError, match="needs the critic's per-token values"):
        compute_advantages("ppo", rewards=[1.0], group_size=1, loss_masks=_ones(1))
    with pytest.raises(ValueError, match="kl_coef=0.1"):
        compute_advantages("reinforce_plus_plus", rewards=[1.0], group_size=1, loss_masks=_ones(1), kl_coef=0.1)
    with pytest.raises(ValueError, match="rewards has 2 values"):
        compute_advantages("grpo", rewards=[1.0, 0.0], group_size=1, loss_masks=_ones(1))
    with pytest.raises(ValueError, match=r"kl\[0\] has 2 tokens"):
        compute_advantages("reinforce_plus_plus", rewards=[1.0], group_size=1, loss_masks=_ones(1), kl=[torch.ones(2)])
    with pytest.raises(ValueError, match="gamma=1.5"):
        compute_advantages("reinforce_plus_plus", rewards=[1.0], group_size=1, loss_masks=_ones(1), gamma=1.5)

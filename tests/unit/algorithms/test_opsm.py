"""Off-policy sequence masking: which samples lose their policy-gradient loss, by hand and on
random inputs against slime's per-sample definition (`compute_opsm_mask`)."""

from __future__ import annotations

import pytest
import torch

from rlkube_runtime.algorithms.loss import PolicyLossConfig, policy_objective
from rlkube_runtime.algorithms.opsm import opsm_mask
from rlkube_runtime.algorithms.segments import segment_ids_from_lengths

T = torch.tensor


def test_a_failed_sample_the_policy_moved_away_from_is_masked_and_no_other():
    # Sample 0: advantage -1, engine log-probs 0.3 above the current policy's: drift 0.3 > 0.1, masked.
    # Sample 1: advantage -1, drift 0.05 <= 0.1: kept.  Sample 2: advantage +1, drift 0.5: kept (it succeeded).
    log_probs = [T([-1.0, -2.0]), T([-1.0]), T([-0.5, -0.5, -0.5])]
    engine = [T([-0.7, -1.7]), T([-0.95]), T([0.0, 0.0, 0.0])]
    advantages = [T([-1.0, -1.0]), T([-1.0]), T([1.0, 1.0, 1.0])]
    masks = [torch.ones(2), torch.ones(1), torch.ones(3)]
    segments = segment_ids_from_lengths(T([2, 1, 3]))
    result = opsm_mask(torch.cat(log_probs), torch.cat(engine), torch.cat(advantages), torch.cat(masks), segments, 3,
                       delta=0.1)
    assert torch.allclose(result.sequence_kl, T([0.3, 0.05, 0.5]))
    assert result.keep.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]

    # In the objective: ratio 1 everywhere (old = new), so per token pg = -A; per-sample means
    # (0 for the masked sample, then +1, then -1) over 3 samples: 0; masked share: (1 + 0 + 0) / 3.
    config = PolicyLossConfig(use_opsm=True, opsm_delta=0.1)
    loss, metrics = policy_objective(
        log_probs=log_probs, old_log_probs=log_probs, advantages=advantages, loss_masks=masks,
        rollout_log_probs=engine, config=config, global_num_samples=3, global_num_tokens=6,
    )
    assert metrics["pg_loss"].item() == pytest.approx((0.0 + 1.0 - 1.0) / 3, abs=1e-6)
    assert metrics["opsm_clipfrac"].item() == pytest.approx(1 / 3)
    _, unmasked = policy_objective(
        log_probs=log_probs, old_log_probs=log_probs, advantages=advantages, loss_masks=masks,
        rollout_log_probs=engine, config=PolicyLossConfig(), global_num_samples=3, global_num_tokens=6,
    )
    assert unmasked["pg_loss"].item() == pytest.approx((1.0 + 1.0 - 1.0) / 3)


def test_tokens_outside_the_loss_mask_do_not_count_toward_the_drift():
    # A tool response (mask 0) with a huge gap does not push the sample over delta.
    result = opsm_mask(T([-1.0, -1.0]), T([-1.0, 50.0]), T([-1.0, -1.0]), T([1.0, 0.0]), T([0, 0]), 1, delta=1e-4)
    assert result.sequence_kl.tolist() == [0.0] and result.keep.tolist() == [1.0, 1.0]


def _slime_opsm(log_probs, old_log_probs, advantages, loss_masks, delta):
    """slime's compute_opsm_mask, per sample: 0 where (advantage < 0 and seq_kl > delta)."""
    out = []
    for lp, old, adv, m in zip(log_probs, old_log_probs, advantages, loss_masks):
        seq_kl = ((old - lp) * m).sum() / torch.clamp_min(m.sum(), 1)
        out.append(1 - ((adv < 0) & (seq_kl > delta)).float())
    return torch.cat(out)


@pytest.mark.parametrize("seed", range(5))
def test_the_mask_is_slimes_on_random_samples(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (7,), generator=g)
    log_probs = [-torch.rand(int(n), generator=g) * 3 for n in lengths]
    engine = [lp + torch.randn(int(lp.numel()), generator=g) * 0.05 for lp in log_probs]
    advantages = [torch.full((int(n),), float(torch.randn(1, generator=g))) for n in lengths]
    masks = [(torch.rand(int(n), generator=g) > 0.2).float() for n in lengths]
    ours = opsm_mask(torch.cat(log_probs), torch.cat(engine), torch.cat(advantages), torch.cat(masks),
                     segment_ids_from_lengths(lengths), len(lengths), delta=0.01)
    expected = _slime_opsm(log_probs, engine, advantages, masks, 0.01)
    assert torch.equal(ours.keep, expected)


def test_opsm_needs_the_engines_log_probs():
    with pytest.raises(ValueError, match="use_opsm=True needs rollout_log_probs"):
        policy_objective(log_probs=[T([-1.0])], old_log_probs=[T([-1.0])], advantages=[T([1.0])],
                         loss_masks=[torch.ones(1)], config=PolicyLossConfig(use_opsm=True),
                         global_num_samples=1, global_num_tokens=1)

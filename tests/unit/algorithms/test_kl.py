import math

import pytest
import torch

from rlkube_runtime.algorithms import KL_ESTIMATORS, compute_approx_kl


def test_kl_estimators_at_hand_picked_log_prob_pairs():
    # log_ratio = logp - ref: pair 1 gives +1, pair 2 gives -1.
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    # k1 = log_ratio
    assert compute_approx_kl(logp, ref, "k1").tolist() == pytest.approx([1.0, -1.0])
    # k2 = log_ratio^2 / 2
    assert compute_approx_kl(logp, ref, "k2").tolist() == pytest.approx([0.5, 0.5])
    # k3 = exp(-lr) - 1 + lr: exp(-1) - 1 + 1 = 0.367879; exp(1) - 1 - 1 = 0.718282
    expected_k3 = [math.exp(-1), math.e - 2]
    assert compute_approx_kl(logp, ref, "k3").tolist() == pytest.approx(expected_k3)
    assert compute_approx_kl(logp, ref, "low_var_kl").tolist() == pytest.approx(expected_k3)


def test_kl_is_zero_when_policies_agree():
    logp = torch.tensor([-0.3, -4.0])
    for kl_type in KL_ESTIMATORS:
        assert compute_approx_kl(logp, logp, kl_type).tolist() == [0.0, 0.0]


def test_low_var_kl_is_clamped_at_10_and_k3_is_not():
    # log_ratio = -25 - (-5) = -20: k3 = exp(20) - 1 - 20 = 4.85e8; slime clamps only "low_var_kl" to [-10, 10].
    logp, ref = torch.tensor([-25.0]), torch.tensor([-5.0])
    assert compute_approx_kl(logp, ref, "low_var_kl").item() == 10.0
    assert compute_approx_kl(logp, ref, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_kl_upcasts_half_precision_to_float32():
    logp = torch.tensor([-1.0], dtype=torch.bfloat16)
    assert compute_approx_kl(logp, logp, "k1").dtype == torch.float32


def test_unknown_kl_type_raises_listing_known_names():
    with pytest.raises(ValueError, match=r"kl_type='k4'.*k1, k2, k3, low_var_kl"):
        compute_approx_kl(torch.zeros(1), torch.zeros(1), "k4")

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

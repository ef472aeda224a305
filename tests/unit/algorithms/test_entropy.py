import math

import pytest
import torch

from rlkube_runtime.algorithms import entropy_from_logits, log_probs_from_logits


def test_entropy_of_uniform_logits_is_log_vocab_size_for_2d_and_3d():
    # softmax of equal logits is uniform over V = 7 -> entropy log 7.
    assert torch.allclose(entropy_from_logits(torch.full((4, 7), 3.0)), torch.full((4,), math.log(7)))
    out = entropy_from_logits(torch.zeros(2, 3, 7))
    assert out.shape == (2, 3)
    assert torch.allclose(out, torch.full((2, 3), math.log(7)))


def test_entropy_is_stable_for_huge_and_minus_inf_logits():
    # [1000, 1000] -> uniform over 2 -> log 2; [0, 0, -inf, -inf] -> uniform over 2 -> log 2, no NaN.
    logits = torch.tensor([[1000.0, 1000.0, -1000.0], [0.0, 0.0, -math.inf]], requires_grad=True)
    out = entropy_from_logits(logits)
    assert out.tolist() == pytest.approx([math.log(2), math.log(2)])
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_categorical_on_random_logits():
    logits = torch.randn(5, 11, dtype=torch.float64) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected)


def test_log_probs_are_log_softmax_of_tempered_logits_at_tokens():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(log_probs_from_logits(logits, tokens, 0.7), expected)


def test_temperature_zero_or_none_means_one():
    logits, tokens = torch.randn(4, 6), torch.tensor([0, 1, 2, 5])
    at_one = log_probs_from_logits(logits, tokens, 1.0)
    assert torch.equal(log_probs_from_logits(logits, tokens, 0), at_one)
    assert torch.equal(log_probs_from_logits(logits, tokens, None), at_one)
    assert torch.equal(entropy_from_logits(logits, 0), entropy_from_logits(logits))


def test_log_probs_of_bf16_logits_are_float32():
    out = log_probs_from_logits(torch.zeros(3, 4, dtype=torch.bfloat16), torch.tensor([0, 1, 2]))
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([-math.log(4)] * 3)


def test_token_shape_mismatch_and_negative_temperature_raise():
    with pytest.raises(ValueError, match="tokens has shape"):
        log_probs_from_logits(torch.zeros(3, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="temperature=-1"):
        log_probs_from_logits(torch.zeros(3, 4), torch.tensor([0, 1, 2]), -1.0)

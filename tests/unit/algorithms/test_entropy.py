import math

import pytest
import torch

from rlkube_runtime.algorithms import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_entropy_equal_the_plain_functions_in_value_and_gradient(temperature):
    torch.manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.float64)
    logits[3, 7] = float("-inf")  # a token the model can never say
    tokens = torch.randint(0, 50, (37,))
    tokens[3] = 8
    w_logp, w_ent = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)

    fused_in = logits.clone().requires_grad_(True)
    logp, ent = log_probs_and_entropy(fused_in, tokens, temperature, chunk_elements=50 * 8)  # 5 chunks
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()

    plain_in = logits.clone().requires_grad_(True)
    plain_logp = log_probs_from_logits(plain_in, tokens, temperature)
    plain_ent = entropy_from_logits(plain_in, temperature)
    ((plain_logp * w_logp).sum() + (plain_ent * w_ent).sum()).backward()

    assert torch.allclose(logp, plain_logp, atol=1e-12)
    assert torch.allclose(ent, plain_ent, atol=1e-12)
    assert torch.allclose(fused_in.grad, plain_in.grad, atol=1e-12)
    assert torch.isfinite(fused_in.grad).all() and fused_in.grad[3, 7] == 0


def test_chunked_entropy_without_gradient_is_a_metric_only():
    torch.manual_seed(1)
    logits = torch.randn(9, 11, dtype=torch.float64)
    tokens = torch.randint(0, 11, (9,))
    fused_in = logits.clone().requires_grad_(True)
    logp, ent = log_probs_and_entropy(fused_in, tokens, entropy_grad=False, chunk_elements=22)
    assert not ent.requires_grad
    logp.sum().backward()
    plain_in = logits.clone().requires_grad_(True)
    log_probs_from_logits(plain_in, tokens).sum().backward()
    assert torch.allclose(fused_in.grad, plain_in.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: log_probs_and_entropy(x, tokens, 0.5, chunk_elements=30), (logits.clone().requires_grad_(),))


def test_chunked_log_probs_keep_bf16_logits_gradients_in_bf16():
    logits = torch.randn(4, 16).to(torch.bfloat16).requires_grad_(True)
    logp, ent = log_probs_and_entropy(logits, torch.tensor([0, 1, 2, 3]), with_entropy=False)
    assert logp.dtype == torch.float32 and ent is None
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_chunks_on_a_gpu_equal_the_plain_functions_at_a_real_vocabulary():
    """Against the plain functions in float64: the unchunked bf16 path is no reference for the
    gradient (its two float32 branches are each rounded to bf16 and then summed in bf16)."""
    torch.manual_seed(0)
    logits = (torch.randn(3000, 151936, device="cuda") * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 151936, (3000,), device="cuda")
    fused_in = logits.clone().requires_grad_(True)
    logp, ent = log_probs_and_entropy(fused_in, tokens, 0.8, compiled=True)  # 4 chunks, the last shorter
    (logp.sum() + ent.sum()).backward()
    exact_in = logits.double().requires_grad_(True)
    exact_logp = log_probs_from_logits(exact_in, tokens, 0.8)
    exact_ent = entropy_from_logits(exact_in, 0.8)
    (exact_logp.sum() + exact_ent.sum()).backward()
    torch.testing.assert_close(logp.double(), exact_logp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), exact_ent, rtol=1e-5, atol=1e-4)
    # float32 arithmetic, then one rounding to bf16 (half a bf16 step: 2**-8 relative)
    torch.testing.assert_close(fused_in.grad.double(), exact_in.grad, rtol=2**-8, atol=1e-5)

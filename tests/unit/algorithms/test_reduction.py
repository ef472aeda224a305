import itertools

import pytest
import torch

from rlkube_runtime.algorithms import (
    global_counts,
    masked_mean,
    masked_whiten,
    pack,
    reduce_loss,
    reduce_per_sample,
    reduce_per_token,
    segment_ids_from_lengths,
)

# Two samples of different lengths: [1, 2, 3] with mask [1, 1, 0] and [4, 5, 6, 7, 8] with mask [1, 1, 1, 1, 0].
VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
MASK = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0])
SEG = segment_ids_from_lengths([3, 5])


def test_per_sample_mean_by_hand():
    # sample means (1 + 2) / 2 = 1.5 and (4 + 5 + 6 + 7) / 4 = 5.5 -> (1.5 + 5.5) / 2 = 3.5
    assert reduce_per_sample(VALUES, MASK, SEG, num_segments=2, global_num_samples=2).item() == pytest.approx(3.5)


def test_per_token_mean_by_hand():
    # (1 + 2 + 4 + 5 + 6 + 7) / 6 = 25 / 6
    assert reduce_per_token(VALUES, MASK, global_num_tokens=6).item() == pytest.approx(25 / 6)
    assert masked_mean(VALUES, MASK).item() == pytest.approx(25 / 6)


def test_global_counts_are_samples_and_masked_tokens():
    assert global_counts([torch.tensor([1, 1, 0]), torch.tensor([1, 1, 1, 1, 0])]) == (2, 6)


def test_fully_masked_sample_contributes_zero_but_counts_as_a_sample():
    # sample means 1.5 and 0 (nothing masked) over 2 samples -> 0.75
    mask = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    assert reduce_per_sample(VALUES, mask, SEG, num_segments=2, global_num_samples=2).item() == pytest.approx(0.75)


def test_masked_mean_along_a_dim():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    assert masked_mean(values, torch.tensor([[1, 0], [1, 1]]), dim=1).tolist() == [1.0, 6.0]


def test_masked_whiten_uses_unbiased_variance_over_masked_elements():
    # masked [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; the unmasked 10 is transformed too: (10 - 2) / 1 = 8
    out = masked_whiten(torch.tensor([1.0, 2.0, 3.0, 10.0]), torch.tensor([1, 1, 1, 0]))
    assert out.tolist() == pytest.approx([-1.0, 0.0, 1.0, 8.0], abs=1e-6)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 5, 2, 4, 6]
    masks = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    masks[1] = torch.zeros(1)  # a fully masked sample
    values = [torch.randn(n, generator=gen, dtype=torch.float64) for n in lengths]
    return values, masks


def _partitions(num):
    # contiguous splits at every point, plus interleaved orders: each sample sits whole in one micro-batch
    for cut in range(1, num):
        yield [list(range(cut)), list(range(cut, num))]
    yield [[0, 2, 4], [1, 3, 5]]
    yield [[5, 0], [3, 1, 4, 2]]


@pytest.mark.parametrize("per_token_loss", [False, True])
def test_micro_batch_contributions_sum_to_the_global_mean_with_equal_gradients(per_token_loss):
    values, masks = _batch()
    num_samples, num_tokens = global_counts(masks)
    # the global mean by definition
    if per_token_loss:
        expected = sum((v * m).sum() for v, m in zip(values, masks, strict=True)) / num_tokens
    else:
        expected = sum((v * m).sum() / m.sum().clamp(min=1) for v, m in zip(values, masks, strict=True)) / num_samples

    def run(groups):
        leaves = [v.clone().requires_grad_(True) for v in values]
        total = 0.0
        for idx in groups:
            flat, lengths = pack([leaves[i] for i in idx])
            mask_flat, _ = pack([masks[i] for i in idx])
            total = total + reduce_loss(
                flat,
                mask_flat,
                segment_ids_from_lengths(lengths),
                num_segments=len(idx),
                per_token_loss=per_token_loss,
                global_num_samples=num_samples,
                global_num_tokens=num_tokens,
            )
        total.backward()
        return total.item(), [leaf.grad for leaf in leaves]

    whole, whole_grads = run([list(range(6))])
    assert whole == pytest.approx(expected.item(), rel=1e-12)
    for groups in itertools.chain(_partitions(6)):
        total, grads = run(groups)
        assert total == pytest.approx(whole, rel=1e-12)
        assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-15) for g, w in zip(grads, whole_grads, strict=True))


def test_global_counts_must_be_sensible():
    with pytest.raises(ValueError, match="global_num_samples=0"):
        reduce_per_sample(VALUES, MASK, SEG, num_segments=2, global_num_samples=0)
    with pytest.raises(ValueError, match="global_num_tokens=-1"):
        reduce_per_token(VALUES, MASK, global_num_tokens=-1)

"""pass@k against values worked out by hand from 1 - C(n-c, k) / C(n, k)."""

import pytest

from rlkube_runtime.rewards.pass_at_k import eval_dataset_metrics, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # k = 1 is the share correct: 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 3, 4, 13 / 14),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (4, 0, 4, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct one
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_differs_from_the_biased_plug_in_estimate():
    # Plug-in 1 - (1 - c/n)^k = 1 - 0.75^2 = 0.4375 for n=4, c=1, k=2; the unbiased value is 0.5.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5) != pytest.approx(1 - 0.75**2)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_impossible_counts_are_refused_with_the_numbers(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_dataset_metrics_average_pass_at_k_over_prompts():
    # Prompt A: 1 of 4 correct, prompt B: 2 of 4 (a -1 reward is wrong, like dapo's).
    metrics = eval_dataset_metrics(
        "math",
        [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, -1.0, 0.0]],
        response_lengths=[3, 5, 2, 6, 4, 4, 4, 4],
        truncated=[False, True, False, False, False, False, False, True],
        pass_k=[1, 2, 4],
    )
    assert metrics == pytest.approx({
        "eval/math/reward": 2 / 8,  # (1 + 0 + 0 + 0 + 1 + 1 - 1 + 0) / 8
        "eval/math/accuracy": 3 / 8,
        "eval/math/pass_at_1": (1 / 4 + 2 / 4) / 2,
        "eval/math/pass_at_2": (0.5 + 5 / 6) / 2,  # A: 1 - 3/6; B: 1 - 1/6
        "eval/math/pass_at_4": 1.0,  # each prompt has a correct response among its 4
        "eval/math/response_len/mean": 32 / 8,
        "eval/math/truncated_ratio": 2 / 8,
        "eval/math/num_prompts": 2.0,
    })

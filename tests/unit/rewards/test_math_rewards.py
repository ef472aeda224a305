"""math / dapo / deepscaler rewards on real strings; equivalence is math-verify's."""

import pytest
from rlkube_runtime.rewards import dapo_reward, deepscaler_reward, math_reward


@pytest.mark.parametrize(
    "response, label",
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"so the ratio is $\frac{2}{4}$", r"\frac{1}{2}"),
        (r"\boxed{2\sqrt{2}}", r"2\sqrt{2}"),
        (r"Therefore \boxed{x^2+1}", "x^2+1"),
        ("the total is 1,000 apples", "1000"),
        (r"\boxed{7}", 7),  # a JSON number label
        (r"\boxed{4}", r"\boxed{4}"),  # a label written as a boxed solution
    ],
)
def test_math_scores_one_for_an_equivalent_final_answer(response, label):
    assert math_reward(response, label) == 1.0


def test_math_counts_a_bare_equation_by_its_value_as_math_verify_does():
    # math-verify 0.9 reads "x = 4" as 4 (and \boxed{x = 4} as Eq(x, 4), which it also accepts
    # for the gold 4): the variable name is not part of the answer.
    assert math_reward("x = 4", "4") == 1.0
    assert math_reward(r"\boxed{x = 4}", "4") == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{2}", r"2\sqrt{2}"),  # the label is not cut down to its leading number
        ("I do not know", "4"),
        ("", "4"),
        (r"\boxed{4}", ""),
        (r"\boxed{4}", None),
    ],
)
def test_math_scores_zero_for_a_wrong_missing_or_unlabelled_answer(response, label):
    assert math_reward(response, label) == 0.0


def test_math_gives_no_credit_for_hedging_with_several_boxed_answers():
    # math-verify extracts both bare boxes as the set {3, 4}, which is not the answer 4.
    assert math_reward(r"maybe \boxed{3} or \boxed{4}", "4") == 0.0


# --- dapo (+1 / -1 after "Answer:") --------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label",
    [
        ("Reasoning...\nAnswer: 42", "42"),
        ("reasoning\nfinal answer: 42", "42"),  # the anchor is case-insensitive
        ("Answer: 41\nwait, recheck.\nAnswer: 42", "42"),  # the last Answer: counts
        (r"Answer: \frac{1}{2}", "0.5"),
        ("Answer: $1/2$", "0.5"),
    ],
)
def test_dapo_gives_plus_one_for_the_right_answer_after_answer_colon(response, label):
    assert dapo_reward(response, label) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        ("Answer: 41", "42"),
        (r"\boxed{42}", "42"),  # no Answer: line
        ("Answer: 42\n" + "more text " * 40, "42"),  # only the last 300 characters are read
        ("Answer: 42", ""),
    ],
)
def test_dapo_gives_minus_one_for_a_wrong_or_missing_answer(response, label):
    assert dapo_reward(response, label) == -1.0


# --- deepscaler (boxed answer after </think>, 1 / 0) ---------------------------------------------


def test_deepscaler_reads_the_boxed_answer_after_the_thinking():
    assert deepscaler_reward(r"<think>maybe \boxed{5}</think> So \boxed{4}.", "4") == 1.0
    assert deepscaler_reward(r"<think>maybe \boxed{4}</think> So \boxed{5}.", "4") == 0.0


def test_deepscaler_accepts_the_response_marker_and_boxed_labels():
    assert (
        deepscaler_reward(r"prompt ###Response it is \boxed{\frac{2}{4}}", r"\boxed{\frac{1}{2}}")
        == 1.0
    )


@pytest.mark.parametrize(
    "response",
    [
        r"\boxed{4}",  # no </think>: the reasoning never ended
        "<think>hm</think> the answer is 4",  # no boxed answer
    ],
)
def test_deepscaler_scores_zero_without_the_marker_or_a_boxed_answer(response):
    assert deepscaler_reward(response, "4") == 0.0


def test_math_reward_works_off_the_main_thread_where_signal_timeouts_are_unavailable():
    # Ray async actors run their event loop on another thread; math-verify's signal.alarm would
    # raise there, so the reward runs without it.
    import threading

    results = []
    worker = threading.Thread(
        target=lambda: results.append(math_reward(r"\boxed{\frac{1}{2}}", "0.5"))
    )
    worker.start()
    worker.join()
    assert results == [1.0]

"""f1 (SQuAD token F1) and exact (whitespace-normalised) rewards."""

import pytest
from rlkube_runtime.rewards import exact_reward, f1_reward, normalize_squad


def test_squad_normalisation_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_squad("  The Eiffel-Tower,  in A city!") == "eiffeltower in city"


def test_f1_is_the_harmonic_mean_of_token_precision_and_recall():
    # prediction {cat, sat}, gold {cat, sat, down}: precision 1, recall 2/3 -> F1 0.8
    assert f1_reward("The cat sat.", "a cat sat down") == pytest.approx(0.8)


def test_f1_counts_repeated_tokens_only_as_often_as_the_gold_has_them():
    # prediction [a1 a1 a1], gold [a1 b]: overlap 1 -> precision 1/3, recall 1/2 -> F1 0.4
    assert f1_reward("a1 a1 a1", "a1 b") == pytest.approx(0.4)


def test_f1_is_one_for_a_match_after_normalisation_and_zero_without_overlap():
    assert f1_reward("Paris.", "paris") == 1.0
    assert f1_reward("London", "Paris") == 0.0


def test_f1_takes_the_best_of_several_gold_answers():
    assert f1_reward("New York City", ["NYC", "New York City"]) == 1.0


def test_f1_of_empty_answers_matches_only_an_empty_gold():
    assert f1_reward("the", "") == 1.0  # both normalise to nothing
    assert f1_reward("", "Paris") == 0.0
    assert f1_reward("Paris", None) == 0.0


def test_exact_ignores_surrounding_and_repeated_whitespace_only():
    assert exact_reward("  hello \n  world ", "hello world") == 1.0
    assert exact_reward("Hello world", "hello world") == 0.0
    assert exact_reward("hello world.", "hello world") == 0.0


def test_exact_compares_with_the_label_as_text_and_any_of_a_list():
    assert exact_reward("42", 42) == 1.0
    assert exact_reward("b", ["a", "b"]) == 1.0
    assert exact_reward("", None) == 0.0

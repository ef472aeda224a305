"""Text-answer rewards: SQuAD-style token F1 (`f1`) and whitespace-normalised exact match (`exact`).

A label may be a list of acceptable answers; the best score over them counts (as SQuAD scores
against several gold answers).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def f1_reward(response: str, label: Any) -> float:
    """Token-level F1 between the response and the label after SQuAD normalisation, in [0, 1]."""
    return max((_f1(response, str(g)) for g in _golds(label)), default=0.0)


def exact_reward(response: str, label: Any) -> float:
    """1.0 when response and label are equal after stripping and collapsing whitespace."""
    answer = " ".join(response.split())
    return 1.0 if any(answer == " ".join(str(g).split()) for g in _golds(label)) else 0.0


def normalize_squad(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def _f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_squad(prediction).split()
    gold_tokens = normalize_squad(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)  # SQuAD v2: both empty is a match
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _golds(label: Any) -> list:
    if label is None:
        return []
    return list(label) if isinstance(label, (list, tuple)) else [label]

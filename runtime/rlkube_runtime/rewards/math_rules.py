"""Math answer rewards (`math`, `dapo`, `deepscaler`); answer equivalence is math-verify's.

Finding the answer in free text, normalising LaTeX and deciding equivalence (1/2 = 0.5 = \\frac{2}{4})
are all left to math-verify; this module only decides which part of the response to look at and
what score to give, following slime's reward hub:
- math: the response as a whole (math-verify's extraction prefers `\\boxed{}` and "final answer"
  phrases), 1 or 0. A bare equation counts by its value: math-verify finds `x = 4` equivalent to
  `4`. Several bare `\\boxed{}` answers are extracted together as a set, so hedging scores 0.
- dapo (slime's math_dapo): the text after the last `Answer:` in the last 300 characters, +1 when
  right, -1 when wrong or missing. slime compares normalised strings with the label cast to int;
  here the equivalence is math-verify's, so `Answer: 1/2` matches the label `0.5`.
- deepscaler: the part after `</think>` (or `###Response`); no such marker or no `\\boxed{}` in it
  gives 0; else 1 when the boxed answer matches. slime grades with hand-written sympy rules that
  refuse unreduced fractions; math-verify accepts `\\frac{2}{4}` for `\\frac{1}{2}`.

Labels are bare answers (`0.5`, `2\\sqrt{2}`, `x^2+1`); one without `$` or `\\boxed` is read as
LaTeX math (`$label$`) so `2\\sqrt{2}` is not cut to `2`.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

logger = logging.getLogger(__name__)

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL_CHARS = 300  # slime: the longest MATH-500 answer has 159 characters
_MATH_VERIFY_TIMEOUT_S = 5


def math_reward(response: str, label: Any) -> float:
    """1.0 when the response's final answer is equivalent to the label, else 0.0."""
    return 1.0 if _matches(_parse_response(response), label) else 0.0


def dapo_reward(response: str, label: Any) -> float:
    """+1.0 when the last `Answer: ...` near the end matches the label, else -1.0."""
    found = _DAPO_ANSWER.findall(response[-_DAPO_TAIL_CHARS:])
    if not found:
        return -1.0
    return 1.0 if _matches(_parse_bare_answer(found[-1].strip()), label) else -1.0


def deepscaler_reward(response: str, label: Any) -> float:
    """1.0 when the boxed answer after the reasoning matches the label, else 0.0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    if "\\boxed" not in solution and "\\fbox" not in solution:
        return 0.0
    return 1.0 if _matches(_parse_response(solution, boxed_first=True), label) else 0.0


# --- math-verify -------------------------------------------------------------------------------


def _matches(answer: list, label: Any) -> bool:
    if not answer or label is None or str(label).strip() == "":
        return False
    gold = _parse_bare_answer(str(label).strip())
    if not gold:
        logger.warning("math-verify cannot parse the label %r; the sample scores as wrong", label)
        return False
    from math_verify import verify

    return verify(gold, answer, timeout_seconds=_timeout())


def _parse_response(text: str, *, boxed_first: bool = False) -> list:
    from math_verify import parse

    if boxed_first:
        return parse(text, extraction_config=_boxed_first_config(), parsing_timeout=_timeout())
    return parse(text, parsing_timeout=_timeout())


def _parse_bare_answer(text: str) -> list:
    from math_verify import parse

    if "$" not in text and "\\boxed" not in text:
        parsed = parse(f"${text}$", parsing_timeout=_timeout())
        if parsed:
            return parsed
    return parse(text, parsing_timeout=_timeout())


@functools.cache
def _boxed_first_config() -> list:
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0)]


def _timeout() -> int | None:
    # math-verify times out through signal.alarm, which only works on the main thread; elsewhere
    # (a Ray async actor's event loop thread, say) it must run without its timeout.
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None

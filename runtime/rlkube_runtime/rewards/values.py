"""Turn what a reward function or server returned into the float training uses."""

from __future__ import annotations

import math
from typing import Any


def to_reward_value(value: Any, *, source: str) -> float:
    """Accept an int, float or bool (True -> 1.0); reject anything else and NaN/inf.

    A NaN reward would turn every advantage of its group into NaN, so it fails here, naming
    `source` (the function path or server URL) that produced it.
    """
    if not isinstance(value, (int, float)):
        raise TypeError(
            f"{source} returned {type(value).__name__} {value!r:.80}; a reward must be a number."
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{source} returned {reward}; a reward must be a finite number.")
    return reward

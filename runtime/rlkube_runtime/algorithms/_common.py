"""Helpers shared by the algorithm modules: registry lookup and dtype/argument checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def lookup(registry: Mapping[str, T], name: str, parameter: str) -> T:
    """Return `registry[name]`, or raise a ValueError naming `parameter`, the value and the known names."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        raise ValueError(f"{parameter}={name!r} is not known; use one of: {known}") from None


def as_float(x: Tensor | Sequence[float] | float) -> Tensor:
    """`x` as a floating tensor of at least float32 precision (bf16/fp16/int are upcast to float32)."""
    x = torch.as_tensor(x)
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.float()


def check_range(parameter: str, value: float, low: float, high: float) -> None:
    """Raise a ValueError unless low <= value <= high."""
    if not (low <= value <= high):
        raise ValueError(f"{parameter}={value!r} is out of range; use a value in [{low}, {high}]")


def check_same_layout(parameter: str, tensors: Sequence[Tensor], like: Sequence[Tensor], like_name: str) -> None:
    """Raise a ValueError unless `tensors` has one tensor per sample of `like`, each of the same length."""
    if len(tensors) != len(like):
        raise ValueError(
            f"{parameter} has {len(tensors)} samples but {like_name} has {len(like)}; pass one tensor per sample"
        )
    for i, (a, b) in enumerate(zip(tensors, like, strict=True)):
        if a.numel() != b.numel():
            raise ValueError(
                f"{parameter}[{i}] has {a.numel()} tokens but {like_name}[{i}] has {b.numel()}; "
                "every per-token tensor of a sample must cover the same response tokens"
            )

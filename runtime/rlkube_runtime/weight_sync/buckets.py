"""Which tensors travel together in one weight-sync request: pure planning, no I/O.

A bucket holds consecutive tensors (in state-dict order) up to a byte budget. A tensor larger
than the budget either goes alone (transports that must send whole tensors) or, with
`split_rows`, in blocks of rows that each fit, so no request is ever larger than the budget
(HTTP bodies carry the bytes themselves).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tensor `name`, or rows [rows[0], rows[1]) of it; `nbytes` in the transfer dtype."""

    name: str
    shape: tuple[int, ...]  # of this piece
    rows: tuple[int, int] | None
    nbytes: int


def plan_buckets(
    shapes: Sequence[tuple[str, tuple[int, ...]]], *, itemsize: int, bucket_bytes: int, split_rows: bool
) -> list[list[Piece]]:
    """Consecutive buckets of at most `bucket_bytes` each (see the module docstring)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        pieces = [Piece(name, tuple(shape), None, nbytes)]
        if nbytes > bucket_bytes and split_rows and len(shape) >= 1 and shape[0] > 1:
            row_bytes = nbytes // shape[0]
            step = max(1, bucket_bytes // row_bytes)
            pieces = [
                Piece(name, (min(start + step, shape[0]) - start, *shape[1:]), (start, min(start + step, shape[0])),
                      (min(start + step, shape[0]) - start) * row_bytes)
                for start in range(0, shape[0], step)
            ]
        for piece in pieces:
            if current and used + piece.nbytes > bucket_bytes:
                buckets.append(current)
                current, used = [], 0
            current.append(piece)
            used += piece.nbytes
    if current:
        buckets.append(current)
    return buckets

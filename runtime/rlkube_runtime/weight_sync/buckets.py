"""Which tensors travel together in one weight-sync request: pure planning, no I/O.

A bucket holds consecutive tensors (in state-dict order) up to a byte budget. A tensor larger
than the budget either goes alone (transports that must send whole tensors) or, with
`split_rows`, in blocks of rows that each fit, so no request is ever larger than the budget
(HTTP bodies carry the bytes themselves).

Tensors of one bucket may travel in different dtypes: each has its own itemsize (`itemsizes`, the
plan's `itemsize` otherwise), and a `quantized` weight (fp8 rollout: rlkube_runtime/fp8.py) counts its
e4m3 bytes plus its float32 block scales; its row splits fall on block boundaries (multiples of
`block_rows`), so each piece carries whole blocks and the matching rows of scales.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tensor `name`, or rows [rows[0], rows[1]) of it; `nbytes` in the transfer dtype (for a
    `quantized` piece: its e4m3 bytes plus its float32 scales)."""

    name: str
    shape: tuple[int, ...]  # of this piece
    rows: tuple[int, int] | None
    nbytes: int
    quantized: bool = False  # sent as e4m3 + `<name>_scale_inv` (rows[0] a multiple of the block rows)


def plan_buckets(
    shapes: Sequence[tuple[str, tuple[int, ...]]], *, itemsize: int, bucket_bytes: int, split_rows: bool,
    itemsizes: Mapping[str, int] | None = None, quantized: Collection[str] = (), block: tuple[int, int] = (128, 128),
) -> list[list[Piece]]:
    """Consecutive buckets of at most `bucket_bytes` each (see the module docstring)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    itemsizes = itemsizes or {}
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for name, shape in shapes:
        shape = tuple(shape)
        is_quantized = name in quantized
        if is_quantized and len(shape) != 2:
            raise ValueError(f"{name!r}: only 2-D weights quantize blockwise, got shape {list(shape)}")
        nbytes = _nbytes(shape, is_quantized, itemsizes.get(name, itemsize), block)
        pieces = [Piece(name, shape, None, nbytes, is_quantized)]
        if nbytes > bucket_bytes and split_rows and len(shape) >= 1 and shape[0] > 1:
            # Rows go in steps of `unit` (a block of rows when quantized), as many as fit.
            unit = min(block[0], shape[0]) if is_quantized else 1
            unit_bytes = _nbytes((unit, *shape[1:]), is_quantized, itemsizes.get(name, itemsize), block)
            step = max(1, bucket_bytes // unit_bytes) * unit
            if step < shape[0]:
                pieces = []
                for start in range(0, shape[0], step):
                    end = min(start + step, shape[0])
                    piece_shape = (end - start, *shape[1:])
                    pieces.append(Piece(name, piece_shape, (start, end),
                                        _nbytes(piece_shape, is_quantized, itemsizes.get(name, itemsize), block),
                                        is_quantized))
        for piece in pieces:
            if current and used + piece.nbytes > bucket_bytes:
                buckets.append(current)
                current, used = [], 0
            current.append(piece)
            used += piece.nbytes
    if current:
        buckets.append(current)
    return buckets


def _nbytes(shape: tuple[int, ...], quantized: bool, itemsize: int, block: tuple[int, int]) -> int:
    if not quantized:
        return math.prod(shape) * itemsize
    scales = math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1])
    return math.prod(shape) + 4 * scales  # one byte an entry, a float32 scale a block

"""Whose turn it is on the engines: one rollout at a time, in id order, and weight syncs between
rollouts, never during one.

Async mode asks for several rollouts ahead of training (`training.asyncBufferSize`). Generated
one after another, each rollout is served by a single weight version (what its samples record,
and what the staleness and off-policy correction are measured against); a sync waits for the
rollout in flight to finish and goes before the next one starts, as slime's async loop lets
the rollout in flight finish on the old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class GenerationTurns:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._next_rollout: int | None = None  # the id whose turn is next; None until the first
        self._generating = False
        self._syncs_waiting = 0

    @contextlib.asynccontextmanager
    async def rollout(self, rollout_id: int) -> AsyncIterator[None]:
        """Hold the engines for rollout `rollout_id`: after every lower id asked for has had its
        turn and no sync is waiting. The first id asked for starts the sequence."""
        async with self._changed:
            if self._next_rollout is None:
                self._next_rollout = rollout_id
            if rollout_id < self._next_rollout:
                raise RuntimeError(f"rollout {rollout_id} asked for a turn after rollout {self._next_rollout - 1} had one")
            await self._changed.wait_for(
                lambda: self._next_rollout == rollout_id and not self._generating and not self._syncs_waiting
            )
            self._generating = True
        try:
            yield
        finally:
            async with self._changed:
                self._generating = False
                self._next_rollout = rollout_id + 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def sync(self) -> AsyncIterator[None]:
        """Hold the engines for a weight sync: once the rollout in flight (if any) is done; no
        rollout starts until it is over."""
        async with self._changed:
            self._syncs_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._generating)
            except BaseException:
                self._syncs_waiting -= 1
                self._changed.notify_all()
                raise
            self._generating = True  # also keeps a second sync out
            self._syncs_waiting -= 1
        try:
            yield
        finally:
            async with self._changed:
                self._generating = False
                self._changed.notify_all()

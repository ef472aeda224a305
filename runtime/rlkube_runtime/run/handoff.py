"""Colocated placement: the trainer and the engines take turns with the device memory.

In slime's order: the engines give theirs up for the train phase; after it the trainer keeps only
its weights while the engines take their weights back and the sync copies into them, then the
trainer offloads the rest and the engines get their KV cache back (weights, sync, KV: the peak
stays one model plus the cache). On a CPU there is nothing to free, but the turns run the same
way, so the local run tests the order a GPU run needs. Separate placement: every step is a no-op.
"""

from __future__ import annotations

import time
from typing import Any


class Handoff:
    def __init__(self, trainers: Any, rollouts: Any, *, takes_turns: bool):
        self.trainers, self.rollouts, self.takes_turns = trainers, rollouts, takes_turns
        self._back = 0.0  # seconds of the hand-back before the sync, added to the one after it

    def start(self) -> None:
        """Trainers start offloaded: the engines generate first."""
        if self.takes_turns:
            self.trainers.release()

    def to_train(self) -> dict[str, float]:
        """The engines give their memory up, the trainer takes its own back."""
        if not self.takes_turns:
            return {}
        started = time.monotonic()
        self.rollouts.release()
        self.trainers.restore()
        return {"perf/handoff_to_train_time": time.monotonic() - started}

    def to_sync(self, *, syncing: bool) -> None:
        """After training: the trainer keeps only its weights (when a sync follows), the engines
        take their weights' memory back for the sync to copy into."""
        if not self.takes_turns:
            return
        started = time.monotonic()
        self.trainers.release(keep_weights=syncing)
        self.rollouts.restore(["weights"])
        self._back = time.monotonic() - started

    def to_rollout(self, *, synced: bool) -> dict[str, float]:
        """After the sync: the trainer offloads its weights too, the engines get their KV cache back."""
        if not self.takes_turns:
            return {}
        started = time.monotonic()
        if synced:
            self.trainers.release()
        self.rollouts.restore(["kv_cache", "cuda_graph"])
        return {"perf/handoff_to_rollout_time": self._back + time.monotonic() - started}

"""SIGTERM (preemption, suspend, a node drain): noted, not obeyed at once. The loop stops at the
next point where a checkpoint can cover everything trained, saves it and exits 143."""

from __future__ import annotations

import sys
import time

from rlkube_runtime.run import checkpoints


class Preempted(Exception):
    """The run stopped on SIGTERM after saving what it had done."""

    def __init__(self, message: str):
        super().__init__(message)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.since: float | None = None

    @classmethod
    def install(cls) -> StopRequest:
        import signal
        import threading

        request = cls()
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            signal.signal(signal.SIGTERM, request._note)
        return request

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _note(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal, self.since = signum, time.monotonic()
            print("SIGTERM: stopping at the next checkpoint-safe point (the current rollout's training, or now if "
                  "it is still generating), then saving", file=sys.stderr, flush=True)


def stop_after(job, rollout_id: int, stop: StopRequest, *, trained_since_start: bool) -> None:
    """Make sure a checkpoint covers every rollout up to `rollout_id`, then raise Preempted."""
    if not job.plan.trains:
        raise Preempted("stopped by SIGTERM; a rollout-only run keeps no checkpoints.")
    if trained_since_start and job.last_saved != rollout_id:
        checkpoints.save(job, rollout_id)
    waited = time.monotonic() - (stop.since or time.monotonic())
    job.report.preempted(job.last_saved)
    if job.last_saved is None:
        raise Preempted(f"stopped by SIGTERM after {waited:.1f} s, before any rollout was trained; nothing to save.")
    raise Preempted(
        f"stopped by SIGTERM after {waited:.1f} s; every trained rollout is in the checkpoint of rollout "
        f"{job.last_saved} in {job.plan.checkpoint_root}."
    )

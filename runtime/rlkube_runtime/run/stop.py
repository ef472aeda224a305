"""SIGTERM (preemption, suspend, a node drain): noted, not obeyed at once. The loop stops at the
next point where a checkpoint can cover everything trained, saves it and exits 143."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

from rlkube_runtime.run import checkpoints
from rlkube_runtime.spec.contract import ENV_DRIVER_PID_FILE


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
            pid_file = os.environ.get(ENV_DRIVER_PID_FILE)
            if pid_file:  # on the head pod: where its preStop hook finds this process
                write_pid_file(Path(pid_file))
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


def write_pid_file(path: Path) -> None:
    """This process's pid in `path` (written whole, then renamed), removed again at exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(path)
    atexit.register(_remove_own_pid_file, path, os.getpid())


def _remove_own_pid_file(path: Path, pid: int) -> None:
    try:
        if int(path.read_text()) == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def stop_driver(pid_file: Path, *, poll_s: float = 0.2) -> str:
    """SIGTERM the driver named in `pid_file` and wait until it has exited (the head pod's preStop
    hook; the kubelet ends the wait at the pod's grace period). What happened, in one line."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return f"no driver to stop: {pid_file} names none"
    if not _is_driver(pid):
        return f"no driver to stop: process {pid} of {pid_file} is no rlkube run"
    started = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"driver {pid} had already exited"
    while _is_driver(pid):
        time.sleep(poll_s)
    return f"driver {pid} exited {time.monotonic() - started:.1f} s after SIGTERM"


def _is_driver(pid: int) -> bool:
    """`pid` is a live (not zombie) `rlkube run` process: a stale pid file's number may have been
    given to another process since."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and any(b"rlkube" in part for part in cmdline) and b"run" in cmdline

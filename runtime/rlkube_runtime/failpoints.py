"""Fail points: a process kills itself at a named point, once, so the chaos tests can place a
crash exactly (mid-weight-sync takes a fraction of a second; a kill from outside lands there by
chance). Off unless RLKUBE_FAILPOINTS is set, and then a dictionary lookup per point passed.

RLKUBE_FAILPOINTS is a JSON object: point -> marker file. The first process to pass an armed
point creates the marker and SIGKILLs itself; with the marker present the point is disarmed for
every process, so a replacement started with the same environment passes it:

    RLKUBE_FAILPOINTS='{"engine.update_weights:5": "/tmp/run/failpoint-fired"}'

Points: `engine.update_weights:<weight version>` (the built-in engine, as a weight update of
that version arrives: after the pause and cache flush of the sync, before any tensor is loaded).
"""

from __future__ import annotations

import json
import os
import signal

ENV = "RLKUBE_FAILPOINTS"


def armed() -> dict[str, str]:
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    try:
        points = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"{ENV} must be a JSON object of point -> marker file, got {raw!r}: {err}") from None
    if not isinstance(points, dict):
        raise ValueError(f"{ENV} must be a JSON object of point -> marker file, got {raw!r}")
    return {str(k): str(v) for k, v in points.items()}


def reach(point: str) -> None:
    """SIGKILL this process if `point` is armed and has not fired yet in any process."""
    marker = armed().get(point)
    if marker is None:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{point} pid {os.getpid()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)

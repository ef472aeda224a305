"""Server processes of our own (engines, the router, the test control plane's components): each
in a session of its own, so its process group is its pid and a stop reaches its grandchildren
too; on Linux killed when the thread that started it dies, however it dies; stopped by group.

No `preexec_fn`: code between fork and exec is unsafe in a threaded parent (a lock held by
another thread stays held in the child). The death signal is asked for by a small guard instead,
a fresh interpreter that calls prctl(PR_SET_PDEATHSIG) and then execs the command in its place
(same pid; the setting survives exec). Linux sends the signal when the *thread* that started the
child exits, so start servers from a long-lived thread (the main thread, an actor's thread, an
executor's worker), not a throw-away one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

# The guard: argv = [parent pid, command...]. A parent that died before prctl took effect is
# caught by the getppid check.
_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def start(
    command: Sequence[str],
    *,
    stdout: IO[Any] | int | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """`command` in its own session, stdout and stderr to `stdout`, stdin from /dev/null.
    `env`: the whole environment (None: this process's)."""
    argv = list(command)
    if sys.platform.startswith("linux"):
        if shutil.which(argv[0], path=(env or os.environ).get("PATH")) is None:
            raise FileNotFoundError(f"no such program: {argv[0]!r}")  # as Popen says it without the guard
        argv = [sys.executable, "-I", "-c", _GUARD, str(os.getpid()), *argv]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
    )


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """`sig` to the process's whole group (a no-op once it is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def kill_group(popen: subprocess.Popen, wait_s: float = 5.0) -> None:
    """SIGKILL the group and reap the process."""
    signal_group(popen, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(wait_s)


def stop_group(popen: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after `timeout_s`."""
    if popen.poll() is None:
        signal_group(popen, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout_s)
    kill_group(popen)

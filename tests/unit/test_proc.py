"""rlkube_runtime/proc.py: a server process in a session of its own, stopped by its group, and
refused at once when the program does not exist (as Popen refuses it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlkube_runtime import proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_started_process_leads_its_own_group_and_a_stop_reaches_its_children(tmp_path):
    # The child starts a grandchild in its group and prints its pid.
    script = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)"
    log = open(tmp_path / "out.log", "wb")
    child = proc.start([sys.executable, "-c", script], stdout=log)
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        deadline = time.monotonic() + 30
        while not (tmp_path / "out.log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int((tmp_path / "out.log").read_text().split()[0])
        assert _alive(grandchild)
    finally:
        proc.stop_group(child, timeout_s=5)
        log.close()
    assert child.poll() is not None
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_missing_program_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-program-rlkube"):
        proc.start(["no-such-program-rlkube"], stdout=subprocess.DEVNULL)


def test_signal_group_after_the_process_is_gone_does_nothing():
    child = proc.start(["true"], stdout=subprocess.DEVNULL)
    child.wait(10)
    proc.signal_group(child, signal.SIGTERM)
    proc.kill_group(child)

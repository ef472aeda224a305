"""The head pod's preStop hook (`rlkube stop-driver`): SIGTERM reaches the driver through the pid
file it wrote, and the hook returns only once the driver has finished saving and exited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlkube_runtime.cli import main as rlkube
from rlkube_runtime.run.stop import stop_driver

# A stand-in driver: a process whose command line names `rlkube` and `run`, as the real one's does, that
# installs the run's StopRequest, then, once SIGTERM is noted, takes a second to "save" and exits 143.
DRIVER = r"""
import sys, time
from rlkube_runtime.run.stop import StopRequest
stop = StopRequest.install()
print("ready", flush=True)
while not stop.requested:
    time.sleep(0.05)
time.sleep(1.0)
open("saved", "w").write("saved")
sys.exit(143)
"""


def _start_driver(tmp_path: Path, pid_file: Path) -> subprocess.Popen:
    env = {**os.environ, "RLKUBE_DRIVER_PID_FILE": str(pid_file)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, "rlkube", "run"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert driver.stdout.readline().strip() == "ready"
    return driver


def test_the_hook_waits_until_the_driver_has_saved_and_exited(tmp_path, capsys):
    pid_file = tmp_path / "driver.pid"
    driver = _start_driver(tmp_path, pid_file)
    assert int(pid_file.read_text()) == driver.pid
    started = time.monotonic()
    assert rlkube(["stop-driver", "--pid-file", str(pid_file)]) == 0
    waited = time.monotonic() - started
    assert driver.wait(5) == 143
    assert waited >= 1.0 and (tmp_path / "saved").read_text() == "saved"
    assert f"driver {driver.pid} exited" in capsys.readouterr().out
    assert not pid_file.exists()  # the driver removed its own pid file on the way out


def test_no_driver_or_a_stale_pid_is_left_alone(tmp_path):
    assert stop_driver(tmp_path / "none.pid").startswith("no driver to stop")
    # A pid file whose number now belongs to another process (here: this test's own) is not obeyed.
    stale = tmp_path / "stale.pid"
    stale.write_text(f"{os.getpid()}\n")
    assert "is no rlkube run" in stop_driver(stale)

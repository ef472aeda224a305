"""Running the embedded default (`manifests/examples/local-tiny.yaml`) as a user would: `rlkube run`
in a subprocess, on a copy of the example with a few fields changed.

A run's output goes to a file, never to a pipe nobody reads while the test waits (a full pipe
would stop the run at its next print). A run that does not finish in time fails the test with its
output, the tails of its engine and router logs and, where py-spy is installed, the stacks of
every process it started: enough to see where it stood.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCAL_TINY = REPO / "manifests" / "examples" / "local-tiny.yaml"


def write_local_tiny(tmp_path: Path, name: str, **overrides) -> Path:
    """A copy of local-tiny.yaml named `name`, with dotted keys set (`spec.training.numRollout=8`)."""
    doc = yaml.safe_load(LOCAL_TINY.read_text())
    doc["metadata"]["name"] = name
    for dotted, value in overrides.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def rlkube_run_command(job: Path, out: Path, args: Sequence[str] = (), prefix: Sequence[str] = ()) -> list[str]:
    """`prefix` runs it through another command (`ip netns exec NS`: in a network namespace)."""
    return [*prefix, sys.executable, "-m", "rlkube_runtime.cli", "run", str(job), "--output-dir", str(out), *args]


class LocalRun:
    """`rlkube run` in its own process group (so a test can kill all of it), output in `log_path`."""

    def __init__(self, job: Path, out: Path, env: dict[str, str] | None = None, args: Sequence[str] = (),
                 prefix: Sequence[str] = ()):
        self.out = out
        attempt = 1  # a resumed run writes into the same output directory: one log per start
        while (out.parent / f"{out.name}.run{attempt}.log").exists():
            attempt += 1
        self.log_path = out.parent / f"{out.name}.run{attempt}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                rlkube_run_command(job, out, args, prefix),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Until `condition()` holds while the run goes on; fails if the run ends or stalls first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if not self.running():
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before {what}:\n{self.output[-3000:]}")
            if time.monotonic() > deadline:
                self._fail_stalled(f"{what} did not happen within {timeout_s:.0f} s")
            time.sleep(0.2)

    def wait(self, timeout_s: float) -> int:
        """The run's exit code; a run still going after `timeout_s` fails the test with diagnostics."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._fail_stalled(f"the run did not finish within {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL the whole run, as a node loss would."""
        if self.running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _fail_stalled(self, why: str) -> None:
        report = diagnose(self.proc.pid, self.out)
        self.kill()
        raise AssertionError(f"{why}\n--- run output ---\n{self.output[-4000:]}\n{report}")


def start_run(job: Path, out: Path, env: dict[str, str] | None = None, args: Sequence[str] = (),
              prefix: Sequence[str] = ()) -> LocalRun:
    """`rlkube run job --output-dir out *args` (after `prefix`)."""
    return LocalRun(job, out, env, args, prefix)


def stop_run_after(job: Path, out: Path, rollouts: int) -> LocalRun:
    """Start the run, SIGTERM it once `rollouts` are logged, and check it exits 143 (stopped, saved)."""
    run = start_run(job, out)
    try:
        run.wait_until(lambda: len(read_jsonl(out / "metrics.jsonl")) >= rollouts, f"{rollouts} rollouts logged",
                       timeout_s=240)
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait(timeout_s=120) == 143, run.output[-4000:]
    finally:
        run.kill()
    return run


def kill_until_gone(find_pids: Callable[[], list[int]], timeout_s: float = 15) -> None:
    """SIGKILL every process `find_pids()` names, as `ray stop --force` does but only to those; again
    until it names none, in case one was being started as the others died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = find_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


# The run's own processes: the driver, its actors and the engines (not Ray's agents and daemons).
_RUN_PROCESS_MARKERS = ("rlkube_runtime", "ray::RolloutManager", "ray::TrainerWorker", "ray::EngineActor")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def diagnose(session: int, out: Path) -> str:
    """Tails of the run's engine and router logs and py-spy stacks of the run's own processes."""
    parts = []
    for log in sorted((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []:
        tail = _ANSI.sub("", log.read_text(errors="replace")).splitlines()[-15:]
        parts.append(f"--- {log.name} (last lines) ---\n" + "\n".join(line[:300] for line in tail))
    # Ray's workers share the run's session; the engines have sessions of their own but name the
    # run's output directory on their command lines.
    table = subprocess.run(["ps", "-e", "-o", "pid=,sid="], check=False, capture_output=True, text=True).stdout
    ours = [
        pid
        for pid, sid in (line.split() for line in table.splitlines())
        if (sid == str(session) and any(marker in _cmdline(pid) for marker in _RUN_PROCESS_MARKERS))
        or ("rlkube_runtime.engine" in _cmdline(pid) and str(out) in _cmdline(pid))
    ]
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        parts.append(f"(py-spy not installed: no stacks of processes {ours})")
    for pid in ours if py_spy else []:
        dump = subprocess.run([py_spy, "dump", "--pid", pid], check=False, capture_output=True, text=True, timeout=60)
        parts.append(f"--- py-spy dump {pid} ({_cmdline(pid)[:120]}) ---\n{dump.stdout[-4000:]}{dump.stderr[-500:]}")
    return "\n".join(parts)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

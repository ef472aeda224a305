"""A rollout engine killed mid-run is replaced; the run finishes with nothing lost or doubled."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from local_runs import LocalRun, read_jsonl, start_run, write_local_tiny

pytestmark = [pytest.mark.slow]


def _engine_pids(marker: str) -> list[int]:
    """Built-in engine processes whose command line mentions `marker` (this run's model dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        if "rlkube_runtime.engine" in args and any(marker in a for a in args):
            pids.append(int(entry.name))
    return pids


def _kill_the_engine_mid_run(tmp_path: Path, name: str, max_restarts: int, **overrides) -> tuple[int, LocalRun]:
    """Run local-tiny for 12 rollouts, SIGKILL its engine after the third; the run's exit code."""
    job = write_local_tiny(
        tmp_path,
        name,
        **{
            "spec.training.numRollout": 12,
            "spec.faultTolerance": {
                "healthCheck": {"intervalSeconds": 1, "timeoutSeconds": 10, "firstWaitSeconds": 1},
                "maxEngineRestarts": max_restarts,
            },
        },
        **overrides,
    )
    run = start_run(job, tmp_path / "out")
    try:
        run.wait_until(lambda: len(read_jsonl(run.out / "metrics.jsonl")) >= 3, "three rollouts", timeout_s=300)
        victims = _engine_pids(str(run.out))
        assert len(victims) == 1, f"expected the run's one engine, found {victims}"
        os.kill(victims[0], signal.SIGKILL)
        return run.wait(timeout_s=480), run
    finally:
        run.kill()


def test_a_killed_engine_is_replaced_and_every_rollout_trains_on_fresh_distinct_samples(tmp_path):
    returncode, run = _kill_the_engine_mid_run(tmp_path, "engine-crash", max_restarts=2)
    assert returncode == 0, run.output[-5000:]

    out = run.out
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout"] for m in metrics] == list(range(12))
    assert sum(m.get("rollout/engine_restarts", 0) for m in metrics) >= 1
    replacement = _engine_pids(str(out))
    assert replacement == [], f"engine processes outlived the run: {replacement}"

    trained = read_jsonl(out / "samples.jsonl")
    assert [r["rollout"] for r in trained] == list(range(12))
    indices = [i for r in trained for i in r["sample_indices"]]
    assert all(len(r["sample_indices"]) == 16 * 8 for r in trained)
    assert len(indices) == len(set(indices)), "a sample was trained on twice"


def test_an_engine_that_cannot_be_replaced_stops_the_run_with_the_field_named_and_checkpoints_kept(tmp_path):
    returncode, run = _kill_the_engine_mid_run(tmp_path, "no-restarts", max_restarts=0, **{"spec.checkpoint.interval": 2})
    output = run.output
    assert returncode == 1, output[-5000:]
    assert "spec.faultTolerance.maxEngineRestarts = 0" in output, output[-3000:]
    assert "Traceback" not in output, output[-5000:]  # the traceback is in the file the message names
    assert "Traceback" in (run.out / "logs" / "failure.txt").read_text()
    # Every checkpoint due before the failure was written (one every 2 rollouts), none after it.
    last_logged = read_jsonl(run.out / "metrics.jsonl")[-1]["rollout"]
    due = last_logged if (last_logged + 1) % 2 == 0 else last_logged - 1
    assert int((run.out / "checkpoints" / "latest").read_text()) == due

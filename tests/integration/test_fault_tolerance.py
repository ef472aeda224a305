"""A rollout engine killed mid-run is replaced; the run finishes with nothing lost or doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LOCAL_TINY = REPO / "manifests" / "examples" / "local-tiny.yaml"

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


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_engine_is_replaced_and_every_rollout_trains_on_fresh_distinct_samples(tmp_path):
    doc = yaml.safe_load(LOCAL_TINY.read_text())
    doc["metadata"]["name"] = "engine-crash"
    doc["spec"]["training"]["numRollout"] = 12
    doc["spec"]["faultTolerance"] = {
        "healthCheck": {"intervalSeconds": 1, "timeoutSeconds": 10, "firstWaitSeconds": 1},
        "maxEngineRestarts": 2,
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"

    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkube_runtime.cli", "run", str(job), "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 600
        while len(_lines(out / "metrics.jsonl")) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = _engine_pids(str(out))
        assert len(victims) == 1, f"expected the run's one engine, found {victims}"
        os.kill(victims[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-5000:]

    metrics = _lines(out / "metrics.jsonl")
    assert [m["rollout"] for m in metrics] == list(range(12))
    assert sum(m.get("rollout/engine_restarts", 0) for m in metrics) >= 1
    replacement = _engine_pids(str(out))
    assert replacement == [], f"engine processes outlived the run: {replacement}"

    trained = _lines(out / "samples.jsonl")
    assert [r["rollout"] for r in trained] == list(range(12))
    indices = [i for r in trained for i in r["sample_indices"]]
    assert all(len(r["sample_indices"]) == 16 * 8 for r in trained)
    assert len(indices) == len(set(indices)), "a sample was trained on twice"

"""The runtime across Ray nodes laid out as the operator's RayJob lays out its pods, on one machine.

A head without rlkube resources (the RayJob's head pod, where the entrypoint runs) and four
worker nodes, each with its own address on the loopback network and its pod group's Ray
resources: two trainer pods (`rlkube_trainer`) and two rollout pods (`rlkube_rollout`,
`rlkube_router`). No node is 127.0.0.1: the engines and the router serve on their node's address
only and are registered under it (checked from their command lines), and the trainer ranks meet at
rank 0's node. All nodes share one kernel here, so a dial to a wildcard-bound port would still
connect; real isolation needs network namespaces (../shared/FACTS.md), which this test does not use.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from local_runs import read_jsonl, start_run, write_local_tiny

from rlkube_runtime.serving.launch import free_port

pytestmark = [pytest.mark.slow]

HEAD = "127.0.0.2"
WORKERS = {  # address: the Ray resources the operator gives that pod group
    "127.0.0.3": {"rlkube_trainer": 1},
    "127.0.0.4": {"rlkube_trainer": 1},
    "127.0.0.5": {"rlkube_rollout": 1, "rlkube_router": 1},
    "127.0.0.6": {"rlkube_rollout": 1, "rlkube_router": 1},
}
ROLLOUTS = 40
# A private test cluster: no token to hand around between the nodes and the driver.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _ray(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    return subprocess.run([ray, *args], check=False, capture_output=True, text=True, env=env, timeout=180)


@pytest.fixture
def cluster(tmp_path):
    """Head plus the four worker nodes; stopped (all of Ray on this machine) afterwards."""
    env = {**os.environ, **RAY_ENV}
    port = free_port(HEAD)
    try:
        head = _ray("start", "--head", f"--node-ip-address={HEAD}", f"--port={port}", "--num-cpus=1",
                    "--include-dashboard=false", "--disable-usage-stats", env=env)
        assert head.returncode == 0, head.stdout + head.stderr
        for address, resources in WORKERS.items():
            worker = _ray("start", f"--address={HEAD}:{port}", f"--node-ip-address={address}", "--num-cpus=1",
                          f"--resources={json.dumps(resources)}", "--disable-usage-stats", env=env)
            assert worker.returncode == 0, worker.stdout + worker.stderr
        yield f"{HEAD}:{port}"
    finally:
        _ray("stop", "--force", env=env)


def test_trainer_pods_and_rollout_pods_reach_each_other_by_address_and_learn(tmp_path, cluster):
    job = write_local_tiny(
        tmp_path, "pods",
        **{
            "spec.training.numRollout": ROLLOUTS,
            "spec.resources.placement": "separate",
            "spec.resources.trainer": {"nodes": 2, "gpusPerNode": 1},
            "spec.resources.rollout": {"gpus": 2},
        },
    )
    out = tmp_path / "out"
    run = start_run(job, out, env={"RAY_ADDRESS": cluster, **RAY_ENV})
    try:
        returncode = run.wait(timeout_s=720)
    finally:
        run.kill()
    assert returncode == 0, run.output[-5000:]

    rewards = [m["rollout/raw_reward"] for m in read_jsonl(out / "metrics.jsonl") if m["rollout"] >= 0]
    assert len(rewards) == ROLLOUTS
    assert sum(rewards[:3]) / 3 < 0.3 and sum(rewards[-5:]) / 5 > 0.7, rewards

    # Each engine served on its rollout node's address, one per node; the router on a rollout node.
    logs = out / "logs"
    engine_hosts = sorted(_flag(log, "--host") for log in logs.glob("engine-*.log"))
    assert engine_hosts == ["127.0.0.5", "127.0.0.6"], engine_hosts
    assert _flag(logs / "router.log", "--host") in ("127.0.0.5", "127.0.0.6")
    assert "127.0.0.1" not in "".join(_first_line(log) for log in logs.glob("*.log"))


def _first_line(log: Path) -> str:
    return log.read_text(errors="replace").splitlines()[0]


def _flag(log: Path, flag: str) -> str:
    """The value of `flag` on the command line a process log starts with (`$ command ...`)."""
    match = re.search(rf"{re.escape(flag)} (\S+)", _first_line(log))
    assert match, f"{log.name}: no {flag} in {_first_line(log)!r}"
    return match.group(1)

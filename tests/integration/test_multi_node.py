"""The runtime across Ray nodes laid out as the operator's RayJob lays out its pods, each node in a
network namespace of its own: its own IP and its own loopback, a bridge between them, as pods on a
cluster network have (../shared/FACTS.md).

A head with the router's resource (the RayJob's head pod, where the entrypoint runs: the driver
runs in its namespace, the rollout manager and its router beside it) and four worker nodes with
their pod group's Ray resources: two trainer pods (`rlkube_trainer`) and two rollout pods
(`rlkube_rollout`). Any connection to
127.0.0.1, or to whatever the host name resolves to (127.0.0.1 on this machine), reaches the
dialler's own namespace and fails: the trainer ranks' gloo group, the weight-update groups from
trainer to engines, the engines and the router all have to use the nodes' addresses. Needs root
and iproute2 (`ip netns`), as CI has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from local_runs import kill_until_gone, read_jsonl, start_run, write_local_tiny

pytestmark = [pytest.mark.slow]

# A subnet and link names of this test process's own, so two test runs on one machine do not meet.
TAG = os.getpid() % 250
SUBNET = f"10.77.{TAG}"
BRIDGE = f"rlk{TAG}br"
NODES = {  # namespace: (address, the Ray resources the operator gives that pod group)
    f"rlk{TAG}-head": (f"{SUBNET}.2", {"rlkube_router": 1}),
    f"rlk{TAG}-trainer0": (f"{SUBNET}.3", {"rlkube_trainer": 1}),
    f"rlk{TAG}-trainer1": (f"{SUBNET}.4", {"rlkube_trainer": 1}),
    f"rlk{TAG}-rollout0": (f"{SUBNET}.5", {"rlkube_rollout": 1}),
    f"rlk{TAG}-rollout1": (f"{SUBNET}.6", {"rlkube_rollout": 1}),
}
HEAD_NS = f"rlk{TAG}-head"
HEAD = f"{NODES[HEAD_NS][0]}:6379"  # a namespace of its own: the default port is free
# Enough for the reward to climb from chance (about 0.07 over the first three) past 0.5. Which
# engine serves which request is up to the router, so the climb varies: with 24 rollouts the last
# three averaged 0.67 to 0.80 in four runs and 0.47 in a fifth (a cold make test); with 32 they
# averaged 0.94 (rollout 24 at 0.80). A rollout takes under a second; starting the five nodes and
# the run's actors takes most of the test's 50 s to 2.5 minutes.
ROLLOUTS = 32
PROMPTS_PER_ROLLOUT = 16  # local-tiny's rollout.batchSize
# A private test cluster: no token to hand around between the nodes and the driver.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


def _build_network() -> None:
    """The bridge and, per node, a namespace joined to it by a veth pair, its address on its end."""
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    for i, (ns, (address, _)) in enumerate(NODES.items()):
        outside, inside = f"rlk{TAG}v{i}", f"rlk{TAG}p{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", BRIDGE)
        _ip("link", "set", outside, "up")
        _ip("addr", "add", f"{address}/24", "dev", inside, ns=ns)
        _ip("link", "set", inside, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)


def _tear_down_network() -> None:
    """Every process in the namespaces (Ray's and the run's, by id), then namespaces and links."""
    existing = _ip("netns", "list", check=False).stdout
    namespaces = [ns for ns in NODES if ns in existing]
    kill_until_gone(lambda: [int(p) for ns in namespaces for p in _ip("netns", "pids", ns, check=False).stdout.split()])
    for i, ns in enumerate(NODES):
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"rlk{TAG}v{i}", check=False)
    _ip("link", "del", BRIDGE, check=False)


def _ray_start(ns: str, *args: str, temp_dir: str) -> subprocess.Popen:
    """`ray start` of the node in namespace `ns`, with its address and resources."""
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    address, resources = NODES[ns]
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, ray, "start", f"--node-ip-address={address}", "--num-cpus=1",
         f"--resources={json.dumps(resources)}", f"--temp-dir={temp_dir}", "--disable-usage-stats", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **RAY_ENV},
    )


def _started(proc: subprocess.Popen, ns: str) -> None:
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"ray start in {ns} failed:\n{output}"


@pytest.fixture
def cluster():
    """Head plus the four worker nodes, each in its namespace; all of it removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("this test puts each Ray node in a network namespace: it needs root and iproute2 (`ip netns`)",
                    pytrace=False)
    # Ray's sockets live under its temp dir: a short path of our own keeps them under the length
    # limit of a unix socket and apart from any other Ray on the machine.
    temp_dir = tempfile.mkdtemp(prefix="rlk-ray-", dir="/tmp")
    try:
        _build_network()
        _started(_ray_start(HEAD_NS, "--head", "--port=6379", "--include-dashboard=false", temp_dir=temp_dir), HEAD_NS)
        # One at a time: Ray gives a starting node 30 s to register, which four at once on two
        # cores can overrun.
        for ns in NODES:
            if ns != HEAD_NS:
                _started(_ray_start(ns, f"--address={HEAD}", temp_dir=temp_dir), ns)
        yield HEAD
    finally:
        _tear_down_network()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_trainer_pods_and_rollout_pods_meet_at_their_node_addresses_and_learn(tmp_path, cluster):
    job = write_local_tiny(
        tmp_path, "pods",
        **{
            "spec.training.numRollout": ROLLOUTS,
            "spec.checkpoint.interval": ROLLOUTS,
            "spec.resources.placement": "separate",
            "spec.resources.trainer": {"nodes": 2, "gpusPerNode": 1},
            "spec.resources.rollout": {"gpus": 2},
        },
    )
    out = tmp_path / "out"
    # The driver runs on the head pod, as a RayJob's entrypoint does.
    run = start_run(job, out, env={"RAY_ADDRESS": cluster, **RAY_ENV}, prefix=["ip", "netns", "exec", HEAD_NS])
    try:
        returncode = run.wait(timeout_s=300)
    finally:
        run.kill()
    assert returncode == 0, run.output[-5000:]
    assert "Traceback" not in run.output, run.output[-5000:]

    rewards = [m["rollout/raw_reward"] for m in read_jsonl(out / "metrics.jsonl") if m["rollout"] >= 0]
    assert len(rewards) == ROLLOUTS
    assert sum(rewards[:3]) / 3 < 0.3 and sum(rewards[-3:]) / 3 > 0.5, rewards

    # Every prompt group trained exactly once: none skipped, none twice, in order.
    trained = read_jsonl(out / "samples.jsonl")
    assert [r["rollout"] for r in trained] == list(range(ROLLOUTS))
    groups = [g for r in trained for g in r["group_indices"]]
    assert groups == list(range(ROLLOUTS * PROMPTS_PER_ROLLOUT)), groups

    # Each engine served on its rollout node's address, one per node; the router on the head's.
    rollout_nodes = sorted(address for address, resources in NODES.values() if "rlkube_rollout" in resources)
    logs = out / "logs"
    engine_hosts = sorted(_flag(log, "--host") for log in logs.glob("engine-*.log"))
    assert engine_hosts == rollout_nodes, engine_hosts
    assert _flag(logs / "router.log", "--host") == NODES[HEAD_NS][0]


def _flag(log: Path, flag: str) -> str:
    """The value of `flag` on the command line a process log starts with (`$ command ...`)."""
    first = log.read_text(errors="replace").splitlines()[0]
    match = re.search(rf"{re.escape(flag)} (\S+)", first)
    assert match, f"{log.name}: no {flag} in {first!r}"
    return match.group(1)

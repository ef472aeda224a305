"""The local loop with spec.training.backend: megatron on CPU: each trainer rank writes its own
distributed-checkpoint shards into the atomic checkpoint directory, and a killed run resumes
from them with nothing trained twice; a mixture of experts split over two expert-parallel ranks
learns with every expert synced."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from harness import _free_ports
from local_runs import kill_until_gone, read_jsonl, start_run, write_local_tiny

pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
pytestmark = [pytest.mark.slow]


def test_a_killed_megatron_run_resumes_from_its_distributed_checkpoint(tmp_path):
    settings = {"spec.training.backend": "megatron", "spec.training.numRollout": 6, "spec.checkpoint.interval": 2}
    job = write_local_tiny(tmp_path, "megatron", **settings)
    out = tmp_path / "out"
    run = start_run(job, out)
    latest = out / "checkpoints" / "latest"

    def rollout_3_saved_and_logged() -> bool:
        # A rollout's metrics line follows its checkpoint: waiting for both keeps a kill in that
        # short window from leaving rollout 3's loss unlogged (its training is checkpointed either way).
        saved = latest.exists() and latest.read_text().strip() not in ("", "1")
        return saved and any(m["rollout"] == 3 for m in read_jsonl(out / "metrics.jsonl"))

    run.wait_until(rollout_3_saved_and_logged, "the checkpoint and metrics of rollout 3", timeout_s=600)
    run.kill()

    saved = out / "checkpoints" / "rollout_00000003"
    assert (saved / "complete").is_file() and (saved / "trainer" / "metadata.json").is_file()
    assert (saved / "trainer" / "rng" / "rank_0.pt").is_file()
    assert not (saved / "trainer.pt").exists() and not (saved / "trainer_state.pt").exists()  # per-rank shards only

    resumed = start_run(job, out)
    try:
        returncode = resumed.wait(timeout_s=600)
    finally:
        resumed.kill()
    assert returncode == 0, resumed.output[-5000:]
    assert "resuming from checkpoint" in resumed.output and "Traceback" not in resumed.output

    trained: dict[int, list[int]] = {}
    for record in read_jsonl(out / "samples.jsonl"):
        trained[record["rollout"]] = record["sample_indices"]
    assert sorted(trained) == list(range(6))
    flat = [i for r in sorted(trained) for i in trained[r]]
    assert len(flat) == len(set(flat)), "a sample index was trained on twice"
    losses = [m["train/loss"] for m in read_jsonl(out / "metrics.jsonl") if "train/loss" in m]
    assert len(losses) >= 6 and all(abs(x) < 1e3 for x in losses)


# A private test cluster: no token to hand around between the head and the driver.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture
def pod_layout_ray():
    """A one-node Ray with the Ray resources the operator gives its pod groups (two trainer pods,
    a rollout pod, the head's router), so the run lays out its actors as on a cluster of CPU pods:
    one trainer rank per trainer pod. Its processes are one session, killed whole afterwards."""
    port, agent_port = _free_ports(2)
    temp_dir = tempfile.mkdtemp(prefix="rlk-ep-", dir="/tmp")  # short: Ray's unix sockets live under it
    resources = {"rlkube_trainer": 2, "rlkube_rollout": 1, "rlkube_router": 1}
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
         f"--dashboard-agent-listen-port={agent_port}", f"--resources={json.dumps(resources)}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **RAY_ENV},
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        kill_until_gone(lambda: _session_pids(head.pid))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _session_pids(session: int) -> list[int]:
    """Every live process of `session` (Ray's daemons and workers)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[3]) == session:  # after the name: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


EP_ROLLOUTS = 30


def test_a_mixture_of_experts_split_over_two_expert_parallel_ranks_learns_with_every_expert_synced(
        tmp_path, pod_layout_ray):
    """A tiny Qwen3-MoE (8 experts, 2 routed per token) on two trainer ranks at parallelism.expert 2:
    each rank trains 4 of the experts (its checkpoint shards hold only those), the weight sync
    gathers all 8 to the engine, whose log-probs of what it generated stay the trainer's to float
    rounding at a learning rate that moves every expert each step (an expert left behind: 0.1 and
    more), and the reward climbs from chance (1 in 19), a load-balancing loss and routing replay on:
    the engine reports every token's experts and the trainer's routers take them (a sample without
    them, or with routes of the wrong length, stops the run)."""
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "moe", hidden_size=32, experts=8)
    job = write_local_tiny(tmp_path, "moe-ep2", **{
        # With the load-balancing loss megatron-core's recipes use, through every rule that admits it.
        "spec.model": {"hfCheckpoint": str(model), "dtype": "float32", "megatronArgs": {"moe-aux-loss-coeff": 1e-3}},
        "spec.training.numRollout": EP_ROLLOUTS, "spec.training.backend": "megatron",
        "spec.training.routingReplay": True,
        "spec.training.optimizer.lr": 5e-2,
        "spec.checkpoint.interval": EP_ROLLOUTS,
        "spec.parallelism": {"expert": 2},
        "spec.resources.placement": "separate",
        "spec.resources.trainer": {"nodes": 2, "gpusPerNode": 1},
        "spec.resources.rollout": {"gpus": 1},
    })
    out = tmp_path / "out"
    run = start_run(job, out, env={"RAY_ADDRESS": pod_layout_ray, **RAY_ENV})
    try:
        returncode = run.wait(timeout_s=420)
    finally:
        run.kill()
    assert returncode == 0, run.output[-5000:]
    assert "Traceback" not in run.output, run.output[-5000:]

    records = [m for m in read_jsonl(out / "metrics.jsonl") if m["rollout"] >= 0]
    assert len(records) == EP_ROLLOUTS
    gaps = [m["train/train_rollout_logprob_abs_diff"] for m in records]
    assert max(gaps) < 1e-4, gaps
    rewards = [m["rollout/raw_reward"] for m in records]
    assert sum(rewards[:3]) / 3 < 0.08 and sum(rewards[-5:]) / 5 > 0.12, rewards
    # The load-balancing loss is reported every step, near 1 (balanced) and at most the expert count.
    balance = [m["train/moe_load_balancing_loss"] for m in records]
    assert all(0.9 < b < 8 for b in balance), balance
    # fp32 on both sides: the trainer's routers would pick the engine's experts all but everywhere.
    mismatch = [m["train/routing_replay_mismatch"] for m in records]
    assert all(0 <= x < 0.01 for x in mismatch), mismatch
    engine_lines = [line for log in (out / "logs").glob("engine-*.log") for line in log.read_text().splitlines()
                    if line.startswith("$ ")]
    assert engine_lines and all("--enable-return-routed-experts" in line for line in engine_lines), engine_lines

    # Rank r's checkpoint file holds the experts r x 4 to r x 4 + 3 (megatron's global expert index).
    from torch.distributed.checkpoint import FileSystemReader

    saved = out / "checkpoints" / f"rollout_{EP_ROLLOUTS - 1:08d}" / "trainer"
    metadata = FileSystemReader(str(saved)).read_metadata()
    experts_by_rank: dict[str, set[int]] = defaultdict(set)
    for index, stored in metadata.storage_data.items():
        if index.fqn == "decoder.layers.mlp.experts.experts.linear_fc2.weight":
            experts_by_rank[stored.relative_path.split("_")[2]].add(int(index.offset[1]))  # __<rank>_<n>.distcp
    assert dict(experts_by_rank) == {"0": {0, 1, 2, 3}, "1": {4, 5, 6, 7}}

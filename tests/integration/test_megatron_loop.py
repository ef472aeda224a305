"""The local loop with spec.training.backend: megatron on CPU: each trainer rank writes its own
distributed-checkpoint shards into the atomic checkpoint directory, and a killed run resumes
from them with nothing trained twice."""

from __future__ import annotations

import pytest
from local_runs import read_jsonl, start_run, write_local_tiny

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

"""The whole local loop on CPU: Ray, the built-in engine behind the real sglang-router, the torch trainer.

These are real training runs of the embedded default (`manifests/examples/local-tiny.yaml`),
shortened where the property allows it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from local_runs import read_jsonl, start_run, write_local_tiny

pytestmark = [pytest.mark.slow]


def _run(job: Path, out: Path, timeout_s: float = 420) -> tuple[int, str]:
    """`rlkube run` to the end: its exit code and its output (stdout and stderr together)."""
    run = start_run(job, out)
    try:
        return run.wait(timeout_s=timeout_s), run.output
    finally:
        run.kill()


def _metrics(out: Path) -> list[dict]:
    return read_jsonl(out / "metrics.jsonl")


def _trained_prompts(out: Path) -> dict[int, list[int]]:
    """rollout id -> sample indices trained on; a rollout redone after a resume overwrites its entry."""
    by_rollout: dict[int, list[int]] = {}
    for record in read_jsonl(out / "samples.jsonl"):
        by_rollout[record["rollout"]] = record["sample_indices"]
    return by_rollout


def test_grpo_lifts_reward_from_chance_to_above_0_8(tmp_path):
    job = write_local_tiny(
        tmp_path,
        "learn",
        **{"spec.eval": {"interval": 30, "datasets": [{"name": "successor", "path": "builtin:digit-successor", "nSamples": 4}]}},
    )
    out = tmp_path / "out"
    returncode, output = _run(job, out)
    assert returncode == 0, output[-5000:]
    assert "Traceback" not in output

    records = _metrics(out)
    rewards = [m["rollout/raw_reward"] for m in records if m["rollout"] >= 0]
    assert len(rewards) == yaml.safe_load(job.read_text())["spec"]["training"]["numRollout"]
    # Evaluation before the first rollout and every 30: the held-out score climbs too.
    evals = {m["rollout"]: m["eval/successor/reward"] for m in records if "eval/successor/reward" in m}
    assert sorted(evals) == [-1, 29, 59]
    assert evals[-1] < 0.3 and evals[59] > 0.8, evals
    # One-token answers over a ~19-token vocabulary: a random model is right about 5% of the time.
    assert sum(rewards[:3]) / 3 < 0.3, rewards[:10]
    assert sum(rewards[-5:]) / 5 > 0.8, rewards[-10:]
    # The progress line the user watches.
    assert f"rollout {len(rewards)}/{len(rewards)}" in output


def test_kill_and_resume_trains_on_the_same_prompts_as_an_uninterrupted_run(tmp_path):
    settings = {"spec.training.numRollout": 8, "spec.checkpoint.interval": 2}
    straight_out = tmp_path / "straight"
    # The uninterrupted run uses the separate placement: the data order must not depend on it.
    separate = {"spec.resources.placement": "separate"}
    returncode, output = _run(write_local_tiny(tmp_path, "straight", **settings, **separate), straight_out)
    assert returncode == 0, output[-5000:]

    job = write_local_tiny(tmp_path, "resumed", **settings)
    out = tmp_path / "resumed"
    run = start_run(job, out)
    latest = out / "checkpoints" / "latest"
    run.wait_until(
        lambda: latest.exists() and latest.read_text().strip() and int(latest.read_text().strip()) >= 3,
        "the checkpoint of rollout 3",
        timeout_s=600,
    )
    run.kill()  # the trainer dies mid-run, as a node loss would kill it

    returncode, output = _run(job, out)
    assert returncode == 0, output[-5000:]
    assert "resuming from checkpoint" in output

    expected = _trained_prompts(straight_out)
    got = _trained_prompts(out)
    assert got == expected
    flat = [i for r in sorted(got) for i in got[r]]
    assert len(flat) == len(set(flat)), "a sample index was trained on twice"


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"spec.training.globalBatchSize": 100}, "spec.training.globalBatchSize"),
        ({"spec.data.promptData": "/nonexistent/prompts.jsonl"}, "/nonexistent/prompts.jsonl"),
    ],
)
def test_spec_errors_stop_the_run_at_start_naming_the_field(tmp_path, overrides, field):
    job = write_local_tiny(tmp_path, "broken", **overrides)
    started = time.monotonic()
    returncode, output = _run(job, tmp_path / "out", timeout_s=120)
    assert returncode != 0
    assert field in output
    assert "Traceback" not in output
    assert time.monotonic() - started < 60

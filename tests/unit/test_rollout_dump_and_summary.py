"""The rollout dump's file format and sampling, and the end-of-run summary block, on hand-made data."""

from __future__ import annotations

import json

import pytest

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.rollout_dump import (
    RolloutDumpError,
    dumped_rollout_ids,
    load_rollout_dump,
    samples_to_dump,
    write_rollout_dump,
)
from rlkube_runtime.run_summary import RunSummary


def _samples(groups: int, per_group: int) -> list[dict]:
    return [
        Sample(group_index=g, index=g * per_group + i, prompt=f"{g}>", tokens=[5, 6, 7], response="x",
               response_length=1, reward=float(i % 2), rollout_log_probs=[-0.5], loss_mask=[1]).to_dict()
        for g in range(groups) for i in range(per_group)
    ]


@pytest.mark.parametrize(("mode", "limit", "expected"), [
    ("all", 4, 12), ("off", 4, 0),
    ("sample", 4, 4),  # exactly one group of 4
    ("sample", 5, 8),  # rounded up to whole groups
    ("sample", 1, 4),  # at least one group
    ("sample", 100, 12),
])
def test_a_sample_dump_writes_whole_groups_up_to_the_bound(mode, limit, expected):
    assert samples_to_dump(_samples(3, 4), mode, limit) == expected


def test_a_complete_dump_reads_back_as_the_samples_it_was_written_from(tmp_path):
    samples = _samples(2, 2)
    write_rollout_dump(tmp_path, 7, samples, [[0.5], [-0.5], [1.0], [-1.0]], samples_in_rollout=4)
    rows = [json.loads(line) for line in (tmp_path / "rollout_7.jsonl").read_text().splitlines()]
    assert [r["advantages"] for r in rows] == [[0.5], [-0.5], [1.0], [-1.0]]
    assert rows[1]["rollout_log_probs"] == [-0.5] and rows[1]["reward"] == 1.0 and rows[1]["prompt"] == "0>"
    assert load_rollout_dump(tmp_path, 7, expected_samples=4) == samples
    assert dumped_rollout_ids(tmp_path) == [7]
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, renamed when whole


def test_training_on_a_partial_or_foreign_dump_is_refused_with_what_to_do(tmp_path):
    samples = _samples(3, 4)
    write_rollout_dump(tmp_path, 0, samples[:4], None, samples_in_rollout=12)
    with pytest.raises(RolloutDumpError, match=r"holds 4 of the rollout's \[12\] samples.*--dump-all-rollouts"):
        load_rollout_dump(tmp_path, 0)
    write_rollout_dump(tmp_path, 1, samples, None, samples_in_rollout=12)
    with pytest.raises(RolloutDumpError, match=r"holds 12 samples but this job trains on .* 128"):
        load_rollout_dump(tmp_path, 1, expected_samples=128)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutDumpError, match="no rollout_<k>.jsonl files"):
        dumped_rollout_ids(tmp_path / "empty")
    with pytest.raises(RolloutDumpError, match="no such directory"):
        dumped_rollout_ids(tmp_path / "missing")


def test_the_summary_reports_first_and_last_reward_and_median_phase_times():
    summary = RunSummary("demo", num_rollout=10)
    for rollout_id, reward, generate, step in [(4, 0.25, 1.0, 3.0), (5, 0.5, 3.0, 5.0), (6, 0.75, 2.0, 10.0)]:
        summary.add(rollout_id, {"rollout/raw_reward": reward, "perf/rollout_time": generate, "perf/step_time": step,
                                 "perf/actor_train_time": 0.5})
    text = summary.render(finished=False, checkpoint="/out/checkpoints/rollout_00000006 (rollout 7)", hf_export=None,
                          next_steps=[("resume", "`rlkube run job.yaml` continues from rollout 8")])
    assert text.splitlines() == [
        "== rlkube run demo: stopped ==",
        "rollouts     3 this start (5-7); 7 of 10 in all",
        "reward       0.250 -> 0.750 (rollout 5 -> 7)",
        "median time  generate 2.00s | train 0.50s | whole step 5.00s",  # medians of (1, 3, 2) and (3, 5, 10)
        "checkpoint   /out/checkpoints/rollout_00000006 (rollout 7)",
        "HF export    none written",
        "resume       `rlkube run job.yaml` continues from rollout 8",
    ]


def test_a_start_that_logged_no_rollout_says_how_many_an_earlier_start_had_done():
    fresh = RunSummary("demo", num_rollout=10).render(
        finished=False, checkpoint=None, hf_export=None, next_steps=[])
    assert fresh.splitlines()[1] == "rollouts     none this start (0 of 10 done)"
    resumed = RunSummary("demo", num_rollout=10).render(
        finished=False, checkpoint="/out/checkpoints/rollout_00000003 (rollout 4)", hf_export=None, next_steps=[],
        done_before=4)
    assert resumed.splitlines()[1] == "rollouts     none this start (4 of 10 done)"

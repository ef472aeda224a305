"""The README's chaos table is rendered from the recorded figures, never typed by hand."""

from __future__ import annotations

from render_table import render, write_readme


def test_each_scenario_is_one_row_with_its_figures_and_missing_ones_say_not_run():
    figures = {"scenarios": {
        "engine SIGKILL mid-rollout": {
            "groups_lost": 0, "samples_lost": 0, "groups_trained_twice": 0, "samples_trained_twice": 0,
            "samples_as_reference": True, "weight_versions_as_reference": True, "weights_as_reference": False,
            "rollouts_redone": 0, "engine_serving_again_s": 7.5, "joined_weight_version": "5",
            "measured_at": "2026-11-30T17:10:26Z",
        },
        "operator SIGKILL mid-reconcile -> restart": {
            "duplicate_rayjobs": 0, "operator_reconciled_all_s": 9.2, "measured_at": "2026-11-30T17:12:00Z",
        },
    }}
    lines = render(figures).splitlines()
    [engine] = [line for line in lines if line.startswith("| engine SIGKILL mid-rollout |")]
    assert engine == ("| engine SIGKILL mid-rollout | 0 (0 samples) | 0 (0 samples) | NO: weights_as_reference | 0 "
                      "| engine serving again 7.5 s after the kill | joined_weight_version=5 |")
    [operator] = [line for line in lines if line.startswith("| operator SIGKILL")]
    assert "| n/a | n/a | n/a | n/a | all RLJobs reconciled 9.2 s after the operator's restart | duplicate_rayjobs=0 |" in operator
    assert "| control: uninterrupted rerun | not run |" in lines[2]
    assert lines[-1] == "Measured 2026-11-30T17:10:26Z to 2026-11-30T17:12:00Z (UTC)."


def test_writing_replaces_only_the_table_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- chaos-table:start -->\nold\n<!-- chaos-table:end -->\nafter\n")
    write_readme("| new |", readme)
    assert readme.read_text() == "intro\n<!-- chaos-table:start -->\n| new |\n<!-- chaos-table:end -->\nafter\n"

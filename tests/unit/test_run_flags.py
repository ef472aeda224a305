"""`rlkube run`'s debugging flags: a wrong combination or an unusable dump directory stops the run
before anything starts, with the flag and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkube_runtime.cli import main

LOCAL_TINY = str(Path(__file__).resolve().parents[2] / "manifests" / "examples" / "local-tiny.yaml")


@pytest.mark.parametrize(("flags", "message"), [
    (["--debug-rollout-only", "--debug-train-only"], "--debug-rollout-only and --debug-train-only exclude each other"),
    (["--load-rollouts", "."], "--debug-train-only and --load-rollouts DIR go together"),
    (["--debug-train-only"], "--debug-train-only and --load-rollouts DIR go together"),
    (["--debug-train-only", "--load-rollouts", "{tmp}/missing"], "--load-rollouts {tmp}/missing: no such directory"),
    (["--debug-train-only", "--load-rollouts", "{tmp}"], "no rollout_<k>.jsonl files"),
])
def test_unusable_debug_flags_exit_2_naming_the_flag(flags, message, tmp_path, capsys):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["run", LOCAL_TINY, "--output-dir", str(tmp_path / "out"), *flags]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err

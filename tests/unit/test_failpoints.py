"""Fail points fire once across processes, and only where armed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from rlkube_runtime import failpoints

REACH = "from rlkube_runtime import failpoints; failpoints.reach({point!r}); print('passed')"


def _reach_in_a_process(point: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", REACH.format(point=point)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_an_armed_point_kills_the_first_process_only(tmp_path):
    marker = tmp_path / "fired"
    env = {failpoints.ENV: json.dumps({"engine.update_weights:5": str(marker)})}
    first = _reach_in_a_process("engine.update_weights:5", env)
    assert first.returncode == -signal.SIGKILL and first.stdout == ""
    assert "engine.update_weights:5" in marker.read_text()
    again = _reach_in_a_process("engine.update_weights:5", env)  # a replacement with the same environment
    assert (again.returncode, again.stdout.strip()) == (0, "passed")


def test_other_points_and_an_unset_variable_pass(tmp_path, monkeypatch):
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reach("engine.update_weights:5")
    monkeypatch.setenv(failpoints.ENV, json.dumps({"engine.update_weights:5": str(tmp_path / "m")}))
    failpoints.reach("engine.update_weights:4")
    assert not (tmp_path / "m").exists()


def test_a_malformed_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "engine.update_weights:5")
    with pytest.raises(ValueError, match="RLKUBE_FAILPOINTS must be a JSON object"):
        failpoints.reach("engine.update_weights:5")

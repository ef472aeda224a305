"""Tests sharing an expensive session fixture stay on one xdist worker (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# By path: several conftest.py files exist, and `import conftest` gets whichever was loaded first.
_spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
xdist_group_of = _suite.xdist_group_of


def test_the_chaos_suite_and_control_plane_users_each_form_one_group():
    assert xdist_group_of(TESTS / "chaos" / "test_chaos_local.py", {"slow"}, set()) == "chaos"
    assert xdist_group_of(TESTS / "chaos" / "test_chaos_controlplane.py", {"slow", "controlplane"}, set()) == "chaos"
    assert xdist_group_of(TESTS / "integration" / "test_operator.py", {"controlplane", "slow"}, set()) == "controlplane"
    assert xdist_group_of(TESTS / "integration" / "test_x.py", set(), {"control_plane", "tmp_path"}) == "controlplane"
    assert xdist_group_of(TESTS / "pods" / "test_real_node.py", {"pods", "slow"}, set()) == "pods"
    assert xdist_group_of(TESTS / "unit" / "test_metrics.py", set(), {"tmp_path"}) is None


def test_xdist_runs_a_group_on_one_worker(tmp_path):
    """The hook must run before xdist's own, which reads the groups; four tests of one group on two
    workers all land on one (ungrouped, xdist would hand them to both)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os, pathlib, pytest\n"
        "@pytest.mark.controlplane\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_grouped(i):\n"
        f"    pathlib.Path({str(tmp_path)!r}, f'ran-{{i}}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text().replace(
        "TESTS = Path(__file__).resolve().parent", f"TESTS = Path({str(TESTS)!r})"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "-q", "-o", "markers=controlplane", str(probe)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    workers = {(tmp_path / f"ran-{i}").read_text() for i in range(4)}
    assert len(workers) == 1, workers

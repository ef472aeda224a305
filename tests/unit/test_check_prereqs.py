"""`make run` / `make test` name a missing prerequisite and how to get it (scripts/check_prereqs.py)."""

from __future__ import annotations

import importlib.util
import sys
import re
import stat
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_prereqs", REPO / "scripts" / "check_prereqs.py")
check_prereqs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_prereqs)


def _fake_tool(directory: Path, name: str, output: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """A PATH holding only the tools a test puts there, and an empty control-plane cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("RLKUBE_CONTROLPLANE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RLKUBE_NODE_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.delenv("RLKUBE_SKIP_PROMETHEUS", raising=False)
    return bin_dir


def test_the_go_minimum_is_the_control_planes_go_mod_and_the_readme_states_every_minimum():
    go_mods = [*(REPO / "tests/controlplane").glob("*/go.mod"), *(REPO / "tests/node").glob("*/go.mod")]
    directives = {re.search(r"^go (\d+)\.(\d+)", p.read_text(), re.M).groups() for p in go_mods}
    assert check_prereqs.go_minimum() == max((int(a), int(b)) for a, b in directives)
    readme = (REPO / "README.md").read_text()
    go = "Go %d.%d" % check_prereqs.go_minimum()
    for needed in ("Python %d.%d" % check_prereqs.RUN_PYTHON, "Python %d.%d" % check_prereqs.TEST_PYTHON, go, "apt-get install prometheus", "iproute2"):
        assert needed in readme, needed
    requires = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text()).groups()
    assert tuple(int(v) for v in requires) == check_prereqs.RUN_PYTHON


def test_a_python_older_than_needed_is_named_with_both_versions():
    [problem] = check_prereqs.check_python((99, 0))
    assert problem.startswith("Python 99.0 or newer is needed, this is %d.%d" % tuple(sys.version_info[:2]))


def test_go_is_asked_for_only_while_the_control_plane_is_unbuilt(bare_path):
    [problem] = check_prereqs.check_go()
    assert problem.startswith("Go 1.24 or newer is needed to build the test control plane") and "go.dev/dl" in problem
    _fake_tool(bare_path, "go", "go version go1.21.3 linux/amd64")
    [problem] = check_prereqs.check_go()
    assert "Go 1.24 or newer is needed" in problem and "go1.21.3" in problem
    _fake_tool(bare_path, "go", "go version go1.26.0 linux/amd64")
    assert check_prereqs.check_go() == []


def test_the_real_node_asks_for_root_and_for_apt_get_while_its_packages_are_missing(bare_path, monkeypatch):
    monkeypatch.setattr(check_prereqs, "NODE_PACKAGES", {"containerd": str(bare_path / "containerd")})
    monkeypatch.setattr(check_prereqs.os, "geteuid", lambda: 1000)
    root, apt = check_prereqs.check_node()
    assert "need root" in root and "-m 'not pods'" in root
    assert apt.startswith("containerd missing") and "no apt-get" in apt
    monkeypatch.setattr(check_prereqs.os, "geteuid", lambda: 0)
    _fake_tool(bare_path, "apt-get", "")
    assert check_prereqs.check_node() == []  # tests/node/build.sh installs it
    (bare_path / "apt-get").unlink()
    _fake_tool(bare_path, "containerd", "")
    assert check_prereqs.check_node() == []


def test_prometheus_without_apt_get_is_named(bare_path):
    [problem] = check_prereqs.check_prometheus()
    assert "prometheus and promtool" in problem and "no apt-get" in problem
    _fake_tool(bare_path, "apt-get", "")
    _fake_tool(bare_path, "sudo", "")
    assert check_prereqs.check_prometheus() == []  # build.sh installs them
    (bare_path / "apt-get").unlink()
    _fake_tool(bare_path, "prometheus", "")
    _fake_tool(bare_path, "promtool", "")
    assert check_prereqs.check_prometheus() == []


def test_network_namespaces_ask_for_root_and_iproute2(bare_path, monkeypatch):
    monkeypatch.setattr(check_prereqs.os, "geteuid", lambda: 1000)
    no_root, no_ip = check_prereqs.check_netns()
    assert "network namespace" in no_root and "root" in no_root
    assert "apt-get install iproute2" in no_ip
    monkeypatch.setattr(check_prereqs.os, "geteuid", lambda: 0)
    _fake_tool(bare_path, "ip", "")
    assert check_prereqs.check_netns() == []


def test_the_make_targets_run_the_check_before_making_the_venv():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^venv: check-run$", makefile, re.M) and re.search(r"^venv-dev: check-test$", makefile, re.M)
    assert "scripts/check_prereqs.py run" in makefile and "scripts/check_prereqs.py test" in makefile


def test_a_python_without_ensurepip_is_told_to_install_python3_venv(monkeypatch):
    calls = []

    def call(argv, **_):
        calls.append(argv[-1])
        return 1 if "ensurepip" in argv[-1] else 0

    monkeypatch.setattr(check_prereqs.subprocess, "call", call)
    [problem] = check_prereqs.check_python((3, 0))
    assert "apt-get install python3-venv" in problem and calls == ["import venv", "import ensurepip"]
    monkeypatch.setattr(check_prereqs.subprocess, "call", lambda argv, **_: 0)
    assert check_prereqs.check_python((3, 0)) == []

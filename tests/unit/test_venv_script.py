"""`make run` / `make test` use the project's own venv (scripts/venv.py): reused while what decides its
contents is unchanged, made again from nothing when it changes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("venv_script", REPO / "scripts" / "venv.py")
venv_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(venv_script)


def test_the_key_changes_with_pyproject_the_interpreter_and_the_no_deps_pins():
    base = venv_script.deps_key("deps = ['a']", "3.11.7", ("sglang==0.5.8",))
    assert base == venv_script.deps_key("deps = ['a']", "3.11.7", ("sglang==0.5.8",))
    assert base != venv_script.deps_key("deps = ['a', 'b']", "3.11.7", ("sglang==0.5.8",))
    assert base != venv_script.deps_key("deps = ['a']", "3.12.1", ("sglang==0.5.8",))
    assert base != venv_script.deps_key("deps = ['a']", "3.11.7", ("sglang==0.5.9",))
    # Parts are separated: moving text from one part to the next is a different key.
    assert venv_script.deps_key("ab", "c", ()) != venv_script.deps_key("a", "bc", ())


def test_a_stamp_of_another_key_holds_nothing():
    stamp = {"key": "k1", "targets": ["run"]}
    assert venv_script.installed_targets(stamp, "k1") == {"run"}
    assert venv_script.installed_targets(stamp, "k2") == set()
    assert venv_script.installed_targets({}, "k1") == set()


class _FakeInstaller:
    """Records what ensure() runs; `python -m venv` makes the bin/python it expects, pip's install
    of uv the bin/uv."""

    def __init__(self):
        self.commands: list[list[str]] = []

    def __call__(self, argv, **_):
        self.commands.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            python = Path(argv[3]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
        if argv[-1] == venv_script.UV:
            (Path(argv[0]).parent / "uv").write_text("")


@pytest.fixture
def installer(monkeypatch):
    fake = _FakeInstaller()
    monkeypatch.setattr(venv_script.subprocess, "run", fake)
    return fake


def test_a_fresh_venv_is_made_then_reused_and_dev_covers_run(tmp_path, installer):
    venv = tmp_path / "venv"
    assert venv_script.ensure("dev", venv) == venv / "bin" / "python"
    made = installer.commands
    assert made[0] == [sys.executable, "-m", "venv", str(venv)]
    assert made[1] == [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                       venv_script.UV]  # uv installs the rest, into this venv
    uv_install = [str(venv / "bin" / "uv"), "pip", "install", "--python", str(venv / "bin" / "python"), "--quiet",
                  "--compile-bytecode"]
    assert made[2] == [*uv_install, "-e", ".[dev]"] and made[3] == [*uv_install, "--no-deps", "sglang==0.5.8"]
    assert len(made) == 4
    assert json.loads((venv / "rlkube-deps.json").read_text())["targets"] == ["dev"]

    installer.commands.clear()
    venv_script.ensure("dev", venv)
    venv_script.ensure("run", venv)  # the dev extra includes the runtime's
    assert installer.commands == []


def test_run_then_dev_installs_the_dev_extra_into_the_same_venv(tmp_path, installer):
    venv = tmp_path / "venv"
    venv_script.ensure("run", venv)
    installer.commands.clear()
    venv_script.ensure("dev", venv)
    assert [c[-2:] for c in installer.commands] == [["-e", ".[dev]"], ["--no-deps", "sglang==0.5.8"]]
    assert json.loads((venv / "rlkube-deps.json").read_text())["targets"] == ["dev", "run"]


def test_a_venv_made_from_other_dependencies_is_deleted_and_made_again(tmp_path, installer):
    venv = tmp_path / "venv"
    venv_script.ensure("dev", venv)
    leftover = venv / "lib" / "a-package-pyproject-no-longer-declares"
    leftover.mkdir(parents=True)
    (venv / "rlkube-deps.json").write_text(json.dumps({"key": "an older key", "targets": ["dev"]}))
    installer.commands.clear()
    venv_script.ensure("dev", venv)
    assert installer.commands[0][1:3] == ["-m", "venv"] and not leftover.exists()

"""The project's own virtual environment, made from declared dependencies only.

    python3 scripts/venv.py run     # .venv with rlkube[runtime]        (make run)
    python3 scripts/venv.py dev     # .venv with rlkube[dev] + sglang    (make test)

Why: installing into the interpreter's own site-packages lets whatever happens to be there hide a
dependency nobody declared (it did: SGLang's import needed psutil and dill, and only a fresh machine
showed it). The venv is keyed by everything that decides its contents (pyproject.toml, the
interpreter, the no-deps pins below): while the key holds it is reused as is (a warm `make test`
spends no time here); when the key changes it is deleted and made again from nothing, so a package
dropped from pyproject.toml also leaves the venv.

uv installs it (pip puts uv itself in first, from its cache): it resolves the same declared
dependencies from the same index, and installs from its cache (~/.cache/uv) by hard links, so a
clean clone's venv is made in less time than pip took to unpack torch and its CUDA libraries again
(about 3 minutes of every `make test` on a clean clone).

Prints the venv's python on success. Stdlib only: it runs on the bare system interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("RLKUBE_VENV", REPO / ".venv"))
STAMP = "rlkube-deps.json"

# Installed with --no-deps on top of an extra: SGLang's wheel is read for its argument parser only
# (tests/unit/engine/test_sglang_conformance.py); its declared dependencies pin a CUDA torch build, so
# what its import needs is declared in the dev extra instead.
NO_DEPS = {"run": (), "dev": ("sglang==0.5.8",)}
EXTRAS = {"run": "runtime", "dev": "dev"}
UV = "uv==0.13.9"
COVERS = {"run": {"run", "dev"}, "dev": {"dev"}}  # the dev extra includes the runtime's


def content_key(*parts: str) -> str:
    """One short hash of the parts, each kept apart from the next (moving text across a boundary changes it)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def deps_key(pyproject_text: str, python_version: str, no_deps: tuple[str, ...]) -> str:
    """What decides the venv's contents; a change to any part means a new venv."""
    return content_key(pyproject_text, python_version, *no_deps)


def installed_targets(stamp: dict, key: str) -> set[str]:
    """The targets the venv already holds, or none when it was made for another key."""
    return set(stamp.get("targets", ())) if stamp.get("key") == key else set()


def _read_stamp(venv: Path) -> dict:
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def _install(venv: Path, *args: str) -> None:
    python, uv = venv / "bin" / "python", venv / "bin" / "uv"
    if not uv.exists():
        subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", UV], cwd=REPO, check=True)
    # --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on the development
    # machine) nothing is ever compiled later, and every process of every test then compiles
    # torch and transformers again from source (the suite took 33 min instead of 22 without it).
    subprocess.run([str(uv), "pip", "install", "--python", str(python), "--quiet", "--compile-bytecode", *args],
                   cwd=REPO, check=True)


def ensure(target: str, venv: Path = VENV) -> Path:
    python = venv / "bin" / "python"
    key = deps_key((REPO / "pyproject.toml").read_text(), sys.version, (UV, *(p for pins in NO_DEPS.values() for p in pins)))
    stamp = _read_stamp(venv)
    have = installed_targets(stamp, key)
    if COVERS[target] & have and python.exists():
        return python
    if not have:
        if venv.exists():
            print("venv: %s was made from other dependencies; making it again" % venv, file=sys.stderr)
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        (venv / ".gitignore").write_text("*\n")
    print("venv: installing rlkube[%s] into %s" % (EXTRAS[target], venv), file=sys.stderr)
    _install(venv, "-e", ".[%s]" % EXTRAS[target])
    if NO_DEPS[target]:
        _install(venv, "--no-deps", *NO_DEPS[target])
    (venv / STAMP).write_text(json.dumps({"key": key, "targets": sorted(have | {target})}))
    return python


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in EXTRAS:
        print("usage: %s run|dev" % argv[0], file=sys.stderr)
        return 2
    print(ensure(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

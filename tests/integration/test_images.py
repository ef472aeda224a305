"""The images' install steps, reproduced: each Dockerfile's own `pip install` line run into a fresh
virtual environment, whose result must import everything the pod runs and answer `rlkube --help`.

No Docker engine here, so the base images are stood in for: the operator image's base
(python:3.11-slim) by a venv that sees nothing of this machine's packages; the trainer's and the
rollout image's bases (an NGC PyTorch image, the SGLang image) by a venv that sees this machine's
torch and friends, as their pip line sees the base's. The `sglang` extra is left out of the
trainer's line here: its declared dependencies pin a CUDA torch build that the base image already
provides (the pinned SGLang's flags are checked by tests/unit/engine/test_sglang_conformance.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

# image Dockerfile -> (sees this machine's packages as its base image's, what its pods import)
IMAGES = {
    "images/operator.Dockerfile": (False, ["rlkube_operator.main", "rlkube_runtime.spec", "kopf", "kubernetes"]),
    "Dockerfile.trainer": (True, ["rlkube_runtime.run", "rlkube_runtime.actors.trainer", "rlkube_runtime.status_report",
                                  "kubernetes", "ray", "megatron.core", "wandb", "mlflow"]),
    "Dockerfile.rollout": (True, ["rlkube_runtime.actors.rollout_manager", "rlkube_runtime.status_report", "kubernetes",
                                  "sglang_router"]),
}
LEFT_OUT_EXTRAS = {"sglang"}


def _pip_extras(dockerfile: str) -> list[str]:
    """The extras of the Dockerfile's `pip install ".[a,b]"` line (there is exactly one)."""
    lines = re.findall(r'^RUN pip install "\.\[([a-z,]+)\]"\s*$', (REPO / dockerfile).read_text(), flags=re.M)
    assert len(lines) == 1, f"{dockerfile}: expected one `RUN pip install \".[extras]\"` line, found {lines}"
    return lines[0].split(",")


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_the_images_pip_line_installs_what_its_pods_import(dockerfile, tmp_path):
    sees_base, modules = IMAGES[dockerfile]
    extras = [e for e in _pip_extras(dockerfile) if e not in LEFT_OUT_EXTRAS]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=sees_base).create(env_dir)
    python = str(env_dir / "bin" / "python")

    install = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{REPO}[{','.join(extras)}]"],
        capture_output=True, text=True, timeout=1500,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    # Imported from the venv's copy, not this checkout: run from a directory outside the repo.
    check = subprocess.run(
        [python, "-c", "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; "
         "import rlkube_runtime; print(rlkube_runtime.__file__)", *modules],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert str(env_dir) in check.stdout, f"rlkube_runtime came from {check.stdout.strip()}, not the image's install"
    cli = subprocess.run([str(env_dir / "bin" / "rlkube"), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cli.returncode == 0 and "run" in cli.stdout, cli.stdout + cli.stderr


def test_every_image_names_its_pinned_base_and_build_command():
    for dockerfile in IMAGES:
        text = (REPO / dockerfile).read_text()
        base = re.search(r"^(?:ARG BASE=|FROM )(\S+)", text, flags=re.M).group(1)
        assert ":" in base and not base.endswith(":latest"), f"{dockerfile}: base image {base} is not pinned"
        assert re.search(r"docker build -f \S+ -t \S+ \.", text), f"{dockerfile}: no build command in its comments"

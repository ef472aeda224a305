"""The trainer image's install step, reproduced: its last `pip install ".[extras]"` line (the one
that adds megatron-core and the trackers to the runtime) run into a fresh virtual environment, whose
result must import everything the trainer's pods run and answer `rlkube --help`.

The operator and rollout images are built for real by images/build.sh in `make test` and run as
pods on the real node (tests/pods), which covers their install steps. The trainer image (11.9 GB,
its CUDA base) is not built here, so its step is checked this way. The NGC PyTorch base is stood
in for by a venv that sees the base interpreter's packages, as the image's pip sees the base's;
the `sglang` extra is left out: its declared dependencies pin a CUDA torch build that the base
image already provides (the pinned SGLang's flags are checked by
tests/unit/engine/test_sglang_conformance.py).
"""

from __future__ import annotations

import os
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
    "Dockerfile.trainer": (True, ["rlkube_runtime.run", "rlkube_runtime.actors.trainer", "rlkube_runtime.status_report",
                                  "kubernetes", "ray", "megatron.core", "wandb", "mlflow"]),
}
LEFT_OUT_EXTRAS = {"sglang"}


PIP_LINE = re.compile(r'^(?:RUN | && )(?:PIP_CONSTRAINT=(\S+) )?pip install "\.\[([a-z,]+)\]"', flags=re.M)


def _pip_line(dockerfile: str) -> tuple[str | None, list[str]]:
    """(constraint file, extras) of the Dockerfile's last `pip install ".[a,b]"` line: the layers
    install growing sets of extras, the last one all of them."""
    lines = PIP_LINE.findall((REPO / dockerfile).read_text())
    assert lines, f"{dockerfile}: no `pip install \".[extras]\"` line"
    constraint, extras = lines[-1]
    return constraint or None, extras.split(",")


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_the_images_pip_line_installs_what_its_pods_import(dockerfile, tmp_path):
    sees_base, modules = IMAGES[dockerfile]
    constraint, extras = _pip_line(dockerfile)
    extras = [e for e in extras if e not in LEFT_OUT_EXTRAS]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=sees_base).create(env_dir)
    python = str(env_dir / "bin" / "python")

    install = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{REPO}[{','.join(extras)}]"],
        capture_output=True, text=True, timeout=1500,
        env={**os.environ, **({"PIP_CONSTRAINT": str(REPO / "images" / constraint)} if constraint else {})},
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
    for dockerfile in ("images/operator.Dockerfile", "Dockerfile.trainer", "Dockerfile.rollout"):
        text = (REPO / dockerfile).read_text()
        base = re.search(r"^(?:ARG BASE=|FROM )(\S+)", text, flags=re.M).group(1)
        assert ":" in base and not base.endswith(":latest"), f"{dockerfile}: base image {base} is not pinned"
        assert re.search(r"docker build -f \S+ -t \S+ \.", text), f"{dockerfile}: no build command in its comments"

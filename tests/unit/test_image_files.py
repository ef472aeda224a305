"""The three Dockerfiles: one user, one layout, so that the local builds (images/build.sh, BASE set
to a local Debian image) and the production ones (CUDA bases) cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rlkube_runtime.spec.contract import IMAGE_UID

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "operator": REPO / "images" / "operator.Dockerfile",
    "trainer": REPO / "Dockerfile.trainer",
    "rollout": REPO / "Dockerfile.rollout",
}


def _instructions(path: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", "", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_each_image_runs_as_the_contracts_user_with_a_passwd_entry(image):
    steps = _instructions(DOCKERFILES[image])
    user = steps.index(f"USER {IMAGE_UID}:{IMAGE_UID}")
    assert user > max(i for i, s in enumerate(steps) if s.startswith("RUN"))  # builds as root, runs as the user
    [useradd] = [s for s in steps if "useradd" in s]
    assert f"--uid {IMAGE_UID}" in useradd and f"--gid {IMAGE_UID}" in useradd and useradd.endswith(" rlkube")


@pytest.mark.parametrize("image", DOCKERFILES)
def test_each_image_takes_its_base_as_a_build_argument(image):
    steps = _instructions(DOCKERFILES[image])
    assert steps[0].startswith("ARG BASE=")
    assert [s for s in steps if s.startswith("FROM")] == ["FROM ${BASE} AS deps", "FROM ${BASE}"]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_code_is_copied_after_the_dependencies_are_installed(image):
    # A code change must not reinstall gigabytes of wheels: every `pip install` with dependencies
    # comes before the first COPY of the code, which is installed with --no-deps.
    steps = _instructions(DOCKERFILES[image])
    first_code = steps.index("COPY runtime ./runtime")
    installs = [i for i, s in enumerate(steps) if "pip install" in s]
    assert all(i < first_code for i in installs[:-1])
    assert installs[-1] > first_code and "--no-deps" in steps[installs[-1]]


def test_the_trainer_and_rollout_images_share_their_steps_up_to_the_runtime_layer():
    # Built from one BASE, buildah reuses these layers: the CUDA torch is installed once for both.
    trainer, rollout = (_instructions(DOCKERFILES[i])[1:] for i in ("trainer", "rollout"))
    runtime_layer = next(i for i, s in enumerate(rollout) if 'pip install ".[runtime]"' in s)
    assert trainer[: runtime_layer + 1] == rollout[: runtime_layer + 1]


@pytest.mark.parametrize("image", ["trainer", "rollout"])
def test_the_ray_images_bring_wget_for_kuberays_probes(image):
    # KubeRay's liveness and readiness probes of Ray pods are `wget` commands: without it no Ray pod
    # becomes Ready and KubeRay never submits the job (found on the real node, Debian base).
    [step] = [s for s in _instructions(DOCKERFILES[image]) if "wget" in s]
    assert step.startswith("RUN command -v wget") and "apt-get install" in step

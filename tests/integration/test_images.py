"""The trainer image's install step, reproduced: its last `pip install ".[extras]"` line (the one
that adds megatron-core and the trackers to the runtime) run into a fresh virtual environment, whose
result must import everything the trainer's pods run and answer `rlkube --help`.

The operator and rollout images are built for real by images/build.sh in `make test` and run as
pods on the real node (tests/pods), which covers their install steps. The trainer image (11.9 GB,
its CUDA base) is not built here, so its step is checked this way. The NGC PyTorch base is stood
in for by torch and its own dependencies, linked from this machine's venv into a directory the new
venv reads through a .pth file: the image's pip finds torch installed and must install everything
else the line asks for, as in the image (installing torch itself again took most of this test's
195 s); the `sglang` extra is left out: its declared dependencies pin a CUDA torch build that the base
image already provides (the pinned SGLang's flags are checked by
tests/unit/engine/test_sglang_conformance.py).

The installed environment is kept between runs (~/.cache/rlkube/trainer-pip/<key>), as Docker
keeps the image's dependency layers: the key is everything those layers are made from (the
Dockerfile, pyproject.toml, the pins, the extras, the interpreter, the base's torch), so a changed
dependency installs everything again from nothing. A kept one gets the code layer only, as the
Dockerfile's last `pip install --no-deps --force-reinstall .` does, before the same checks (the
full install took 160 s of a warm `make test`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("venv_script", REPO / "scripts" / "venv.py")
venv_script = importlib.util.module_from_spec(_spec)  # its content_key: one way to key what an install is made from
_spec.loader.exec_module(venv_script)

# image Dockerfile -> (has the stand-in of its torch base image, what its pods import)
IMAGES = {
    "Dockerfile.trainer": (True, ["rlkube_runtime.run", "rlkube_runtime.actors.trainer", "rlkube_runtime.status_report",
                                  "kubernetes", "ray", "megatron.core", "wandb", "mlflow"]),
}
LEFT_OUT_EXTRAS = {"sglang"}


PIP_LINE = re.compile(r'^(?:RUN | && )(?:PIP_CONSTRAINT=(\S+) )?pip install "\.\[([a-z,]+)\]"', flags=re.M)


def _requirement_name(requirement: str) -> str | None:
    """The distribution a Requires-Dist line names; None for an extra's (torch's own are not in the base)."""
    name, _, marker = requirement.partition(";")
    return None if "extra" in marker else re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)


def torch_base(target: Path) -> Path:
    """`target` holding links to torch and the distributions it depends on (recursively), each
    with its dist-info, as this machine's venv has them: the part of the PyTorch base image the
    trainer's pip line relies on."""
    site = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        try:
            dist = importlib.metadata.distribution(todo.pop())
        except importlib.metadata.PackageNotFoundError:  # a dependency for another platform
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (site / top).exists() and not (target / top).exists():
                (target / top).symlink_to(site / top)
        todo += [n for n in map(_requirement_name, dist.requires or []) if n]
    return target


def _pip_line(dockerfile: str) -> tuple[str | None, list[str]]:
    """(constraint file, extras) of the Dockerfile's last `pip install ".[a,b]"` line: the layers
    install growing sets of extras, the last one all of them."""
    lines = PIP_LINE.findall((REPO / dockerfile).read_text())
    assert lines, f"{dockerfile}: no `pip install \".[extras]\"` line"
    constraint, extras = lines[-1]
    return constraint or None, extras.split(",")


CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlkube" / "trainer-pip"
COMPLETE = "rlkube-install-complete"  # written last: an entry without it was cut short


def install_key(dockerfile: str, constraint: str | None, extras: list[str]) -> str:
    """What the image's dependency layers are made from; any change means a new install."""
    return venv_script.content_key(
        (REPO / dockerfile).read_text(), (REPO / "pyproject.toml").read_text(),
        (REPO / "images" / constraint).read_text() if constraint else "", ",".join(extras),
        sys.version, importlib.metadata.version("torch"))


def _pip(python: str, *args: str, constraint: str | None = None) -> None:
    install = subprocess.run(
        # --no-compile: what is installed is the same; byte-compiling every installed file (most
        # of them never imported here) was a large part of this test's time on two cores.
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-compile", "-q", *args],
        capture_output=True, text=True, timeout=1500,
        env={**os.environ, **({"PIP_CONSTRAINT": str(REPO / "images" / constraint)} if constraint else {})},
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_the_images_pip_line_installs_what_its_pods_import(dockerfile, tmp_path):
    sees_base, modules = IMAGES[dockerfile]
    constraint, extras = _pip_line(dockerfile)
    extras = [e for e in extras if e not in LEFT_OUT_EXTRAS]
    entry = CACHE / install_key(dockerfile, constraint, extras)
    for other in CACHE.glob("*") if CACHE.is_dir() else ():
        if other != entry or not (other / COMPLETE).exists():
            shutil.rmtree(other)  # another key's, or one cut short: only one complete install is kept
    env_dir = entry / "venv"
    python = str(env_dir / "bin" / "python")
    kept = env_dir.is_dir()
    if not kept:
        venv.EnvBuilder(with_pip=True).create(env_dir)
    if sees_base:  # the links point into this checkout's venv: made again every time
        shutil.rmtree(entry / "base", ignore_errors=True)
        venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
        Path(venv_site, "torch-base.pth").write_text(f"{torch_base(entry / 'base')}\n")
    if kept:
        _pip(python, "--no-deps", "--force-reinstall", str(REPO))
    else:
        _pip(python, f"{REPO}[{','.join(extras)}]", constraint=constraint)
        (entry / COMPLETE).write_text(f"{dockerfile} [{','.join(extras)}]\n")

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

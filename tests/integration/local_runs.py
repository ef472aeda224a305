"""Running the embedded default (`manifests/examples/local-tiny.yaml`) as a user would: `rlkube run`
in a subprocess, on a copy of the example with a few fields changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCAL_TINY = REPO / "manifests" / "examples" / "local-tiny.yaml"


def write_local_tiny(tmp_path: Path, name: str, **overrides) -> Path:
    """A copy of local-tiny.yaml named `name`, with dotted keys set (`spec.training.numRollout=8`)."""
    doc = yaml.safe_load(LOCAL_TINY.read_text())
    doc["metadata"]["name"] = name
    for dotted, value in overrides.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def rlkube_run_command(job: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "rlkube_runtime.cli", "run", str(job), "--output-dir", str(out)]


def start_run(job: Path, out: Path) -> subprocess.Popen:
    """`rlkube run` in its own process group (so a test can kill all of it), output merged."""
    return subprocess.Popen(
        rlkube_run_command(job, out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

"""The runtime's layers (runtime/importlinter.ini) hold: the loop depends on the parts, never the reverse."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_runtime_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports not found: install the dev extras (pip install -e '.[dev]')", pytrace=False)
    result = subprocess.run(
        [exe, "--config", str(REPO / "runtime" / "importlinter.ini")], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr

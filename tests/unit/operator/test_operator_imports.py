"""The operator's layers, as operator/importlinter.ini states them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "operator" / "importlinter.ini"


def test_only_the_client_module_talks_to_kubernetes_and_pure_modules_import_no_kopf():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports not found: install the dev extras (pip install -e '.[dev]')", pytrace=False)
    proc = subprocess.run([exe, "--config", str(CONFIG)], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


def test_pure_modules_load_without_kopf_or_kubernetes():
    code = (
        "import sys\n"
        "sys.modules['kopf'] = None\n"
        "sys.modules['kubernetes'] = None\n"
        "import rlkube_operator.reconcile, rlkube_operator.render, rlkube_operator.status\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

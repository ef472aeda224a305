"""tests/integration: the control-plane harness (tests/controlplane/harness.py) importable as
`harness`; the session fixture ``control_plane`` itself comes from tests/conftest.py, shared with
tests/security.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONTROLPLANE_DIR = Path(__file__).resolve().parents[1] / "controlplane"
if str(CONTROLPLANE_DIR) not in sys.path:
    sys.path.insert(0, str(CONTROLPLANE_DIR))

"""Suite-wide: which tests must share one pytest-xdist worker.

`make test` runs the suite on two workers (`-n 2 --dist loadgroup`). A session-scoped fixture is
made once per worker, so the tests that share an expensive one are kept on one worker: everything
on the shared control plane, and the chaos suite (its own control plane and its reference run).
The rest is spread over both workers as they free up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def xdist_group_of(path: Path, markers: set[str], fixtures: set[str]) -> str | None:
    """The worker group a test belongs to, or None when it may run anywhere."""
    if TESTS / "chaos" in path.parents:
        return "chaos"
    if "controlplane" in markers or "control_plane" in fixtures:
        return "controlplane"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        group = xdist_group_of(Path(str(item.path)), markers, set(getattr(item, "fixturenames", ())))
        if group:
            item.add_marker(pytest.mark.xdist_group(group))

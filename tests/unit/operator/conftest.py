"""Fixtures of the operator's unit tests (helpers live in operator_testutil.py)."""

from __future__ import annotations

import pytest
from operator_testutil import default_settings
from rlkube_operator.settings import OperatorSettings


@pytest.fixture
def settings() -> OperatorSettings:
    return default_settings()

"""Fixtures for the engine's unit tests: one tiny checkpoint per session."""

import pytest

from rlkube_runtime.tiny.model import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)

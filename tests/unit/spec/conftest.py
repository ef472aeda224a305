"""Fixtures for the spec tests: a known-good RLJob document to break one field at a time."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest

from rlkube_runtime.spec.load import SpecError, parse_rljob

REPO = Path(__file__).resolve().parents[3]

GOOD_RLJOB: dict[str, Any] = {
    "apiVersion": "rlkube.io/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "good"},
    "spec": {
        "model": {"preset": "tiny"},
        "data": {"promptData": "builtin:digit-successor"},
        "rollout": {"batchSize": 16, "nSamplesPerPrompt": 8, "maxResponseLen": 4, "engine": "builtin"},
        "reward": {"type": "exact"},
        "training": {"numRollout": 60, "globalBatchSize": 128, "optimizer": {"lr": 1e-3}},
        "resources": {"placement": "colocated"},
    },
}


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def good_doc() -> dict[str, Any]:
    """A fresh copy of a valid RLJob document (the local tiny job, written inline)."""
    return copy.deepcopy(GOOD_RLJOB)


@pytest.fixture
def spec_errors() -> Callable[[dict[str, Any]], list[tuple[str, str]]]:
    """Parse a document and return its (path, message) errors; fails the test if it is valid."""

    def errors(doc: dict[str, Any]) -> list[tuple[str, str]]:
        with pytest.raises(SpecError) as info:
            parse_rljob(doc)
        return info.value.errors

    return errors

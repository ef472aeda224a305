"""Shared fixtures: one tiny real checkpoint per session, one thread per test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rlkube_runtime.tiny.model import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A seeded 2-layer Qwen2 with a character tokenizer (hidden 32, vocab ~100)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_heads=4)


@pytest.fixture(scope="session")
def tiny_checkpoint_with_dropout(tiny_checkpoint, tmp_path_factory):
    """The same weights with attention dropout 0.1, so a training step consumes random numbers."""
    out = tmp_path_factory.mktemp("tiny_dropout") / "model"
    shutil.copytree(tiny_checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    # The test machine's cores are shared; one thread also keeps float sums reproducible.
    torch.set_num_threads(1)

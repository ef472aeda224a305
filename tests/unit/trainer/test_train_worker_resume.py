"""A trainer rank resumes with its own random streams, not rank 0's: the driver saves each rank's
`rng_state()` beside the (rank 0) model and optimizer state and hands each rank its own back."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from rlkube_runtime.actors.trainer import TrainerWorker

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def _worker(checkpoint) -> TrainerWorker:
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    return TrainerWorker(spec, hf_checkpoint=str(checkpoint))


def test_each_rank_gets_its_own_random_streams_back(tiny_checkpoint):
    worker = _worker(tiny_checkpoint)
    state = worker.state_dict()  # rank 0's, RNG included
    torch.manual_seed(1)  # another rank's streams differ from rank 0's
    other_rank = worker.rng_state()
    expected = torch.rand(4)

    torch.manual_seed(99)  # a fresh process after a restart
    worker.load_state_dict(state, rng=other_rank)
    assert torch.equal(torch.rand(4), expected)


def test_without_a_rank_state_the_streams_in_the_trainer_state_are_used(tiny_checkpoint):
    worker = _worker(tiny_checkpoint)
    torch.manual_seed(5)
    state = worker.state_dict()
    expected = torch.rand(4)

    torch.manual_seed(99)
    worker.load_state_dict(state)
    assert torch.equal(torch.rand(4), expected)

"""A trainer rank resumes with its own random streams, not rank 0's: every rank writes its streams
into the checkpoint beside rank 0's trainer state and reads its own back. Older checkpoints held
them in the payload, which the loader still takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlkube_runtime.actors.trainer import TrainerWorker
from rlkube_runtime.trainer import torch_backend
from rlkube_runtime.trainer.rng import capture_rng_state

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


@pytest.fixture
def worker(tiny_checkpoint) -> TrainerWorker:
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    return TrainerWorker(spec, hf_checkpoint=str(tiny_checkpoint))


def test_each_rank_gets_its_own_random_streams_back(worker, tmp_path):
    ckpt = tmp_path / "ckpt"  # made by the checkpoint writer before the ranks save into it
    ckpt.mkdir()
    worker.backend.world_size = 2  # this worker saves as rank 0 of 2, then as rank 1
    torch.manual_seed(0)
    assert worker.save(str(ckpt)) is None  # the torch format: the payload marks none
    torch.manual_seed(1)  # another rank's streams differ from rank 0's
    worker.backend.rank = 1
    worker.save(str(ckpt))
    expected = torch.rand(4)

    torch.manual_seed(99)  # a fresh process after a restart
    worker.load(str(ckpt), None)
    assert torch.equal(torch.rand(4), expected)
    assert sorted(p.name for p in (ckpt / torch_backend.RNG_DIR).iterdir()) == [
        "rank0-of-2.pt", "rank1-of-2.pt"]


def test_from_another_world_size_the_streams_in_the_trainer_state_are_used(worker, tmp_path):
    (tmp_path / "ckpt").mkdir()
    torch.manual_seed(5)
    worker.save(str(tmp_path / "ckpt"))
    expected = torch.rand(4)

    worker.backend.world_size = 3  # resumed on three ranks: no file of its own
    torch.manual_seed(99)
    worker.load(str(tmp_path / "ckpt"), None)
    assert torch.equal(torch.rand(4), expected)


def test_a_checkpoint_with_the_streams_in_its_payload_still_resumes_each_rank_with_its_own(worker, tmp_path):
    state = worker.backend.state_dict()  # rank 0's, in the payload of the earliest checkpoints
    torch.manual_seed(1)
    other_rank = capture_rng_state()
    expected = torch.rand(4)

    torch.manual_seed(99)
    worker.load(str(tmp_path), None, state=state, rng=other_rank)
    assert torch.equal(torch.rand(4), expected)

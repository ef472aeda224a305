"""training.refUpdateInterval in each backend: a refreshed reference scores exactly like the
actor, and a checkpoint carries it, so a resumed trainer measures KL against the same reference
(a checkpoint of a reference never refreshed stores no copy: the model directory has it)."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import tiny_hf
from trainer_testutil import random_batch

from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.torch_backend import TorchBackend

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3") / "m")


def build(kind: str, path):
    config = TrainerConfig(model=ModelConfig(hf_checkpoint=str(path)), optimizer=OptimizerConfig(lr=1e-2),
                           batching=BatchingConfig(max_tokens_per_gpu=30),
                           loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    if kind == "torch":
        return TorchBackend(config, device="cpu")
    pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend

    return MegatronBackend(config, device="cpu")


def save(backend, directory):
    directory.mkdir()  # the checkpoint code makes it (under a temporary name)
    backend.save(directory)


def scores(backend, batch, model):
    return backend.log_probs(batch, model=model).log_probs


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_a_refreshed_reference_is_the_actor_and_survives_a_checkpoint(kind, qwen3, tmp_path):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    backend = build(kind, qwen3)
    batch = batch.with_fields(old_log_probs=scores(backend, batch, "actor"))
    initial = scores(backend, batch, "ref")
    backend.train_step(batch.with_fields(ref_log_probs=initial))
    save(backend, tmp_path / "before")
    actor = scores(backend, batch, "actor")
    assert any(not torch.equal(a, r) for a, r in zip(actor, initial))  # the step moved the actor

    backend.refresh_reference()
    refreshed = scores(backend, batch, "ref")
    assert all(torch.equal(a, r) for a, r in zip(actor, refreshed))
    save(backend, tmp_path / "after")

    resumed = build(kind, qwen3)
    resumed.load(tmp_path / "after")
    assert resumed.ref_refreshed
    assert all(torch.equal(a, r) for a, r in zip(scores(resumed, batch, "ref"), refreshed))
    never = build(kind, qwen3)
    never.load(tmp_path / "before")
    assert not never.ref_refreshed
    assert all(torch.equal(a, r) for a, r in zip(scores(never, batch, "ref"), initial))

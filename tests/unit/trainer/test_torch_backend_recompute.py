"""spec.parallelism.recompute in the torch backend: full recomputes every decoder layer in the
backward and leaves the gradients exactly as they were; selective is refused."""

from __future__ import annotations

import pytest
import torch
from rlkube_runtime.spec.backend_rules import TORCH_SELECTIVE_RECOMPUTE_MESSAGE
from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.torch_backend import TorchBackend
from trainer_testutil import random_batch

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9)]


def _backend(checkpoint, recompute: str) -> TorchBackend:
    return TorchBackend(
        TrainerConfig(
            model=ModelConfig(hf_checkpoint=str(checkpoint)),
            optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.0),
            batching=BatchingConfig(max_tokens_per_gpu=21),  # two micro-batches: {20}, {14, 5} ...
            loss=LossConfig(eps_clip=0.1, entropy_coef=0.01),
            recompute=recompute,
        ),
        device="cpu",
    )


def _gradients_and_layer_calls(checkpoint, recompute: str) -> tuple[dict[str, torch.Tensor], int, float]:
    """The gradient of one global batch, how many times decoder layers ran during it (counted at
    their MLPs: transformers checkpoints a layer's forward, inside its hooks), and the loss."""
    backend = _backend(checkpoint, recompute)
    batch = random_batch(LENGTHS)
    g = torch.Generator().manual_seed(1)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in backend.compute_log_probs(batch).log_probs]
    batch = batch.with_fields(old_log_probs=old)
    calls = []
    layers = backend.model.base_model.layers
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in layers]
    torch.manual_seed(7)  # the same dropout stream for both runs
    metrics = backend.accumulate_gradients(batch)
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in backend.model.named_parameters()}
    return grads, len(calls), metrics["loss"]


def test_full_recompute_runs_each_layer_again_in_the_backward_and_keeps_the_gradients(tiny_checkpoint_with_dropout):
    plain, plain_calls, plain_loss = _gradients_and_layer_calls(tiny_checkpoint_with_dropout, "none")
    full, full_calls, full_loss = _gradients_and_layer_calls(tiny_checkpoint_with_dropout, "full")
    # 2 layers x the micro-batches: once in the forward, once more in the backward when recomputing.
    assert plain_calls > 0 and full_calls == 2 * plain_calls
    assert full_loss == plain_loss
    assert plain.keys() == full.keys()
    for name, grad in plain.items():
        assert torch.equal(grad, full[name]), name
    assert any(grad.abs().sum() > 0 for grad in plain.values())


def test_selective_recompute_is_refused_by_the_torch_backend(tiny_checkpoint):
    with pytest.raises(ValueError) as info:
        _backend(tiny_checkpoint, "selective")
    assert str(info.value) == f"spec.parallelism.recompute: {TORCH_SELECTIVE_RECOMPUTE_MESSAGE}"


def test_the_spec_setting_reaches_the_trainer_config():
    from pathlib import Path

    from rlkube_runtime.spec import load_rljob

    job = load_rljob(Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml")
    assert TrainerConfig.from_spec(job.spec, hf_checkpoint="x").recompute == "none"
    full = job.spec.model_copy(update={"parallelism": job.spec.parallelism.model_copy(update={"recompute": "full"})})
    assert TrainerConfig.from_spec(full, hf_checkpoint="x").recompute == "full"
    with pytest.raises(ValueError, match="parallelism.recompute must be one of"):
        TrainerConfig(model=ModelConfig(hf_checkpoint="x"), recompute="some")

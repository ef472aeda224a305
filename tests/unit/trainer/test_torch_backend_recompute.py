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
    old = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in backend.log_probs(batch).log_probs]
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


def _ddp_steps(checkpoint: str, recompute: str) -> dict[str, torch.Tensor]:
    """Two optimizer steps on 2-sample global batches, then one on a single sample (one rank idle)."""
    backend = _backend(checkpoint, recompute)
    batch = random_batch(LENGTHS)
    old = backend.log_probs(batch).log_probs
    batch = batch.with_fields(old_log_probs=[lp + 0.3 * torch.sin(torch.arange(lp.numel())) for lp in old])
    for step in [*batch.global_batches(2), batch.select([1])]:
        backend.train_step(step)
    return backend.export_weights()


def _ddp_worker(rank: int, init_file: str, checkpoint: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        weights = _ddp_steps(checkpoint, "full")
        if rank == 0:
            torch.save(weights, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_full_recompute_under_ddp_trains_like_one_process_without_it(tiny_checkpoint, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "ddp.pt"
    mp.spawn(_ddp_worker, args=(str(tmp_path / "init"), str(tiny_checkpoint), str(out)), nprocs=2, join=True)
    two_ranks = torch.load(out, weights_only=True)
    one_process = _ddp_steps(str(tiny_checkpoint), "none")
    initial = _backend(tiny_checkpoint, "none").export_weights()
    for name, weight in one_process.items():
        assert (two_ranks[name] - weight).abs().max().item() < 1e-5, name
    assert any(not torch.equal(weight, initial[name]) for name, weight in one_process.items())

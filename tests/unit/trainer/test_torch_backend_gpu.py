"""The CUDA path: bf16 autocast over fp32 master weights, and memory really given back."""

from __future__ import annotations

import pytest
import torch
from rlkube_runtime.trainer.config import (
    BatchingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from rlkube_runtime.trainer.torch_backend import TorchBackend
from trainer_testutil import random_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (7, 3), (12, 1)]


def make_backend(checkpoint, device, dtype="bfloat16"):
    return TorchBackend(
        TrainerConfig(
            model=ModelConfig(hf_checkpoint=str(checkpoint), dtype=dtype),
            optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0),
            batching=BatchingConfig(max_tokens_per_gpu=21),
            loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1),
        ),
        device=device,
    )


def test_bf16_autocast_keeps_fp32_master_weights_and_matches_cpu(tiny_checkpoint):
    batch = random_batch(LENGTHS)
    cpu = make_backend(tiny_checkpoint, "cpu").log_probs(batch).log_probs
    gpu_backend = make_backend(tiny_checkpoint, "cuda")
    assert gpu_backend.compute_dtype == torch.bfloat16
    gpu = gpu_backend.log_probs(batch).log_probs
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cpu" and b.dtype == torch.float32
        assert (a - b).abs().max().item() < 0.1  # bf16 rounding, not a different computation
    batch = batch.with_fields(old_log_probs=gpu, ref_log_probs=gpu)
    metrics = gpu_backend.train_step(batch)
    assert metrics["grad_norm"] > 0
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in gpu_backend.model.parameters())


def test_release_memory_moves_weights_and_moments_off_the_gpu(tiny_checkpoint):
    batch = random_batch(LENGTHS)
    twin = make_backend(tiny_checkpoint, "cuda", dtype="float32")
    backend = make_backend(tiny_checkpoint, "cuda", dtype="float32")
    for b in (twin, backend):
        lp = b.log_probs(batch).log_probs
        b.train_step(batch.with_fields(old_log_probs=lp, ref_log_probs=lp))
    batch = batch.with_fields(old_log_probs=lp, ref_log_probs=lp)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    param_bytes = sum(p.numel() * 4 for p in backend.model.parameters())

    backend.release()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    # Actor + reference weights and two Adam moments: at least 4 model sizes leave the GPU.
    assert before - after >= 4 * param_bytes
    assert all(p.device.type == "cpu" for p in backend.model.parameters())

    backend.restore()
    assert all(p.device.type == "cuda" for p in backend.model.parameters())
    # GPU kernels may add in a different order run to run, so "identical" is up to rounding.
    metrics, expected = backend.train_step(batch), twin.train_step(batch)
    assert metrics == pytest.approx(expected, rel=1e-5, abs=1e-7)
    for name, value in backend.export_weights().items():
        assert torch.allclose(value, twin.export_weights()[name], atol=1e-5), name


def test_full_recompute_keeps_the_gradients_and_cuts_activation_memory(tmp_path):
    """spec.parallelism.recompute: full on a GPU: the same gradients (up to bf16 kernel rounding)
    and a training forward that keeps far less than every layer's activations."""
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "deep", hidden_size=256, num_layers=8, num_heads=4)
    batch = random_batch([(1024, 512)] * 4, vocab=(8, 60))
    results = {}
    for recompute in ("none", "full"):
        backend = TorchBackend(
            TrainerConfig(
                model=ModelConfig(hf_checkpoint=str(checkpoint)),
                batching=BatchingConfig(max_tokens_per_gpu=4096),  # one micro-batch of 4 x 1024 tokens
                recompute=recompute,
            ),
            device="cuda",
        )
        lp = backend.log_probs(batch).log_probs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        backend.accumulate_gradients(batch.with_fields(old_log_probs=lp))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = {n: p.grad.float().cpu() for n, p in backend.model.named_parameters()}
        results[recompute] = (peak, grads)
        del backend
        torch.cuda.empty_cache()
    (plain_peak, plain), (full_peak, full) = results["none"], results["full"]
    print(f"training-step peak above the weights: none {plain_peak / 2**20:.1f} MiB, full {full_peak / 2**20:.1f} MiB")
    assert full_peak < 0.5 * plain_peak
    for name, grad in plain.items():
        assert torch.allclose(full[name], grad, rtol=1e-2, atol=1e-5), name

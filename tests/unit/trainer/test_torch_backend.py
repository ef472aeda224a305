"""TorchBackend on a tiny real Qwen2: log-probs, exact losses, learning, checkpoints, memory hooks."""

from __future__ import annotations

import pytest
import torch
from rlkube_runtime.trainer.backend import TrainerBackend
from rlkube_runtime.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
from rlkube_runtime.trainer.config import (
    BatchingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from rlkube_runtime.trainer.torch_backend import TorchBackend
from trainer_testutil import random_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (7, 3), (12, 1)]


def make_backend(checkpoint, *, batching=None, loss=None, optimizer=None, temperature=1.0, **model):
    return TorchBackend(
        TrainerConfig(
            model=ModelConfig(hf_checkpoint=str(checkpoint), **model),
            optimizer=optimizer or OptimizerConfig(lr=1e-3, clip_grad=0.0),
            batching=batching or BatchingConfig(max_tokens_per_gpu=30),
            loss=loss or LossConfig(),
            temperature=temperature,
        )
    )


def with_old_log_probs(backend, batch, *, noise=0.0, seed=1):
    """old_log_probs from the actor, optionally shifted so the PPO ratio and its clipping engage."""
    g = torch.Generator().manual_seed(seed)
    old = [lp + noise * torch.randn(lp.shape, generator=g) for lp in backend.log_probs(batch).log_probs]
    return batch.with_fields(old_log_probs=old)


def test_backend_satisfies_the_interface(tiny_checkpoint):
    assert isinstance(make_backend(tiny_checkpoint), TrainerBackend)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_log_probs_and_entropy_equal_an_unpacked_forward_at_the_temperature(tiny_checkpoint, attn_implementation):
    backend = make_backend(tiny_checkpoint, temperature=0.7, attn_implementation=attn_implementation)
    batch = random_batch(LENGTHS)
    out = backend.log_probs(batch, with_entropy=True)

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    for tokens, r, logp, ent in zip(batch.tokens, batch.response_lengths, out.log_probs, out.entropy):
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0]
        # Position t predicts token t+1: the response (last r tokens) comes from positions L-r-1 .. L-2.
        scaled = torch.log_softmax(logits[-r - 1 : -1] / 0.7, dim=-1)
        expected = scaled.gather(-1, tokens[-r:, None])[:, 0]
        assert logp.shape == (r,) and logp.dtype == torch.float32
        assert (logp - expected).abs().max().item() < 1e-5
        assert (ent - (-(scaled.exp() * scaled).sum(-1))).abs().max().item() < 1e-5


def test_log_probs_do_not_depend_on_packing(tiny_checkpoint):
    batch = random_batch(LENGTHS)
    results = [
        make_backend(tiny_checkpoint, batching=b).log_probs(batch).log_probs
        for b in (
            BatchingConfig(max_tokens_per_gpu=1000),
            BatchingConfig(max_tokens_per_gpu=21),
            BatchingConfig(dynamic_batch_size=False, micro_batch_size=1),
        )
    ]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a - b).abs().max().item() < 1e-5


PACKINGS = [
    BatchingConfig(max_tokens_per_gpu=1000),  # everything in one row
    BatchingConfig(max_tokens_per_gpu=21),  # micro-batches {20}, {14}, {12}, {9, 7}, {5}
    BatchingConfig(max_tokens_per_gpu=5),  # every sample alone (most exceed the limit)
    BatchingConfig(dynamic_batch_size=False, micro_batch_size=4),
]


@pytest.mark.parametrize("per_token_loss", [False, True])
def test_loss_and_gradients_are_the_same_for_every_packing(tiny_checkpoint, per_token_loss):
    loss = LossConfig(
        per_token_loss=per_token_loss, eps_clip=0.1, use_kl_loss=True, kl_loss_coef=0.3, entropy_coef=0.01
    )
    batch = random_batch(LENGTHS)
    runs = []
    for batching in PACKINGS:
        backend = make_backend(tiny_checkpoint, batching=batching, loss=loss)
        b = with_old_log_probs(backend, batch, noise=0.3)
        b = b.with_fields(ref_log_probs=[lp - 0.1 for lp in b.old_log_probs])
        metrics = backend.accumulate_gradients(b)
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
        runs.append((metrics, grads))
    assert [m["num_micro_batches"] for m, _ in runs] == [1.0, 5.0, 6.0, 2.0]
    base_metrics, base_grads = runs[0]
    assert base_metrics["pg_clipfrac"] > 0  # the noisy old log-probs make clipping matter
    for metrics, grads in runs[1:]:
        for key in ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac"):
            assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-7)
        for name, g in grads.items():
            assert torch.allclose(g, base_grads[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("per_token_loss", [False, True])
def test_loss_at_ratio_one_is_minus_the_mean_advantage(tiny_checkpoint, per_token_loss):
    # With old = current log-probs the ratio is 1, so the PPO loss of a token is -A.
    advantages = [1.0, -2.0, 0.5, 3.0, -1.0, 2.0]
    batch = random_batch(LENGTHS, advantages=advantages)
    backend = make_backend(tiny_checkpoint, loss=LossConfig(per_token_loss=per_token_loss))
    metrics = backend.accumulate_gradients(with_old_log_probs(backend, batch))
    tokens = [float(m.sum()) for m in batch.loss_masks]  # last response token masked: r-1 each (1 for r=1)
    if per_token_loss:
        expected = -sum(a * n for a, n in zip(advantages, tokens)) / sum(tokens)
    else:
        expected = -sum(advantages) / len(advantages)
    assert metrics["pg_loss"] == pytest.approx(expected, abs=1e-6)


def test_a_training_step_raises_the_rewarded_sample_and_moves_every_parameter(tiny_checkpoint):
    backend = make_backend(tiny_checkpoint, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0))
    batch = random_batch([(12, 6), (12, 6)], advantages=[1.0, -1.0], masked_tail=False)
    batch = with_old_log_probs(backend, batch)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}

    metrics = backend.train_step(batch)

    after = backend.log_probs(batch).log_probs
    assert after[0].sum() > batch.old_log_probs[0].sum() + 0.1
    assert after[1].sum() < batch.old_log_probs[1].sum() - 0.1
    unmoved = [n for n, p in backend.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unmoved == []
    assert metrics["lr"] == 1e-2 and metrics["grad_norm"] > 0 and metrics["skipped_step"] == 0.0


def test_grad_clipping_reports_the_norm_before_clipping(tiny_checkpoint):
    optimizer = OptimizerConfig(lr=1e-3, clip_grad=1e-3, beta1=0.9)
    batch = random_batch(LENGTHS)
    probe = make_backend(tiny_checkpoint, optimizer=optimizer)
    probe.accumulate_gradients(with_old_log_probs(probe, batch))
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.model.parameters()])).item()

    backend = make_backend(tiny_checkpoint, optimizer=optimizer)
    metrics = backend.train_step(with_old_log_probs(backend, batch))

    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > 100 * 1e-3
    # Adam's first moment after one step is (1 - beta1) * the clipped gradient: its norm shows the clip.
    moments = [backend.optimizer.state[p]["exp_avg"] for p in backend.model.parameters()]
    clipped = torch.linalg.vector_norm(torch.stack([m.norm() for m in moments])).item() / (1 - 0.9)
    assert clipped == pytest.approx(1e-3, rel=1e-4)


def test_checkpoint_round_trip_makes_the_next_step_identical(tiny_checkpoint_with_dropout, tmp_path):
    # Dropout makes the step depend on the RNG, so restoring it is tested too.
    optimizer = OptimizerConfig(lr=1e-2, lr_decay_style="cosine", warmup_steps=1, decay_steps=4, clip_grad=1.0)
    batch = random_batch(LENGTHS)
    first = make_backend(tiny_checkpoint_with_dropout, optimizer=optimizer)
    batch = with_old_log_probs(first, batch)
    first.train_step(batch)
    save_checkpoint(tmp_path, 1, {"trainer": first.state_dict(), "data_source": {"offset": 6}})
    expected_metrics = first.train_step(batch)
    expected = first.export_weights()

    second = make_backend(tiny_checkpoint_with_dropout, optimizer=optimizer)
    torch.rand(100)  # a different RNG position than at the save
    checkpoint = load_latest_checkpoint(tmp_path)
    second.load_state_dict(checkpoint.payload["trainer"])
    metrics = second.train_step(batch)

    assert metrics == expected_metrics
    for name, value in second.export_weights().items():
        assert torch.equal(value, expected[name]), name


def test_checkpoint_round_trip_needs_the_rng(tiny_checkpoint_with_dropout, tmp_path):
    # The control for the test above: without the RNG state the dropout masks differ.
    batch = random_batch(LENGTHS)
    first = make_backend(tiny_checkpoint_with_dropout)
    batch = with_old_log_probs(first, batch)
    state = first.state_dict()
    expected = first.train_step(batch)
    second = make_backend(tiny_checkpoint_with_dropout)
    state["rng"] = second.state_dict()["rng"]
    torch.rand(100)
    second.load_state_dict(state)
    torch.rand(1)
    assert second.train_step(batch)["loss"] != expected["loss"]


def test_exported_weights_load_strictly_into_a_fresh_model(tiny_checkpoint):
    backend = make_backend(tiny_checkpoint)
    backend.train_step(with_old_log_probs(backend, random_batch(LENGTHS)))
    weights = backend.export_weights()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in weights.values())

    fresh = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    fresh.load_state_dict(weights, strict=True)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, dict(backend.model.named_parameters())[name])
    # A copy: training further does not change what was exported.
    some_key = next(iter(weights))
    snapshot = weights[some_key].clone()
    backend.train_step(with_old_log_probs(backend, random_batch(LENGTHS)))
    assert torch.equal(weights[some_key], snapshot)


def test_save_hf_writes_a_directory_transformers_loads(tiny_checkpoint, tmp_path):
    backend = make_backend(tiny_checkpoint)
    backend.train_step(with_old_log_probs(backend, random_batch(LENGTHS)))
    out = backend.save_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("ab")["input_ids"] == AutoTokenizer.from_pretrained(tiny_checkpoint)("ab")["input_ids"]
    ids = torch.tensor([[9, 10, 11, 12]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, backend.model.eval()(input_ids=ids).logits, atol=1e-6)


def test_release_memory_frees_gradients_and_resume_continues_identically(tiny_checkpoint):
    batch = random_batch(LENGTHS)
    twin = make_backend(tiny_checkpoint)
    expected = twin.train_step(with_old_log_probs(twin, batch))

    backend = make_backend(tiny_checkpoint)
    batch = with_old_log_probs(backend, batch)
    backend.accumulate_gradients(batch)
    assert all(p.grad is not None for p in backend.model.parameters())
    backend.release()
    assert backend.memory_released
    assert all(p.grad is None for p in backend.model.parameters())
    with pytest.raises(RuntimeError, match="call restore"):
        backend.log_probs(batch)
    backend.restore()
    assert backend.train_step(batch) == expected
    for name, value in backend.export_weights().items():
        assert torch.equal(value, twin.export_weights()[name])


def test_reference_model_stays_at_the_initial_weights(tiny_checkpoint):
    backend = make_backend(tiny_checkpoint, loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    batch = random_batch(LENGTHS)
    initial = backend.log_probs(batch, model="ref").log_probs
    batch = with_old_log_probs(backend, batch).with_fields(ref_log_probs=initial)
    metrics = backend.train_step(batch)
    assert metrics["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    for a, b in zip(initial, backend.log_probs(batch, model="ref").log_probs):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(initial, backend.log_probs(batch).log_probs))


def test_tis_uses_the_engine_log_probs(tiny_checkpoint):
    backend = make_backend(tiny_checkpoint, loss=LossConfig(use_tis=True, tis_clip=2.0))
    batch = with_old_log_probs(backend, random_batch(LENGTHS))
    batch = batch.with_fields(rollout_log_probs=[lp + 0.05 for lp in batch.old_log_probs])
    metrics = backend.train_step(batch)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.05, abs=1e-6)
    assert metrics["tis"] == pytest.approx(torch.tensor(-0.05).exp().item(), rel=1e-5)


def test_missing_inputs_are_named(tiny_checkpoint):
    backend = make_backend(tiny_checkpoint, loss=LossConfig(use_kl_loss=True))
    batch = random_batch(LENGTHS)
    with pytest.raises(ValueError, match="TrainBatch.old_log_probs, which is None"):
        backend.train_step(batch)
    with pytest.raises(ValueError, match="TrainBatch.ref_log_probs, which is None"):
        backend.train_step(with_old_log_probs(backend, batch))
    with pytest.raises(ValueError, match="model='ref'\\) needs a reference model"):
        make_backend(tiny_checkpoint).log_probs(batch, model="ref")


def test_lr_follows_the_schedule_across_steps(tiny_checkpoint):
    optimizer = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=4, lr_decay_style="linear")
    backend = make_backend(tiny_checkpoint, optimizer=optimizer)
    batch = with_old_log_probs(backend, random_batch(LENGTHS[:2]))
    lrs = [backend.train_step(batch)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])

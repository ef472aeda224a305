"""MegatronBackend on CPU (gloo, use_cpu_initialization, local layer spec, one rank): the same
logits as the HF model, the same loss as TorchBackend, and an exact checkpoint round trip.

On CPU the backend steps torch AdamW: megatron-core's DistributedDataParallel and distributed
optimizer allocate CUDA buffers. Those, bf16 and tensor parallelism are covered by the GPU tests
(test_megatron_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import tiny_hf
from trainer_testutil import random_batch

from rlkube_runtime.trainer.backend import TrainerBackend
from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.megatron.backend import MegatronBackend
from rlkube_runtime.trainer.megatron.cpu import cpu_mode
from rlkube_runtime.trainer.megatron.weights import read_hf_tensors
from rlkube_runtime.trainer.torch_backend import TorchBackend

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (7, 3), (12, 1)]


def config(path, **loss) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(hf_checkpoint=str(path)),
        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.1),
        batching=BatchingConfig(max_tokens_per_gpu=30),
        loss=LossConfig(**loss),
    )


def with_old(backend, batch, noise=0.3):
    g = torch.Generator().manual_seed(1)
    old = [lp + noise * torch.randn(lp.shape, generator=g) for lp in backend.log_probs(batch).log_probs]
    return batch.with_fields(old_log_probs=old)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3") / "m")


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_logits_match_the_hf_model(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_hf(kind, tmp_path / kind)
    backend = MegatronBackend(config(path), device="cpu")
    assert isinstance(backend, TrainerBackend)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(17, 17, dtype=torch.bool), 1)[None, None]
    with cpu_mode(), torch.no_grad():
        got = backend.model(ids, torch.arange(17).expand(3, 17), mask)
        want = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    exported = backend.export_weights()
    checkpoint = read_hf_tensors(path)  # the checkpoint's names: per-expert ones for MoE
    assert set(exported) - {"lm_head.weight"} == set(checkpoint) - {"lm_head.weight"}
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("loss", [dict(), dict(per_token_loss=True, entropy_coef=0.01)])
def test_train_step_equals_the_torch_backend(qwen3, loss):
    torch.manual_seed(0)
    batch = random_batch(LENGTHS, vocab=(8, 120))
    mega = MegatronBackend(config(qwen3, **loss), device="cpu")
    ref = TorchBackend(config(qwen3, **loss), device="cpu")
    mb, tb = with_old(mega, batch), with_old(ref, batch)
    for a, b in zip(mb.old_log_probs, tb.old_log_probs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    got, want = mega.train_step(mb), ref.train_step(tb)
    for key in ("loss", "pg_loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["num_micro_batches"] == want["num_micro_batches"] > 1
    after_m, after_t = mega.export_weights(), ref.export_weights()
    for name, tensor in after_t.items():
        # Adam's first update is lr * g / (|g| + eps): where g is ~eps, float noise in g moves
        # the update by a fraction of lr (1e-3), so the bound is a small fraction of lr.
        diff = (after_m[name] - tensor).abs()
        assert diff.max() < 5e-5 and diff.mean() < 1e-7, (name, diff.max(), diff.mean())
    # A second step (Adam moments in play) still agrees, and the loss moved.
    got2, want2 = mega.train_step(mb), ref.train_step(tb)
    assert got2["loss"] == pytest.approx(want2["loss"], rel=1e-4, abs=1e-6)
    assert got2["loss"] != pytest.approx(got["loss"], rel=1e-6)


def test_a_mixture_of_experts_step_equals_the_torch_backends(tmp_path):
    """Qwen3-MoE (8 experts, top 2): megatron-core's MoE layer routes and weighs tokens as HF's
    block does, so the loss, the gradient norm and the next step's loss (after every expert's
    and the router's update) are the torch backend's."""
    moe = tiny_hf("qwen3_moe", tmp_path / "moe")
    torch.manual_seed(0)
    batch = random_batch(LENGTHS, vocab=(8, 120))
    mega = MegatronBackend(config(moe), device="cpu")
    ref = TorchBackend(config(moe), device="cpu")
    mb, tb = with_old(mega, batch), with_old(ref, batch)
    for a, b in zip(mb.old_log_probs, tb.old_log_probs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    got, want = mega.train_step(mb), ref.train_step(tb)
    for key in ("loss", "pg_loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    got2, want2 = mega.train_step(mb), ref.train_step(tb)
    assert got2["loss"] == pytest.approx(want2["loss"], rel=1e-4, abs=1e-6)
    assert got2["loss"] != pytest.approx(got["loss"], rel=1e-6)
    router = mega.export_weights()["model.layers.0.mlp.gate.weight"]
    assert not torch.equal(router, read_hf_tensors(moe)["model.layers.0.mlp.gate.weight"])  # the router learns


def test_save_then_load_gives_the_identical_next_step(qwen3, tmp_path):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    first = MegatronBackend(config(qwen3), device="cpu")
    b = with_old(first, batch)
    first.train_step(b)
    first.save_distributed(tmp_path / "ckpt")
    expected = first.train_step(b)
    expected_weights = first.export_weights()

    second = MegatronBackend(config(qwen3), device="cpu")
    fresh = second.train_step(b)  # a step from the initial weights differs: the load must matter
    assert fresh["loss"] != pytest.approx(expected["loss"], rel=1e-6)
    second.load_distributed(tmp_path / "ckpt")
    got = second.train_step(b)
    assert got == expected
    for name, tensor in expected_weights.items():
        assert torch.equal(second.export_weights()[name], tensor), name


@pytest.mark.parametrize(("recompute", "module"), [("full", "mlp"), ("selective", "self_attention.core_attention")])
def test_recompute_runs_the_forward_again_and_changes_nothing(qwen3, recompute, module):
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    batch = random_batch(LENGTHS, vocab=(8, 120))
    plain = MegatronBackend(config(qwen3), device="cpu")
    b = with_old(plain, batch)
    want = plain.train_step(b)
    again = MegatronBackend(config(qwen3), ParallelSizes(recompute=recompute), device="cpu")
    calls = []
    again.model.decoder.layers[0].get_submodule(module).register_forward_hook(lambda *_: calls.append(1))
    got = again.train_step(b)
    assert got["loss"] == want["loss"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert len(calls) == 2 * got["num_micro_batches"]  # once forward, once more in the backward


def test_megatron_args_reach_the_transformer_config_and_gpu_only_ones_are_refused_on_cpu(qwen3):
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    backend = MegatronBackend(config(qwen3), ParallelSizes(recompute="full"),
                              megatron_args={"recompute-num-layers": 2}, device="cpu")
    assert backend.tconfig.recompute_num_layers == 2
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.use-precision-aware-optimizer: .*GPUs only"):
        MegatronBackend(config(qwen3), megatron_args={"use-precision-aware-optimizer": True}, device="cpu")


def test_the_kl_loss_reads_a_frozen_reference_like_the_torch_backend(qwen3):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    kl = dict(use_kl_loss=True, kl_loss_coef=0.1)
    mega, ref = MegatronBackend(config(qwen3, **kl), device="cpu"), TorchBackend(config(qwen3, **kl), device="cpu")
    b = with_old(mega, batch)
    assert mega.log_probs(b, model="ref").log_probs[0].equal(mega.log_probs(b).log_probs[0])
    mega.train_step(b.with_fields(ref_log_probs=mega.log_probs(b, model="ref").log_probs))
    # The actor moved, the reference did not: the second step has a KL term, equal in both backends.
    tb = with_old(ref, batch)
    ref.train_step(tb.with_fields(ref_log_probs=ref.log_probs(tb, model="ref").log_probs))
    got = mega.train_step(b.with_fields(ref_log_probs=mega.log_probs(b, model="ref").log_probs))
    want = ref.train_step(tb.with_fields(ref_log_probs=ref.log_probs(tb, model="ref").log_probs))
    assert got["kl_loss"] > 0
    assert got["kl_loss"] == pytest.approx(want["kl_loss"], rel=1e-3)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


def test_cpu_mode_is_undone_after_each_call(qwen3):
    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    backend = MegatronBackend(config(qwen3), device="cpu")
    backend.log_probs(random_batch(LENGTHS[:2], vocab=(8, 120)))
    assert torch.cuda.current_device is current_device and torch.cuda.synchronize is synchronize


def _last_router_grad(backend, batch, *, with_empty_micro_batch=False):
    """One accumulate_gradients call: the last layer's router-weight gradient and weight, every
    layer's router weight and its input in each micro-batch (the hand computation's data), and the
    call's metrics. With `with_empty_micro_batch`, a zero-weight micro-batch is added to the
    rank's share, as expert ranks are evened."""
    routers = [layer.mlp.router for layer in backend.model.decoder.layers]
    inputs = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda module, args, out, seen=seen: seen.append(args[0].detach().clone()))
             for router, seen in zip(routers, inputs)]
    if with_empty_micro_batch:
        plain = backend._rank_micro_batches
        backend._rank_micro_batches = lambda b: (lambda micro, plan: (
            micro + [backend._zero_weight_micro_batch(b)], plan))(*plain(b))
    try:
        metrics = backend.accumulate_gradients(batch)
    finally:
        for hook in hooks:
            hook.remove()
        backend.__dict__.pop("_rank_micro_batches", None)
    if with_empty_micro_batch:
        inputs = [seen[:-1] for seen in inputs]  # the empty one's, which must count for nothing
    weights = [router.weight.detach().clone() for router in routers]
    return routers[-1].weight.grad.detach().clone(), weights, inputs, metrics


def _switch_aux_loss(logits, coeff, topk):
    """Switch Transformer's balance loss, E * sum_i f_i * P_i, written out."""
    probs = torch.softmax(logits, dim=-1)
    experts = logits.shape[-1]
    routed = torch.zeros_like(probs).scatter(1, logits.topk(topk, dim=-1).indices, 1.0)
    f = routed.sum(0) / (logits.shape[0] * topk)
    return coeff * experts * (f * probs.mean(0)).sum()


def _z_loss(logits, coeff):
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


@pytest.mark.parametrize("key", ["moe-aux-loss-coeff", "moe-z-loss-coeff"])
def test_a_load_balancing_loss_adds_its_hand_computed_gradient_over_the_micro_batches_and_nothing_for_an_empty_one(tmp_path, key):
    """megatronArgs' MoE loss reaches the router: the last router's gradient grows by the gradient
    of the loss written out here (each micro-batch's share over the micro-batch count, as
    megatron-core's schedule weighs it), and a zero-weight micro-batch (expert ranks evened) adds
    nothing, where megatron-core's own scale would have counted it. The step reports the loss."""
    moe = tiny_hf("qwen3_moe", tmp_path / "moe")
    batch = with_old(MegatronBackend(config(moe), device="cpu"), random_batch(LENGTHS, vocab=(8, 120)))
    coeff = 0.3
    base, _, _, plain_metrics = _last_router_grad(MegatronBackend(config(moe), device="cpu"), batch)
    assert not any(name.startswith("moe_") for name in plain_metrics)  # no loss on, none reported
    with_loss = MegatronBackend(config(moe), megatron_args={key: coeff}, device="cpu")
    got, weights, inputs, metrics = _last_router_grad(with_loss, batch)
    again, _, _, again_metrics = _last_router_grad(with_loss, batch, with_empty_micro_batch=True)
    assert len(inputs[-1]) > 1  # several micro-batches: the count matters

    def loss(x, w):
        logits = x.reshape(-1, x.shape[-1]) @ w.T
        if key == "moe-aux-loss-coeff":
            return _switch_aux_loss(logits, coeff, with_loss.tconfig.moe_router_topk)
        return _z_loss(logits, coeff)

    w = weights[-1].clone().requires_grad_(True)
    per_micro = [loss(x, w) for x in inputs[-1]]
    (want,) = torch.autograd.grad(sum(per_micro) / len(per_micro), w)
    assert want.abs().max() > 1e-4  # the loss has a gradient worth checking
    torch.testing.assert_close(got - base, want, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(again, got, rtol=0, atol=1e-7)

    # Reported unscaled, the mean over layers and micro-batches; the empty micro-batch not in it.
    name = "moe_load_balancing_loss" if key == "moe-aux-loss-coeff" else "moe_z_loss"
    by_hand = [float(loss(x, w_layer)) / coeff for w_layer, seen in zip(weights, inputs) for x in seen]
    assert metrics[name] == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-5)
    assert again_metrics[name] == pytest.approx(metrics[name], rel=1e-6)
    if key == "moe-aux-loss-coeff":
        assert with_loss.tconfig.moe_router_load_balancing_type == "aux_loss"  # the coefficient alone asks for it


def test_a_load_balancing_loss_on_a_dense_model_is_refused_naming_the_key(qwen3):
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.moe_z_loss_coeff: a mixture-of-experts loss.*no experts"):
        MegatronBackend(config(qwen3), megatron_args={"moe-z-loss-coeff": 0.001}, device="cpu")


def test_moe_losses_off_zeroes_the_scale_the_pipeline_schedule_sets_and_then_gives_the_setter_back():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from rlkube_runtime.trainer.megatron.backend import moe_losses_off

    with moe_losses_off():
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))  # what the schedule would do
        assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 0.0
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 0.25
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # as a fresh process has it

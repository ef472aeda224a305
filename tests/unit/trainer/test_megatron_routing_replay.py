"""Rollout routing replay on the megatron backend (CPU, one rank): the actor's routers take the
experts a batch carries, checked against transformers' Qwen3-MoE forced onto the same experts
(an implementation that shares nothing with megatron-core's router), and training moves only the
experts the routes name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron_testutil import tiny_hf
from trainer_testutil import random_batch

from rlkube_runtime.actors.trainer import sample_routes
from rlkube_runtime.data.sample import Sample
from rlkube_runtime.routed_experts import encode_routes
from rlkube_runtime.trainer.config import BatchingConfig, LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.megatron.backend import MegatronBackend
from rlkube_runtime.trainer.megatron.routing_replay import replay_targets
from rlkube_runtime.trainer.torch_backend import TorchBackend

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (7, 3), (12, 1)]
EXPERTS, TOP_K = 8, 2


def config(path, *, routing_replay=True, **loss) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(hf_checkpoint=str(path)), optimizer=OptimizerConfig(lr=1e-3),
                         batching=BatchingConfig(max_tokens_per_gpu=30), loss=LossConfig(**loss),
                         routing_replay=routing_replay)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return tiny_hf("qwen3_moe", tmp_path_factory.mktemp("moe") / "m")


def hf_forward(path, batch, forced=None):
    """transformers' own model on each sample: (the routes its routers picked for every token but
    the last, the log-probs of the response tokens). `forced`: per sample, the [L - 1, layers, k]
    experts its routers must take instead (weighted by the softmax of their logits, as
    norm_topk_prob does); the last token gets experts 0..k-1, as the replay pads it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in hf.model.layers]
    routes, log_probs = [], []
    for i, tokens in enumerate(batch.tokens):
        picked = [None] * len(gates)
        if forced is not None:
            last = torch.arange(TOP_K).expand(1, len(gates), TOP_K)
            given = torch.cat([forced[i], last])
            for layer, gate in enumerate(gates):
                def forward(hidden, gate=gate, layer=layer):
                    logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                    index = given[:, layer]
                    return logits, torch.softmax(logits.gather(1, index), dim=-1), index
                gate.forward = forward
        hooks = [gate.register_forward_hook(lambda m, a, out, layer=layer: picked.__setitem__(layer, out[2]))
                 for layer, gate in enumerate(gates)]
        with torch.no_grad():
            logits = hf(tokens[None]).logits[0]
        for hook in hooks:
            hook.remove()
        routes.append(torch.stack(picked, dim=1)[:-1].long())
        r = batch.response_lengths[i]
        log_probs.append(torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0][-r:])
    return routes, log_probs


def test_replay_targets_lay_each_layers_routes_out_position_major_and_split_along_the_sequence():
    # Two samples of 3 and 2 tokens (routes for 2 and 1), one layer, top 2, in rows of length 4.
    a = torch.tensor([[[5, 6]], [[7, 1]]])
    b = torch.tensor([[[3, 4]]])
    (whole,), real = replay_targets([a, b], 2, 4)
    pad = [0, 1]
    # Position-major: (pos 0: a, b), (pos 1: a, pad), (pos 2: pad, pad), (pos 3: pad, pad).
    assert whole.tolist() == [[5, 6], [3, 4], [7, 1], pad, pad, pad, pad, pad]
    assert real.tolist() == [True, True, True, False, False, False, False, False]
    halves = [replay_targets([a, b], 2, 4, tp_rank=r, tp_size=2, sequence_parallel=True) for r in (0, 1)]
    assert halves[0][0][0].tolist() == whole[:4].tolist() and halves[1][0][0].tolist() == whole[4:].tolist()
    assert halves[0][1].tolist() == real[:4].tolist() and halves[1][1].tolist() == real[4:].tolist()


def test_replayed_routes_give_the_log_probs_of_the_hf_model_routed_the_same_way(moe):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    natural, hf_natural = hf_forward(moe, batch)
    plain = MegatronBackend(config(moe, routing_replay=False), device="cpu").log_probs(batch).log_probs
    replaying = MegatronBackend(config(moe, use_kl_loss=True, kl_loss_coef=0.1), device="cpu")
    # The routes the model picks itself: replaying them changes nothing.
    own = replaying.log_probs(batch.with_fields(routed_experts=natural)).log_probs
    for got, want, hf in zip(own, plain, hf_natural):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got, hf, rtol=0, atol=2e-5)
    # Other experts: the HF model forced onto them gives the same log-probs, unlike its own routing.
    shifted = [(r + 3) % EXPERTS for r in natural]
    _, hf_shifted = hf_forward(moe, batch, forced=shifted)
    replayed = batch.with_fields(routed_experts=shifted)
    got = replaying.log_probs(replayed).log_probs
    for g, want, own_routing in zip(got, hf_shifted, plain):
        torch.testing.assert_close(g, want, rtol=0, atol=2e-5)
    assert max(float((g - p).abs().max()) for g, p in zip(got, plain)) > 1e-3
    # The reference model routes for itself.
    for g, want in zip(replaying.log_probs(replayed, model="ref").log_probs, plain):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-5)
    # Once a pass is over, no router is left replaying.
    assert all(r.router_replay_action is None and r.target_topk_idx is None for r in replaying._route_replay.routers)


def _expert_grads(backend, batch, *, with_metrics=False):
    """Per layer, each local expert's gradient magnitude after one accumulate_gradients call
    (and the call's metrics)."""
    metrics = backend.accumulate_gradients(batch)
    norms = []
    for layer in backend.model.decoder.layers:
        experts = layer.mlp.experts.local_experts
        norms.append([0.0 if e.linear_fc1.weight.grad is None else float(e.linear_fc1.weight.grad.abs().sum())
                      for e in experts])
    return (norms, metrics) if with_metrics else norms


def test_a_step_under_replay_trains_exactly_the_experts_the_routes_name(moe):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    plain = MegatronBackend(config(moe, routing_replay=False), device="cpu")
    old = plain.log_probs(batch).log_probs
    batch = batch.with_fields(old_log_probs=[lp + 0.1 for lp in old])
    assert all(g > 0 for layer in _expert_grads(plain, batch) for g in layer)  # its own routing uses every expert
    # Every token of every layer routed to experts 1 and 4 (the padding goes to 0 and 1).
    only = [torch.tensor([1, 4]).expand(t.numel() - 1, 2, TOP_K).clone() for t in batch.tokens]
    replaying = MegatronBackend(config(moe), device="cpu")
    grads, metrics = _expert_grads(replaying, batch.with_fields(routed_experts=only), with_metrics=True)
    for layer in grads:
        assert layer[1] > 0 and layer[4] > 0
        # The padding's experts (0 and 1) serve positions no loss reads: no gradient from them.
        assert [g for e, g in enumerate(layer) if e not in (1, 4)] == [0.0] * (EXPERTS - 2)
    # The trainer's own routers would have chosen otherwise wherever HF's routing is not {1, 4}.
    natural, _ = hf_forward(moe, batch)
    routes = torch.cat(natural).sort(-1).values
    assert metrics["routing_replay_mismatch"] == pytest.approx(float((routes != torch.tensor([1, 4])).any(-1).float().mean()))
    assert 0.5 < metrics["routing_replay_mismatch"] < 1
    assert replaying.accumulate_gradients(batch.with_fields(routed_experts=natural))["routing_replay_mismatch"] == 0.0


def test_routing_replay_is_refused_by_name_where_it_cannot_run(moe, tmp_path):
    dense = tiny_hf("qwen3", tmp_path / "dense")
    with pytest.raises(ValueError, match=r"spec\.training\.routingReplay: .*no experts"):
        MegatronBackend(config(dense), device="cpu")
    with pytest.raises(ValueError, match=r"spec\.training\.routingReplay: .*torch backend"):
        TorchBackend(config(moe), device="cpu")
    batch = random_batch(LENGTHS[:2], vocab=(8, 120))
    with pytest.raises(ValueError, match=r"routingReplay is on, and the rollout's samples carry no routed experts"):
        MegatronBackend(config(moe), device="cpu").log_probs(batch)


def test_a_samples_routes_cover_its_tokens_and_an_untrained_tail_the_engine_never_saw_is_padded():
    # 3 prompt tokens and 4 response tokens: routes for the 6 tokens but the last, 2 layers, top 2.
    routes = torch.arange(6 * 2 * 2).reshape(6, 2, 2) % EXPERTS
    sample = Sample(index=7, group_index=1, tokens=list(range(7)), response_length=4, loss_mask=[1, 1, 0, 0],
                    routed_experts=encode_routes(routes))
    assert torch.equal(sample_routes(sample, 2, TOP_K), routes)
    # A tool's output of 2 tokens appended after the last generation: untrained, routes for 4 tokens suffice.
    sample.routed_experts = encode_routes(routes[:4])
    padded = sample_routes(sample, 2, TOP_K)
    assert torch.equal(padded[:4], routes[:4]) and padded[4:].tolist() == [[[0, 1], [0, 1]]] * 2
    sample.loss_mask = [1, 1, 1, 0]  # the token at position 5 trains, and its position's routes are missing
    with pytest.raises(ValueError, match=r"sample index=7 .*cover 4 tokens.*at least up to the last trained one \(5\)"):
        sample_routes(sample, 2, TOP_K)
    sample.routed_experts = None
    with pytest.raises(ValueError, match="routingReplay is on and the sample has no routed experts"):
        sample_routes(sample, 2, TOP_K)

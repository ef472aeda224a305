"""MoE weights in the weight sync: one name per expert, as checkpoints and SGLang name them, into
and out of transformers' fused experts parameters (rlkube_runtime/expert_names.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlkube_runtime.engine.protocol import ProtocolError
from rlkube_runtime.engine.weights import copy_into_model
from rlkube_runtime.expert_names import per_expert_views
from rlkube_runtime.memory import unique_named_tensors

EXPERTS, HIDDEN, EXPERT_FFN = 4, 16, 8


def tiny_moe(seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=EXPERT_FFN,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def test_fused_experts_become_the_checkpoints_per_expert_tensors(tmp_path):
    """The names and values a saved checkpoint holds: expert e's gate and up are rows [0, I) and
    [I, 2I) of gate_up_proj[e], its down projection down_proj[e]."""
    model = tiny_moe(0)
    views = dict(per_expert_views(unique_named_tensors(model)))
    model.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    assert sorted(views) == sorted(checkpoint)
    assert all(torch.equal(views[k], checkpoint[k]) for k in checkpoint)
    fused = model.model.layers[1].mlp.experts
    assert torch.equal(views["model.layers.1.mlp.experts.3.gate_proj.weight"], fused.gate_up_proj[3, :EXPERT_FFN])
    assert torch.equal(views["model.layers.1.mlp.experts.3.up_proj.weight"], fused.gate_up_proj[3, EXPERT_FFN:])
    assert torch.equal(views["model.layers.1.mlp.experts.3.down_proj.weight"], fused.down_proj[3])
    assert views["model.layers.0.mlp.experts.0.gate_proj.weight"].shape == (EXPERT_FFN, HIDDEN)


def test_the_engine_takes_per_expert_names_into_its_fused_experts_and_then_answers_like_the_trainer():
    trainer, engine = tiny_moe(0), tiny_moe(1)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(trainer(tokens).logits, engine(tokens).logits)
        sent = dict(per_expert_views(unique_named_tensors(trainer)))
        assert copy_into_model(engine, sent, field="serialized_named_tensors") == len(sent)
        assert torch.equal(trainer(tokens).logits, engine(tokens).logits)
    for (name, want), got in zip(trainer.state_dict().items(), engine.state_dict().values()):
        assert torch.equal(want, got), name


def test_a_wrong_expert_shape_is_refused_by_name_and_changes_nothing():
    engine = tiny_moe(1)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    bad = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(EXPERT_FFN, HIDDEN),
           "model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(EXPERT_FFN, HIDDEN)}
    with pytest.raises(ProtocolError, match=r"experts\.1\.down_proj\.weight' has shape \[8, 16\], the model expects \[16, 8\]"):
        copy_into_model(engine, bad, field="serialized_named_tensors")
    assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())


def test_per_expert_names_broadcast_over_a_weight_update_group_land_in_the_fused_experts():
    """/update_weights_from_distributed (separate placement) takes the same per-expert names as the
    in-memory transports: the trainer broadcasts them one by one, the engine receives them straight
    into its fused parameters' views."""
    import datetime
    import threading

    import torch.distributed as dist

    from rlkube_runtime.engine.protocol import DistributedUpdate, GroupSpec
    from rlkube_runtime.engine.weight_groups import open_group, receive_into_model

    trainer, engine = tiny_moe(0), tiny_moe(1)
    sent = dict(per_expert_views(unique_named_tensors(trainer)))
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    spec = GroupSpec("127.0.0.1", store.port, rank_offset=1, world_size=2, group_name="g", backend="gloo")
    update = DistributedUpdate(tuple(sent), tuple(t.dtype for t in sent.values()),
                               tuple(tuple(t.shape) for t in sent.values()), group_name="g", weight_version="1")
    received: list[int] = []
    receiver = threading.Thread(target=lambda: received.append(
        receive_into_model(engine, open_group(spec, torch.device("cpu"), "127.0.0.1"), update)))
    receiver.start()
    sender = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=30))
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for tensor in sent.values():
        sender.broadcast([tensor.detach().contiguous()], options).wait()
    receiver.join(timeout=60)
    assert received == [len(sent)]
    for (name, want), got in zip(trainer.state_dict().items(), engine.state_dict().values()):
        assert torch.equal(want, got), name

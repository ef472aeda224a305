"""HF <-> megatron-core conversion on tiny random Qwen3, Qwen2, Llama and Qwen3-MoE models (CPU)."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import tiny_hf

from rlkube_runtime.trainer.megatron import convert
from rlkube_runtime.trainer.megatron.model import ParallelSizes, check_divisible, hf_architecture, split_megatron_args
from rlkube_runtime.trainer.megatron.weights import read_hf_tensors


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_to_hf_is_bitwise_through_tensor_parallel_shards(kind, tp, tmp_path):
    from transformers import AutoConfig

    path = tiny_hf(kind, tmp_path / kind)
    arch = hf_architecture(AutoConfig.from_pretrained(path))
    hf = read_hf_tensors(path)  # the checkpoint's own names (per-expert ones for MoE)
    if arch.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    full = convert.hf_to_megatron(hf, arch)
    merged = {name: convert.tp_merge(name, [convert.tp_split(name, t, r, tp) for r in range(tp)])
              for name, t in full.items()}
    back = convert.megatron_to_hf(merged, arch)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # q/k/v go in whole query groups: each rank's linear_qkv rows are its own heads' rows.
    qkv = convert.tp_split("decoder.layers.0.self_attention.linear_qkv.weight",
                           full["decoder.layers.0.self_attention.linear_qkv.weight"], 0, 2)
    d = arch.head_dim
    assert torch.equal(qkv[: 2 * d], hf["model.layers.0.self_attn.q_proj.weight"][: 2 * d])
    assert torch.equal(qkv[2 * d: 3 * d], hf["model.layers.0.self_attn.k_proj.weight"][:d])


@pytest.mark.parametrize("tp", [1, 2])
def test_an_experts_weights_go_to_its_megatron_expert_split_like_the_dense_mlp(tp, tmp_path):
    from transformers import AutoConfig

    path = tiny_hf("qwen3_moe", tmp_path / "moe")
    arch = hf_architecture(AutoConfig.from_pretrained(path))
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_norm_topk) == (8, 2, 32, True)
    hf = read_hf_tensors(path)
    full = convert.hf_to_megatron(hf, arch)
    expert = "decoder.layers.1.mlp.experts.local_experts.5."
    gate, up = (hf[f"model.layers.1.mlp.experts.5.{x}_proj.weight"] for x in ("gate", "up"))
    down = hf["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert torch.equal(full[expert + "linear_fc1.weight"], torch.cat([gate, up]))
    assert torch.equal(full["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    rows = 32 // tp
    part = convert.tp_split(expert + "linear_fc1.weight", full[expert + "linear_fc1.weight"], tp - 1, tp)
    assert torch.equal(part, torch.cat([gate[-rows:], up[-rows:]]))  # this rank's gate rows, then its up rows
    part = convert.tp_split(expert + "linear_fc2.weight", full[expert + "linear_fc2.weight"], tp - 1, tp)
    assert torch.equal(part, down[:, -rows:])
    assert convert.tp_partition_dim("decoder.layers.1.mlp.router.weight") is None
    assert not any(".mlp.linear_fc" in name for name in full)  # no dense MLP in a sparse layer


def test_architecture_refusals_name_the_field(tmp_path):
    from transformers import AutoConfig

    arch = hf_architecture(AutoConfig.from_pretrained(tiny_hf("llama", tmp_path / "l")))
    with pytest.raises(ValueError, match=r"spec\.parallelism\.tensor: 8 does not divide the model's 4 attention heads"):
        check_divisible(arch, ParallelSizes(tensor=8))
    with pytest.raises(ValueError, match=r"spec\.parallelism\.pipeline: 4 does not divide"):
        check_divisible(arch, ParallelSizes(pipeline=4))
    gpt2 = AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match=r"model_type 'gpt2'"):
        hf_architecture(gpt2)


def test_megatron_args_map_onto_configs_and_unknown_keys_are_refused():
    model, optim = split_megatron_args({"attention-softmax-in-fp32": True, "bias-activation-fusion": False})
    assert model == {"attention_softmax_in_fp32": True} and optim == {}  # false: the flag left out
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.adam_beta1: set by spec\.training\.optimizer\.beta1"):
        split_megatron_args({"adam_beta1": 0.8})
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.no-such-flag: not a field of megatron-core"):
        split_megatron_args({"no-such-flag": 1})
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.num-layers: the architecture comes from"):
        split_megatron_args({"num-layers": 3})
    with pytest.raises(ValueError, match=r"spec\.model\.megatronArgs\.tensor-model-parallel-size: set by spec\.parallelism\.tensor"):
        split_megatron_args({"tensor-model-parallel-size": 2})
    _, optim = split_megatron_args({"use-precision-aware-optimizer": True})
    assert optim == {"use_precision_aware_optimizer": True}

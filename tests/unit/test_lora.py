"""rlkube_runtime/lora.py: merging a peft adapter into base weights, checked by hand."""

import pytest
import torch

from rlkube_runtime.lora import adapted_modules, merged_weights, scaling_of


def test_merging_adds_scaling_times_b_a_to_each_adapted_weight():
    base = {"model.layers.0.self_attn.q_proj.weight": torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]]),
            "model.norm.weight": torch.ones(3)}
    a = torch.tensor([[1.0, 2.0, 3.0]])  # rank 1, in 3
    b = torch.tensor([[2.0], [-1.0]])  # out 2
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}
    merged = merged_weights(base, adapter, 0.5)
    # B A = [[2, 4, 6], [-1, -2, -3]]; half of it added.
    assert list(merged) == ["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                       torch.tensor([[2.0, 2.0, 5.0], [-0.5, 0.0, -1.5]]))
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"][0], torch.tensor([1.0, 0.0, 2.0]))  # untouched


def test_scaling_is_alpha_over_rank_or_over_its_root_when_rank_stabilised():
    assert scaling_of({"r": 16, "lora_alpha": 32}) == 2.0
    assert scaling_of({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0


@pytest.mark.parametrize("adapter, message", [
    ({"x.lora_A.weight": torch.ones(1, 3)}, "without both lora_A and lora_B"),
    ({"x.lora_A.weight": torch.ones(1, 3), "x.lora_B.weight": torch.ones(2, 1), "x.base_layer.weight": torch.ones(2, 3)},
     "neither a lora_A nor a lora_B"),
    ({"y.lora_A.weight": torch.ones(1, 3), "y.lora_B.weight": torch.ones(2, 1)}, "which the model does not have"),
    ({"x.lora_A.weight": torch.ones(1, 4), "x.lora_B.weight": torch.ones(2, 1)}, "does not make the weight's shape (2, 3)"),
])
def test_an_adapter_that_does_not_fit_the_model_is_refused_naming_the_tensor(adapter, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        merged_weights({"x.weight": torch.zeros(2, 3)}, adapter, 1.0)


def test_modules_are_named_as_in_the_hf_model():
    pairs = adapted_modules({"base_model.model.lm_head.lora_A.weight": torch.ones(1, 2),
                             "base_model.model.lm_head.lora_B.weight": torch.ones(3, 1)})
    assert list(pairs) == ["lm_head"]

"""spec.training.lora on the torch backend: peft trains the adapter alone, the reference is the base
model, checkpoints hold the adapter, and what the engines and the HF export get is the model peft's
own merge gives."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlkube_runtime.lora import read_adapter
from rlkube_runtime.spec.lora import LoraSpec
from rlkube_runtime.trainer.config import LossConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.torch_backend import TorchBackend
from trainer_testutil import random_batch

LENGTHS = [(9, 4), (14, 6), (5, 2), (12, 3)]
LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


def lora_backend(checkpoint, *, kl=False, lora=LORA):
    return TorchBackend(TrainerConfig(
        model=ModelConfig(hf_checkpoint=str(checkpoint)),
        optimizer=OptimizerConfig(lr=1e-2, clip_grad=0.0),
        loss=LossConfig(use_kl_loss=kl, kl_loss_coef=0.1 if kl else 0.0),
        lora=lora,
    ))


def trained(backend, steps=3):
    batch = random_batch(LENGTHS, advantages=[1.0, -1.0, 1.0, 0.5])
    for _ in range(steps):
        batch = batch.with_fields(old_log_probs=backend.log_probs(batch).log_probs)
        if backend.config.loss.needs_ref_model:
            batch = batch.with_fields(ref_log_probs=backend.log_probs(batch, model="ref").log_probs)
        backend.train_step(batch)
    return batch


def test_only_the_adapter_trains_and_the_reference_stays_the_base_model(tiny_checkpoint):
    backend = lora_backend(tiny_checkpoint, kl=True)
    assert backend.ref_model is None  # no second copy: the reference is the actor with its adapter off
    batch = random_batch(LENGTHS, advantages=[1.0, -1.0, 1.0, 0.5])  # the batch `trained` trains on
    base = backend.log_probs(batch).log_probs
    frozen = {k: p.detach().clone() for k, p in backend.model.named_parameters() if not p.requires_grad}
    assert all("lora_" in k for k, p in backend.model.named_parameters() if p.requires_grad)

    batch = trained(backend)
    actor, ref = backend.log_probs(batch).log_probs, backend.log_probs(batch, model="ref").log_probs
    assert all(torch.allclose(r, b, atol=1e-6) for r, b in zip(ref, base))
    assert max((a - b).abs().max().item() for a, b in zip(actor, base)) > 1e-3
    assert all(torch.equal(p, frozen[k]) for k, p in backend.model.named_parameters() if not p.requires_grad)


def test_positive_advantages_raise_their_log_probs(tiny_checkpoint):
    backend = lora_backend(tiny_checkpoint)
    batch = random_batch(LENGTHS, advantages=[1.0] * len(LENGTHS))
    before = sum(lp.sum() for lp in backend.log_probs(batch).log_probs)
    for _ in range(5):
        backend.train_step(batch.with_fields(old_log_probs=backend.log_probs(batch).log_probs))
    assert sum(lp.sum() for lp in backend.log_probs(batch).log_probs) > before + 1.0


def test_a_checkpoint_holds_the_adapter_and_resumes_it_exactly(tiny_checkpoint, tmp_path):
    backend = lora_backend(tiny_checkpoint)
    batch = trained(backend)
    backend.save(tmp_path)
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=True)
    assert state["model"] and all("lora_" in k for k in state["model"])
    adapter_numel = sum(t.numel() for t in state["model"].values())
    assert adapter_numel < sum(p.numel() for p in backend.model.parameters()) / 4

    resumed = lora_backend(tiny_checkpoint)
    resumed.load(tmp_path)
    for a, b in zip(backend.log_probs(batch).log_probs, resumed.log_probs(batch).log_probs):
        assert torch.equal(a, b)
    full = TorchBackend(TrainerConfig(model=ModelConfig(hf_checkpoint=str(tiny_checkpoint))))
    with pytest.raises(ValueError, match="is a LoRA adapter, and this job trains the whole model"):
        full.load(tmp_path)  # a LoRA checkpoint is no full-model one
    other = lora_backend(tiny_checkpoint, lora=LoraSpec(rank=4, alpha=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="not this job's LoRA adapter"):
        other.load(tmp_path)


def test_the_engines_and_the_export_get_the_model_peft_merges(tiny_checkpoint, tmp_path):
    backend = lora_backend(tiny_checkpoint)
    trained(backend)
    backend.save_adapter(tmp_path / "adapter")
    config, tensors = read_adapter(tmp_path / "adapter")
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)

    # peft's own merge of the saved adapter into the base checkpoint: independent of rlkube's.
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    pushed = dict(backend.weights_for_push())
    assert pushed.keys() == expected.keys()
    for name, weight in pushed.items():
        assert torch.allclose(weight, expected[name], atol=1e-6), name

    exported = backend.save_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    for name, weight in model.state_dict().items():
        assert torch.allclose(weight, expected[name], atol=1e-6), name
    assert json.loads((exported / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_an_adapter_on_a_tied_output_layer_is_refused(tiny_checkpoint, tmp_path):
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(tiny_checkpoint, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="targetModules: lm_head is the input embedding too"):
        lora_backend(tied)

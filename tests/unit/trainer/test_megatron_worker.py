"""The trainer rank with spec.training.backend: megatron (CPU): it trains the same rollout as the
torch backend does, stages its gathered weights for the pushing rank, writes an HF directory
from them, saves and reloads a distributed checkpoint; the start-up check refuses settings a
backend would not honour, naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from megatron_testutil import megatron_core  # noqa: F401 - skips without megatron-core

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.spec import RLJobSpec
from rlkube_runtime.actors.trainer import TrainerWorker, check_trainer_supports

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def _spec(backend: str, **parallelism) -> dict:
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    spec["rollout"].update(batchSize=2, nSamplesPerPrompt=2)
    spec["training"].update(globalBatchSize=4, backend=backend)
    spec["parallelism"] = {"maxTokensPerGpu": 20, **parallelism}
    return spec


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [Sample(index=i, group_index=i // 2, tokens=torch.randint(8, 60, (9 + i,), generator=g).tolist(),
                   response_length=4, reward=float(i % 2)).to_dict() for i in range(4)]


def test_a_megatron_rank_trains_like_a_torch_rank_and_round_trips_its_checkpoint(tiny_checkpoint, tmp_path):
    mega = TrainerWorker(_spec("megatron"), hf_checkpoint=str(tiny_checkpoint))
    torch_rank = TrainerWorker(_spec("torch"), hf_checkpoint=str(tiny_checkpoint))
    got, want = mega.train(0, _samples()), torch_rank.train(0, _samples())
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key

    with pytest.raises(RuntimeError, match="stage_weights"):
        mega.save_hf(str(tmp_path / "early"))
    mega.stage_weights()
    hf_dir = mega.save_hf(str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    exported = torch_rank.export_weights()
    for name, tensor in exported.items():
        assert (reloaded[name] - tensor).abs().max() < 5e-5, name  # one Adam step apart by float noise only

    assert mega.save(str(tmp_path / "ckpt")) == "megatron_dist"
    expected = mega.train(1, _samples())
    other = TrainerWorker(_spec("megatron"), hf_checkpoint=str(tiny_checkpoint))
    other.load(str(tmp_path / "ckpt"), "megatron_dist")
    assert other.train(1, _samples()) == expected


@pytest.mark.parametrize(
    ("backend", "change", "field"),
    [
        ("torch", {"parallelism": {"tensor": 2}}, "spec.parallelism.tensor"),
        ("torch", {"parallelism": {"recompute": "selective"}}, "spec.parallelism.recompute"),
        ("torch", {"model": {"megatronArgs": {"attention-softmax-in-fp32": True}}}, "spec.model.megatronArgs"),
        ("megatron", {"parallelism": {"expert": 2}}, "spec.parallelism.expert"),
        ("megatron", {"parallelism": {"context": 2}, "resources": {"trainer": {"nodes": 1, "gpusPerNode": 2}}},
         "spec.parallelism.context"),
        ("megatron", {"model": {"dtype": "float16"}}, "spec.model.dtype"),
    ],
)
def test_settings_a_backend_cannot_honour_are_refused_at_start(backend, change, field):
    """By the spec's validation (what no backend honours: the field's path without `spec.`) or,
    for what only the runtime knows, by the start-up check (with it)."""
    spec = _spec(backend)
    for section, values in change.items():
        spec[section] = {**copy.deepcopy(spec.get(section, {})), **values}
    with pytest.raises(ValueError, match=field.removeprefix("spec.").replace(".", r"\.")):
        check_trainer_supports(RLJobSpec.model_validate(spec))

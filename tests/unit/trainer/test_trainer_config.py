"""Trainer configs read from a real RLJob spec; bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rlkube_runtime.spec import RLJob
from rlkube_runtime.trainer.config import (
    BatchingConfig,
    LossConfig,
    ModelConfig,
    TrainerConfig,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def example_spec(**changes):
    """The local-tiny example RLJob's spec with some sections updated (the example stays valid)."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    for section, values in changes.items():
        manifest["spec"].setdefault(section, {}).update(values)
    if "hfCheckpoint" in manifest["spec"]["model"]:
        manifest["spec"]["model"].pop("preset", None)  # one or the other gives the starting weights
    return RLJob.model_validate(manifest).spec


def test_config_from_the_rljob_spec():
    spec = example_spec(
        model={"hfCheckpoint": "/models/m", "dtype": "bfloat16"},
        rollout={"temperature": 0.8},
        algorithm={
            "advantageEstimator": "gspo",
            "epsClip": 0.2,
            "epsClipHigh": 0.28,
            "useKlLoss": True,
            "klLossCoef": 0.01,
            "klLossType": "k3",
            "perTokenLoss": True,
            "tis": {"enabled": True, "clip": 1.5, "clipLow": 0.1},
            "opsm": {"enabled": True, "delta": 0.02},
        },
        training={
            "numRollout": 5,
            "optimizer": {"lr": 2e-6, "lrDecayStyle": "cosine", "minLr": 1e-7, "warmupSteps": 1, "clipGrad": 0.5},
            "seed": 7,
        },
        parallelism={"maxTokensPerGpu": 512},
    )
    cfg = TrainerConfig.from_spec(spec)
    assert cfg.model.hf_checkpoint == "/models/m" and cfg.model.dtype == "bfloat16"
    assert cfg.optimizer.decay_steps == 5 * spec.training.num_steps_per_rollout
    assert (cfg.optimizer.lr, cfg.optimizer.lr_decay_style, cfg.optimizer.clip_grad) == (2e-6, "cosine", 0.5)
    assert cfg.loss.estimator == "gspo" and cfg.loss.per_token_loss and cfg.loss.kl_loss_type == "k3"
    assert cfg.loss.use_tis and (cfg.loss.tis_clip, cfg.loss.tis_clip_low) == (1.5, 0.1)
    assert cfg.loss.use_opsm and cfg.loss.opsm_delta == 0.02
    assert cfg.loss.clip_high == 0.28
    assert cfg.batching.max_tokens_per_gpu == 512 and cfg.batching.dynamic_batch_size
    assert cfg.temperature == 0.8 and cfg.seed == 7


def test_config_needs_a_checkpoint_path():
    spec = example_spec()  # model.preset: tiny, no hfCheckpoint
    with pytest.raises(ValueError, match="model.hf_checkpoint is unset"):
        TrainerConfig.from_spec(spec)
    assert TrainerConfig.from_spec(spec, hf_checkpoint="/tmp/tiny").model.hf_checkpoint == "/tmp/tiny"


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="parallelism.max_tokens_per_gpu must be >= 1 or unset, got 0"):
        BatchingConfig(max_tokens_per_gpu=0)
    with pytest.raises(ValueError, match=r"algorithm.eps_clip_c \(dual clip\) must be > 1, got 0.5"):
        LossConfig(eps_clip_c=0.5)
    with pytest.raises(ValueError, match="model.dtype must be one of .* got 'int8'"):
        ModelConfig(hf_checkpoint="/m", dtype="int8")
    with pytest.raises(ValueError, match="attn_implementation must be one of .* got 'flash_attention_2'"):
        ModelConfig(hf_checkpoint="/m", attn_implementation="flash_attention_2")

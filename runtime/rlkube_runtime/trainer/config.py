"""Plain, typed configuration for trainer backends.

Backends take these small dataclasses rather than the whole RLJob spec, so a backend only sees
the part it needs. `TrainerConfig.from_spec(spec)` is the one builder from a typed RLJob spec
(production and tests alike); every default is read from the spec's own fields (`spec_default`),
so a default is written once, in the spec. Validation raises `ValueError` naming the field and
value; it never changes a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..algorithms.loss import PolicyLossConfig
from ..spec.model import ModelSpec
from ..spec.parallelism import ParallelismSpec
from ..spec.algorithm import AlgorithmSpec
from ..spec.base import spec_default
from ..spec.lora import LoraSpec
from ..spec.training import OptimizerSpec, TrainingSpec
from ..spec.rollout import RolloutSpec

LR_DECAY_STYLES = ("constant", "linear", "cosine")
OPTIMIZER_TYPES = ("adam", "adamw")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
RECOMPUTE_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with a warmup-then-decay learning-rate schedule and global-norm gradient clipping.

    `decay_steps` is the optimizer step at which the decay reaches `min_lr` (the run's total
    optimizer steps, num_rollout × num_steps_per_rollout); None keeps `lr` after warmup for
    every style. `clip_grad` <= 0 turns clipping off (the norm is still reported).
    """

    type: str = spec_default(OptimizerSpec, "type")
    lr: float = spec_default(OptimizerSpec, "lr")
    lr_decay_style: str = spec_default(OptimizerSpec, "lr_decay_style")
    min_lr: float = spec_default(OptimizerSpec, "min_lr")
    warmup_steps: int = spec_default(OptimizerSpec, "warmup_steps")
    decay_steps: int | None = None
    weight_decay: float = spec_default(OptimizerSpec, "weight_decay")
    beta1: float = spec_default(OptimizerSpec, "beta1")
    beta2: float = spec_default(OptimizerSpec, "beta2")
    eps: float = spec_default(OptimizerSpec, "eps")
    clip_grad: float = spec_default(OptimizerSpec, "clip_grad")

    def __post_init__(self) -> None:
        if self.type not in OPTIMIZER_TYPES:
            raise ValueError(f"optimizer.type must be one of {OPTIMIZER_TYPES}, got {self.type!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"optimizer.lr_decay_style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}"
            )
        _positive("optimizer.lr", self.lr)
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"optimizer.decay_steps ({self.decay_steps}) must be >= warmup_steps ({self.warmup_steps})"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {beta}")
        _positive("optimizer.eps", self.eps)

    @classmethod
    def from_spec(cls, spec: Any) -> OptimizerConfig:
        """The decay reaches min_lr at the run's last optimizer step (numRollout x numStepsPerRollout)."""
        opt, training = spec.training.optimizer, spec.training
        return cls(
            type=opt.type,
            lr=opt.lr,
            lr_decay_style=opt.lr_decay_style,
            min_lr=opt.min_lr,
            warmup_steps=opt.warmup_steps,
            decay_steps=training.num_rollout * training.num_steps_per_rollout,
            weight_decay=opt.weight_decay,
            beta1=opt.beta1,
            beta2=opt.beta2,
            eps=opt.eps,
            clip_grad=opt.clip_grad,
        )


@dataclass(frozen=True)
class BatchingConfig:
    """How a rank's share of a global batch becomes micro-batches.

    dynamic_batch_size=True packs samples first-fit-decreasing into rows of at most
    `max_tokens_per_gpu` tokens (None: packing.DEFAULT_MAX_TOKENS_PER_GPU, raised to the
    longest sample when needed); False takes `micro_batch_size` samples per micro-batch (still packed
    into one row, so no padding either way).
    """

    dynamic_batch_size: bool = spec_default(ParallelismSpec, "dynamic_batch_size")
    max_tokens_per_gpu: int | None = spec_default(ParallelismSpec, "max_tokens_per_gpu")
    micro_batch_size: int = spec_default(ParallelismSpec, "micro_batch_size")

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"parallelism.max_tokens_per_gpu must be >= 1 or unset, got {self.max_tokens_per_gpu!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"parallelism.micro_batch_size must be >= 1, got {self.micro_batch_size}")

    @classmethod
    def from_spec(cls, spec: Any) -> BatchingConfig:
        par = spec.parallelism
        return cls(
            dynamic_batch_size=par.dynamic_batch_size,
            max_tokens_per_gpu=par.max_tokens_per_gpu,
            micro_batch_size=par.micro_batch_size,
        )


@dataclass(frozen=True)
class LossConfig(PolicyLossConfig):
    """The policy objective's settings (`algorithms.loss.PolicyLossConfig`, what `policy_objective`
    takes as is) plus the reward-side KL coefficient, which is no loss term but needs the
    reference model's log-probs just as the KL loss does."""

    reward_kl_coef: float = spec_default(AlgorithmSpec, "kl_coef")

    def __post_init__(self) -> None:
        _positive("algorithm.eps_clip", self.eps_clip)
        if self.eps_clip_high is not None:
            _positive("algorithm.eps_clip_high", self.eps_clip_high)
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"algorithm.eps_clip_c (dual clip) must be > 1, got {self.eps_clip_c}")

    @property
    def needs_ref_model(self) -> bool:
        return self.use_kl_loss or self.reward_kl_coef != 0

    @classmethod
    def from_spec(cls, spec: Any) -> LossConfig:
        alg = spec.algorithm
        return cls(
            estimator=alg.advantage_estimator,
            eps_clip=alg.eps_clip,
            eps_clip_high=alg.effective_eps_clip_high,
            eps_clip_c=alg.eps_clip_c,
            use_kl_loss=alg.use_kl_loss,
            kl_loss_coef=alg.kl_loss_coef,
            kl_loss_type=alg.kl_loss_type,
            entropy_coef=alg.entropy_coef,
            per_token_loss=alg.per_token_loss,
            use_tis=alg.tis.enabled,
            tis_clip=alg.tis.clip,
            tis_clip_low=alg.tis.clip_low,
            tis_level=alg.tis.level,
            tis_mode=alg.tis.mode,
            use_opsm=alg.opsm.enabled,
            opsm_delta=alg.opsm.delta,
            reward_kl_coef=alg.kl_coef,
        )


@dataclass(frozen=True)
class ModelConfig:
    """Where the weights come from and how they are computed.

    `ref_load` is an HF directory for the frozen reference model (None: `hf_checkpoint`).
    `dtype` is the compute dtype on GPU (autocast; parameters and optimizer stay fp32 as master
    weights); on CPU everything runs in float32 whatever `dtype` says. `attn_implementation` is
    transformers' (sdpa: PyTorch's flash kernels on a GPU; eager: the reference).
    """

    hf_checkpoint: str
    ref_load: str | None = None
    dtype: str = spec_default(ModelSpec, "dtype")
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = spec_default(ModelSpec, "trust_remote_code")  # run the checkpoint's own code

    def __post_init__(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError("model.hf_checkpoint is empty; give an HF model directory or hub id")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"model.dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {self.attn_implementation!r}"
            )

    @classmethod
    def from_spec(cls, spec: Any, *, hf_checkpoint: str | None = None) -> ModelConfig:
        """`hf_checkpoint` overrides `spec.model.hf_checkpoint` (e.g. a preset's resolved directory)."""
        m = spec.model
        path = hf_checkpoint or m.hf_checkpoint
        if path is None:
            raise ValueError(
                "model.hf_checkpoint is unset; the torch backend loads an HF directory: set "
                "model.hfCheckpoint or pass the resolved preset directory as hf_checkpoint="
            )
        return cls(hf_checkpoint=str(path), ref_load=m.ref_load, dtype=m.dtype, trust_remote_code=m.trust_remote_code)


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a trainer backend needs: model, optimizer, batching, loss, sampling temperature,
    activation recomputation (`recompute`: none, full, selective; a backend refuses what it lacks)."""

    model: ModelConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # Log-probs are taken from log_softmax(logits / temperature), the distribution the engines
    # sampled from, so the PPO ratio and TIS compare like with like (0: the logits as they are).
    temperature: float = spec_default(RolloutSpec, "temperature")
    seed: int = spec_default(TrainingSpec, "seed")
    recompute: str = spec_default(ParallelismSpec, "recompute")
    # Replay the engine's expert routing in the actor's forward passes (spec.training.routingReplay).
    routing_replay: bool = spec_default(TrainingSpec, "routing_replay")
    # Train a LoRA adapter instead of the whole model (spec.training.lora; torch backend only).
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"parallelism.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"rollout.temperature must be >= 0 (0 means greedy: logits as they are), got {self.temperature!r}")

    @classmethod
    def from_spec(cls, spec: Any, *, hf_checkpoint: str | None = None) -> TrainerConfig:
        """Read a typed RLJob spec; `hf_checkpoint` as in `ModelConfig.from_spec`."""
        return cls(
            model=ModelConfig.from_spec(spec, hf_checkpoint=hf_checkpoint),
            optimizer=OptimizerConfig.from_spec(spec),
            batching=BatchingConfig.from_spec(spec),
            loss=LossConfig.from_spec(spec),
            temperature=spec.rollout.temperature,
            seed=spec.training.seed,
            recompute=spec.parallelism.recompute,
            routing_replay=spec.training.routing_replay,
            lora=spec.training.lora,
        )


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")

"""Plain, typed configuration for trainer backends.

Backends take these small dataclasses rather than the whole RLJob spec, so a backend only sees
the part it needs and does not depend on the spec package's exact shape. Each class has a
`from_spec(spec)` classmethod that reads the documented spec attributes duck-typed (any object
with those attributes works). Validation raises `ValueError` naming the field and value; it
never changes a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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

    type: str = "adam"
    lr: float = 1e-6
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    clip_grad: float = 1.0

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
        opt = spec.training.optimizer
        num_rollout = getattr(spec.training, "num_rollout", None)
        steps_per_rollout = getattr(spec.training, "num_steps_per_rollout", None)
        decay_steps = (
            num_rollout * steps_per_rollout if num_rollout is not None and steps_per_rollout is not None else None
        )
        return cls(
            type=_get(opt, "type", cls.type),
            lr=_get(opt, "lr", cls.lr),
            lr_decay_style=_get(opt, "lr_decay_style", cls.lr_decay_style),
            min_lr=_get(opt, "min_lr", cls.min_lr),
            warmup_steps=_get(opt, "warmup_steps", cls.warmup_steps),
            decay_steps=decay_steps,
            weight_decay=_get(opt, "weight_decay", cls.weight_decay),
            beta1=_get(opt, "beta1", cls.beta1),
            beta2=_get(opt, "beta2", cls.beta2),
            eps=_get(opt, "eps", cls.eps),
            clip_grad=_get(opt, "clip_grad", cls.clip_grad),
        )


@dataclass(frozen=True)
class BatchingConfig:
    """How a rank's share of a global batch becomes micro-batches.

    dynamic_batch_size=True packs samples first-fit-decreasing into rows of at most
    `max_tokens_per_gpu` tokens (None: packing.DEFAULT_MAX_TOKENS_PER_GPU, raised to the
    longest sample when needed); False takes `micro_batch_size` samples per micro-batch (still packed
    into one row, so no padding either way).
    """

    dynamic_batch_size: bool = True
    max_tokens_per_gpu: int | None = None
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"parallelism.max_tokens_per_gpu must be >= 1 or unset, got {self.max_tokens_per_gpu!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"parallelism.micro_batch_size must be >= 1, got {self.micro_batch_size}")

    @classmethod
    def from_spec(cls, spec: Any) -> BatchingConfig:
        par = spec.parallelism
        return cls(
            dynamic_batch_size=_get(par, "dynamic_batch_size", cls.dynamic_batch_size),
            max_tokens_per_gpu=_get(par, "max_tokens_per_gpu", cls.max_tokens_per_gpu),
            micro_batch_size=_get(par, "micro_batch_size", cls.micro_batch_size),
        )


@dataclass(frozen=True)
class LossConfig:
    """The policy objective's knobs, passed as keywords to `algorithms.loss.policy_objective`.

    Names (estimator, kl_loss_type) are checked by the loss module's registry, which knows them.
    """

    estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    per_token_loss: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    # Not a loss term: the KL penalty reinforce++ folds into the rewards; it needs the reference
    # model's log-probs just as the KL loss does.
    reward_kl_coef: float = 0.0

    def __post_init__(self) -> None:
        _positive("algorithm.eps_clip", self.eps_clip)
        if self.eps_clip_high is not None:
            _positive("algorithm.eps_clip_high", self.eps_clip_high)
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"algorithm.eps_clip_c (dual clip) must be > 1, got {self.eps_clip_c}")

    @property
    def needs_ref_model(self) -> bool:
        return self.use_kl_loss or self.reward_kl_coef != 0

    def objective_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `policy_objective` (everything but the tensors and counts)."""
        return {
            "estimator": self.estimator,
            "eps_clip": self.eps_clip,
            "eps_clip_high": self.eps_clip if self.eps_clip_high is None else self.eps_clip_high,
            "eps_clip_c": self.eps_clip_c,
            "use_kl_loss": self.use_kl_loss,
            "kl_loss_coef": self.kl_loss_coef,
            "kl_loss_type": self.kl_loss_type,
            "entropy_coef": self.entropy_coef,
            "use_tis": self.use_tis,
            "tis_clip": self.tis_clip,
            "tis_clip_low": self.tis_clip_low,
            "per_token_loss": self.per_token_loss,
        }

    @classmethod
    def from_spec(cls, spec: Any) -> LossConfig:
        alg = spec.algorithm
        eps_clip = _get(alg, "eps_clip", cls.eps_clip)
        eps_clip_high = getattr(alg, "effective_eps_clip_high", None)
        if eps_clip_high is None:
            eps_clip_high = _get(alg, "eps_clip_high", None)
        tis = getattr(alg, "tis", None)
        return cls(
            estimator=_get(alg, "advantage_estimator", cls.estimator),
            eps_clip=eps_clip,
            eps_clip_high=eps_clip_high,
            eps_clip_c=_get(alg, "eps_clip_c", None),
            use_kl_loss=_get(alg, "use_kl_loss", cls.use_kl_loss),
            kl_loss_coef=_get(alg, "kl_loss_coef", cls.kl_loss_coef),
            kl_loss_type=_get(alg, "kl_loss_type", cls.kl_loss_type),
            entropy_coef=_get(alg, "entropy_coef", cls.entropy_coef),
            per_token_loss=_get(alg, "per_token_loss", cls.per_token_loss),
            use_tis=bool(_get(tis, "enabled", False)) if tis is not None else False,
            tis_clip=_get(tis, "clip", cls.tis_clip) if tis is not None else cls.tis_clip,
            tis_clip_low=_get(tis, "clip_low", cls.tis_clip_low) if tis is not None else cls.tis_clip_low,
            reward_kl_coef=_get(alg, "kl_coef", cls.reward_kl_coef),
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
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False  # run the checkpoint's own model/tokenizer code (spec.model.trustRemoteCode)

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
        path = hf_checkpoint or _get(m, "hf_checkpoint", None)
        if path is None:
            raise ValueError(
                "model.hf_checkpoint is unset; the torch backend loads an HF directory: set "
                "model.hfCheckpoint or pass the resolved preset directory as hf_checkpoint="
            )
        dtype = _get(m, "dtype", cls.dtype)
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(str(dtype), str(dtype))
        return cls(hf_checkpoint=str(path), ref_load=_get(m, "ref_load", None), dtype=dtype,
                   trust_remote_code=bool(_get(m, "trust_remote_code", False)))


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
    temperature: float = 1.0
    seed: int = 1234
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"parallelism.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"rollout.temperature must be >= 0 (0 means greedy: logits as they are), got {self.temperature!r}")

    @classmethod
    def from_spec(cls, spec: Any, *, hf_checkpoint: str | None = None) -> TrainerConfig:
        """Read an RLJob spec (duck-typed); `hf_checkpoint` as in `ModelConfig.from_spec`."""
        return cls(
            model=ModelConfig.from_spec(spec, hf_checkpoint=hf_checkpoint),
            optimizer=OptimizerConfig.from_spec(spec),
            batching=BatchingConfig.from_spec(spec),
            loss=LossConfig.from_spec(spec),
            temperature=_get(spec.rollout, "temperature", 1.0),
            seed=_get(spec.training, "seed", 1234),
            recompute=_get(getattr(spec, "parallelism", None), "recompute", "none"),
        )


def _get(obj: Any, name: str, default: Any) -> Any:
    """`obj.name`, or `default` when the attribute is missing or None."""
    value = getattr(obj, name, None)
    return default if value is None else value


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")

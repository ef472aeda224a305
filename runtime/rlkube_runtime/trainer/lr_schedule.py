"""Learning rate per optimizer step: linear warmup, then constant, linear or cosine decay to min_lr.

Step s counts optimizer steps already taken (0 for the first) and n = s + 1 is the step's
number. Warmup: lr·n/W for n <= W, so the very first step already moves the weights and step W
uses lr. After warmup, with progress p = (n - W) / (D - W) clamped to [0, 1] (D = decay_steps,
the run's total steps):
  constant: lr
  linear:   lr - (lr - min_lr)·p
  cosine:   min_lr + (lr - min_lr)·(1 + cos(π·p))/2
so the run's last step (n = D) uses min_lr. Without decay_steps the decay styles hold lr.
"""

from __future__ import annotations

import math

import torch

from .config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    n = step + 1
    warmup = cfg.warmup_steps
    if n <= warmup:
        return cfg.lr * n / warmup
    if cfg.lr_decay_style == "constant" or cfg.decay_steps is None:
        return cfg.lr
    span = cfg.decay_steps - warmup
    progress = 1.0 if span <= 0 else min(1.0, (n - warmup) / span)
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_decay_style {cfg.lr_decay_style!r}")


class LRSchedule:
    """Sets each param group's lr before an optimizer step; its state is the step counter."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.cfg = cfg
        self.step_count = 0

    @property
    def current_lr(self) -> float:
        """The lr the next optimizer step will use."""
        return lr_at(self.step_count, self.cfg)

    def apply(self) -> float:
        """Write the next step's lr into the optimizer; returns it."""
        lr = self.current_lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "step_count" not in state:
            raise ValueError(f"scheduler state needs 'step_count', got keys {sorted(state)}")
        self.step_count = int(state["step_count"])

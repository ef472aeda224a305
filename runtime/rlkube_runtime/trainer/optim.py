"""What both trainer backends build and step the same way: AdamW with Megatron's weight-decay
groups, the lr schedule, and the step taken only on a finite gradient norm."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from .config import TrainerConfig
from .lr_schedule import LRSchedule

log = logging.getLogger(__name__)


def make_adamw(model: torch.nn.Module, config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW; like Megatron, biases and norm weights (1-D parameters) get no weight decay. On a
    GPU the fused kernel: one launch for all parameters instead of several per tensor."""
    opt = config.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=fused
    )


def make_adamw_and_schedule(model: torch.nn.Module, config: TrainerConfig) -> tuple[torch.optim.AdamW, LRSchedule]:
    optimizer = make_adamw(model, config)
    return optimizer, LRSchedule(optimizer, config.optimizer)


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: float) -> float:
    """One optimizer step unless the gradient norm is inf or NaN (then the step is skipped, as
    Megatron skips it); the gradients are dropped either way. Returns the norm."""
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def to_cpu(obj: Any) -> Any:
    """A deep copy of a (nested) state dict with every tensor on CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj

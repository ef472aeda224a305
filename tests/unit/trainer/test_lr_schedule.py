"""Learning-rate schedule values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from rlkube_runtime.trainer.config import OptimizerConfig
from rlkube_runtime.trainer.lr_schedule import LRSchedule, lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=8, lr_decay_style="cosine")
    # Step numbers n = s + 1. Warmup n/4 for n <= 4; then progress p = (n - 4) / 4, so the
    # 8th (last) step is at min_lr.
    expected = [0.25, 0.5, 0.75, 1.0]
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (1 / 4, 2 / 4, 3 / 4)]
    expected += [0.1, 0.1, 0.1]
    # Closed forms of the cosine values: p=1/4 -> 0.1 + 0.45 (1 + √2/2), p=1/2 -> 0.55.
    assert expected[5] == pytest.approx(0.55)
    assert expected[4] == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(2) / 2))
    assert [lr_at(s, cfg) for s in range(10)] == pytest.approx(expected)


def test_linear_decay_and_constant():
    linear = OptimizerConfig(lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=4, lr_decay_style="linear")
    assert [lr_at(s, linear) for s in range(6)] == pytest.approx([1.5, 1.0, 0.5, 0.0, 0.0, 0.0])
    constant = OptimizerConfig(lr=2.0, warmup_steps=2, decay_steps=4, lr_decay_style="constant")
    assert [lr_at(s, constant) for s in range(4)] == pytest.approx([1.0, 2.0, 2.0, 2.0])


def test_schedule_writes_the_lr_into_the_optimizer_and_saves_its_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=123.0)
    schedule = LRSchedule(opt, OptimizerConfig(lr=1.0, warmup_steps=2))
    assert schedule.apply() == 0.5 and opt.param_groups[0]["lr"] == 0.5
    schedule.advance()
    restored = LRSchedule(opt, OptimizerConfig(lr=1.0, warmup_steps=2))
    restored.load_state_dict(schedule.state_dict())
    assert restored.current_lr == 1.0


def test_bad_schedule_settings_name_the_field():
    with pytest.raises(ValueError, match="optimizer.lr_decay_style must be one of"):
        OptimizerConfig(lr_decay_style="step")
    with pytest.raises(ValueError, match=r"optimizer.min_lr must be in \[0, lr=0.001\], got 0.5"):
        OptimizerConfig(lr=1e-3, min_lr=0.5)

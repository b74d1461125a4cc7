"""The learning-rate schedule: linear warmup to the peak, cosine down to min_lr_ratio x peak."""

from __future__ import annotations

import math

import pytest
import torch

from shardtune.train.schedule import build_scheduler, lr_multiplier, warmup_steps_for


def test_warmup_then_cosine_to_the_floor():
    total, warmup, floor = 10, 4, 0.1
    values = [lr_multiplier(step, warmup, total, floor) for step in range(total)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(1.0)  # the cosine starts at the peak ...
    assert values[9] == pytest.approx(0.1)  # ... and ends at the floor on the last step
    assert values[6] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 2 / 5)))
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))


def test_no_warmup_starts_at_the_peak():
    assert lr_multiplier(0, 0, 5, 0.0) == pytest.approx(1.0)
    assert lr_multiplier(4, 0, 5, 0.0) == pytest.approx(0.0)


def test_warmup_steps_from_ratio_or_count():
    assert warmup_steps_for(100, 0.05, None) == 5
    assert warmup_steps_for(100, 0.051, None) == 6  # rounds up: a ratio above 0 always warms up
    assert warmup_steps_for(100, 0.5, 7) == 7
    assert warmup_steps_for(3, 0.0, 10) == 3


def test_scheduler_sets_the_optimizer_learning_rate():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=2e-4)
    scheduler = build_scheduler(optimizer, total_steps=6, warmup=2, min_ratio=0.1)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(
        [
            1e-4,
            2e-4,
            2e-4,
            2e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3))),
            2e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(2 * math.pi / 3))),
            2e-5,
        ]
    )

"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr_ratio x learning_rate``."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_steps_for(total_steps: int, warmup_ratio: float, warmup_steps: int | None) -> int:
    if warmup_steps is not None:
        return min(warmup_steps, total_steps)
    return min(math.ceil(warmup_ratio * total_steps), total_steps)


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Warmup ramps (step + 1) / warmup so the first step already learns and step ``warmup - 1`` reaches
    the peak; the cosine then runs from the peak at step ``warmup`` to ``min_ratio`` at the last step.
    """
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total - warmup - 1
    if decay_steps <= 0:
        return 1.0
    progress = min((step - warmup) / decay_steps, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup: int, min_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, warmup, total_steps, min_ratio))

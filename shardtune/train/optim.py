"""The optimizer: AdamW over trainable parameters, no weight decay on biases and norm weights."""

from __future__ import annotations

import torch

from shardtune.config import TrainingConfig


def build_optimizer(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            # 1-D tensors are biases and norm scales; decaying them toward 0 only hurts.
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]],
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_epsilon,
        # The fused kernel updates all parameters in a few launches instead of several per tensor.
        fused=device.type == "cuda" if training.fused_optimizer == "auto" else training.fused_optimizer,
    )

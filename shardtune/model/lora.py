"""LoRA adapters through PEFT, so saved adapters load with ``PeftModel.from_pretrained`` anywhere."""

from __future__ import annotations

import peft
import torch
from transformers import PreTrainedModel

from shardtune.config import LoraConfig
from shardtune.errors import ConfigError


def apply_lora(model: PreTrainedModel, config: LoraConfig) -> peft.PeftModel:
    """Freeze the base model and add trainable LoRA adapters to the target modules."""
    lora_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        # PEFT keeps adapter weights in fp32 even on a bf16 base (autocast_adapter_dtype): they are
        # the only weights that change, so they get full-precision updates.
        return peft.get_peft_model(model, lora_config)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules: {exc}") from exc


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total

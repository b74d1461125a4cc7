"""Load the tokenizer and the model (pretrained weights or a seeded random init) in the right dtype."""

from __future__ import annotations

import logging

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shardtune.config import ModelConfig
from shardtune.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on GPUs that support it and fp32 everywhere else (CPUs emulate bf16 slowly)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"model.dtype: bfloat16 is not supported by {torch.cuda.get_device_name(device)}")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(
        config.name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
    )
    if tokenizer.pad_token_id is None:
        # Padded positions are masked out of attention and loss, so any id works; EOS is always there.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    seed: int,
    materialize: bool = True,
    random_init_device: torch.device | None = None,
) -> PreTrainedModel:
    """The causal LM on the CPU with weights stored in ``dtype``.

    ``materialize=False`` builds the architecture on the meta device (no memory, no disk reads): the
    weights of such a replica come later from the rank that did load them. Random weights
    (``init: random``) are drawn on ``random_init_device`` when given: a GPU draws tens of billions in
    seconds where a CPU takes minutes (the values then depend on the device type, not on the world size).
    """
    common = {
        "dtype": dtype,
        "attn_implementation": config.attn_implementation,
        "trust_remote_code": config.trust_remote_code,
        **({"experts_implementation": config.experts_implementation} if config.experts_implementation else {}),
    }
    if config.init == "random" or not materialize:
        model_config = AutoConfig.from_pretrained(
            config.name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
        torch.manual_seed(seed)
        with torch.device((random_init_device or "cpu") if materialize else "meta"):
            model = AutoModelForCausalLM.from_config(model_config, **common)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.name_or_path, revision=config.revision, **common)
    # Training never reuses past key/values; a cache would also break packed-sequence isolation.
    model.config.use_cache = False
    return model

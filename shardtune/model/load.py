"""Load the tokenizer and the model (pretrained weights or a seeded random init) in the right dtype."""

from __future__ import annotations

import importlib.util
import logging

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shardtune.config import Config, ModelConfig
from shardtune.errors import ConfigError
from shardtune.model.fused_moe import TRANSFORMERS_IMPLEMENTATIONS

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


def training_attention(config: Config, device: torch.device) -> str:
    """What ``model.attn_implementation: auto`` means for a training run on ``device``.

    Packed sequences need each example isolated from the others. sdpa gets that through a materialized
    mask, which sends it to a slower kernel (on one H100, Mistral-7B at the seed's seq 512 on alpaca-like
    data: 0.325 s per step); FlexAttention skips the masked blocks (0.137 s). Without packing (one
    example per sequence, or padding) plain causal sdpa is the fastest kernel. FlexAttention's kernels are
    Triton's, for GPUs.
    """
    chosen = config.model.attn_implementation
    if chosen == "flash_attention_2":
        # Checked here, before any weight is read: transformers would only fail inside from_pretrained.
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed: "
                "pip install flash-attn, or set model.attn_implementation: sdpa"
            )
        if device.type != "cuda":
            raise ConfigError(
                "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only; set model.attn_implementation: "
                "sdpa on this machine"
            )
    if chosen != "auto":
        return chosen
    return "flex_attention" if config.data.packing and device.type == "cuda" else "sdpa"


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
        # auto outside training (export, evaluation of padded examples): plain sdpa.
        "attn_implementation": "sdpa" if config.attn_implementation == "auto" else config.attn_implementation,
        "trust_remote_code": config.trust_remote_code,
        # fused (and auto) blocks are swapped in by training (shardtune.model.fused_moe); other uses of
        # the model run transformers' default.
        **(
            {"experts_implementation": config.experts_implementation}
            if config.experts_implementation in TRANSFORMERS_IMPLEMENTATIONS
            else {}
        ),
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

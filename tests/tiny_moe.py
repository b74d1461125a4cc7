"""Tiny random Mixture-of-Experts models of each supported architecture, with the shipped tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import TINY_MODEL
from transformers import AutoConfig

COMMON = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
ARCHITECTURES = {
    # Every layer sparse: 8 experts, 2 per token.
    "qwen3_moe": {
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    },
    "mixtral": {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    # GLM-4.5's layout: a dense first layer, then sparse layers with a shared expert and a sigmoid router.
    "glm4_moe": {
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_hidden_layers": 3,
    },
}


def write_tiny_moe(directory: Path, architecture: str) -> Path:
    """A model directory (config + tokenizer, no weights: train it with model.init=random)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(architecture, **{**COMMON, **ARCHITECTURES[architecture]})
    config.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL / name, directory / name)
    return directory

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


# DeepSeek-V3's layout (MLA attention; group-limited routing: the best of 2 groups of 4 experts, with a
# routed scaling factor). Kept apart from ARCHITECTURES, whose tests cover the routing statistics.
DEEPSEEK_V3 = {
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "num_key_value_heads": 4,  # MLA: keys and values per head
    "num_hidden_layers": 3,
}
ALL_ARCHITECTURES = {**ARCHITECTURES, "deepseek_v3": DEEPSEEK_V3}


def write_tiny_moe(directory: Path, architecture: str) -> Path:
    """A model directory (config + tokenizer, no weights: train it with model.init=random)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(architecture, **{**COMMON, **ALL_ARCHITECTURES[architecture]})
    config.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL / name, directory / name)
    return directory

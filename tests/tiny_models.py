"""Tiny random models of each architecture shardtune is tested on, built offline with the shipped tokenizer.

Every config is the architecture's own (``AutoConfig.for_model``) with its default layout: fused or
separate projections, tied or untied heads, RoPE or learned positions, parallel or sequential blocks.
Only sizes shrink (hidden 64, 2 layers, 4 heads, the tokenizer's 1024 ids) and dropout is off, so a run
on one process and on several computes the same numbers. The keys are the standard ones; transformers
maps them to each config's own names (``n_embd``, ``n_layer``, ``n_head`` for GPT-2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import TINY_MODEL
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

COMMON = {
    "vocab_size": 1024,  # the shipped tokenizer's
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
GROUPED_QUERY = {"num_key_value_heads": 2, "intermediate_size": 128}
NO_DROPOUT_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

DENSE_ARCHITECTURES = {
    "llama": GROUPED_QUERY,
    "mistral": GROUPED_QUERY,
    "qwen2": GROUPED_QUERY,
    "qwen3": {**GROUPED_QUERY, "head_dim": 16},
    "gemma2": {**GROUPED_QUERY, "head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {**GROUPED_QUERY, "head_dim": 16, "query_pre_attn_scalar": 16},
    "phi3": GROUPED_QUERY,  # fused qkv_proj and gate_up_proj
    # No num_key_value_heads in the configs below; GPT-2's projections are Conv1D, not nn.Linear.
    "gpt2": NO_DROPOUT_GPT2,
    "gpt_neox": {"intermediate_size": 128, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.0, "attention_dropout": 0.0},
    "falcon": {"ffn_hidden_size": 128},  # multi-query attention, fused query_key_value
}
MOE_ARCHITECTURES = {
    # Every layer sparse: 8 experts, 2 per token.
    "qwen3_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    },
    "mixtral": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    # GLM-4.5's layout: a dense first layer, then sparse layers with a shared expert and a sigmoid router.
    "glm4_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
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
ARCHITECTURES = {**DENSE_ARCHITECTURES, **MOE_ARCHITECTURES}
# DeepSeek-V3's layout (MLA attention; group-limited routing: the best of 2 groups of 4 experts, with a
# routed scaling factor), for the fused MoE block's tests: kept out of the other matrices.
DEEPSEEK_V3 = {
    "tie_word_embeddings": False,
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
# The Qwen2-MoE family: a softmax router, and a shared expert scaled by a sigmoid gate of its own.
QWEN2_MOE = {
    **MOE_ARCHITECTURES["qwen3_moe"], "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1
}  # fmt: skip
# Qwen3-Next's and Qwen3.5's hybrid layers: linear attention (Gated DeltaNet) in three of four.
HYBRID_ATTENTION = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
# GLM-4.7-Flash's layout (glm4_moe_lite: MLA attention) and GLM-5's (glm_moe_dsa: MLA with DeepSeek's sparse
# attention indexer): DeepSeek-V3's MoE block; the dense first layer is given as mlp_layer_types.
GLM_AFTER_45 = {
    **{key: value for key, value in DEEPSEEK_V3.items() if key != "first_k_dense_replace"},
    "n_group": 1,
    "routed_scaling_factor": 1.8,
    "mlp_layer_types": ["dense", "sparse", "sparse"],
}
# 8 experts 32 wide, 2 a token, sized by intermediate_size (MiniMax-M2, GPT-OSS).
EXPERTS_BY_INTERMEDIATE_SIZE = {
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
# Granite-MoE: a softmax of the top-k logits; every layer sparse. Attention scaled by 1 / head size, as Granite's
# configs have it (the default, 1, sharpens a random model's attention until summation orders show in fp32).
GRANITE_MOE = {
    "attention_multiplier": 1 / 16,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
# Further architectures the fused block serves, tested in tests/train/test_fused_moe.py (the model types this
# transformers has).
MORE_FUSED_MOE_ARCHITECTURES = {
    "deepseek_v3": DEEPSEEK_V3,
    "glm4_moe_lite": GLM_AFTER_45,
    "glm_moe_dsa": {**GLM_AFTER_45, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "head_dim": 8},
    "dots1": {
        **DEEPSEEK_V3,
        **{key: MOE_ARCHITECTURES["glm4_moe"][key] for key in ("head_dim", "num_key_value_heads")},
    },
    "qwen2_moe": QWEN2_MOE,
    "qwen3_next": {**QWEN2_MOE, **HYBRID_ATTENTION, "head_dim": 16},
    "qwen3_5_moe_text": {**QWEN2_MOE, **HYBRID_ATTENTION, "head_dim": 16},
    "olmoe": {**MOE_ARCHITECTURES["qwen3_moe"], "norm_topk_prob": False},
    # DeepSeek-V2: softmax scores, not renormalized, the best of 2 groups of 4 experts by their best, scaled.
    "deepseek_v2": {
        **{key: value for key, value in DEEPSEEK_V3.items() if key != "num_hidden_layers"},
        "topk_method": "group_limited_greedy",
        "num_hidden_layers": 3,
    },
    # ERNIE 4.5: softmax scores chosen with a correction bias (its router's moe_statics), a shared expert.
    "ernie4_5_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "num_hidden_layers": 3,
    },
    "granitemoe": GRANITE_MOE,
    # Granite-MoE with a shared MLP beside each sparse block (the decoder layer's shared_mlp).
    "granitemoeshared": {**GRANITE_MOE, "shared_intermediate_size": 48},
    # LFM2-MoE: short-convolution and attention layers, a dense first one; sigmoid scores chosen with a correction
    # bias that is its block's buffer, renormalized and scaled.
    "lfm2_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_dense_layers": 1,
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.0,
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "conv", "full_attention"],
    },
    # DeepSeek-V3.2: DeepSeek-V3 with the sparse-attention indexer (its layer_types' name differs between
    # transformers versions: left to the default).
    "deepseek_v32": {**DEEPSEEK_V3, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2},
    # Kimi-Linear: DeepSeek-V3's MoE block with Kimi Delta Attention (linear) in two of three layers.
    "kimi_linear": {
        **{key: value for key, value in DEEPSEEK_V3.items() if key != "n_routed_experts"},
        "num_local_experts": 8,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4,
    },
    # DeepSeek-V3's block in models of their own attention: EXAONE-MoE (sliding-window layers, a dense first layer)
    # and Solar-Open (every layer sparse).
    "exaone_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "solar_open": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
    },
    # Qwen3-MoE's block in Mellum (a sliding-window layer) and OLMoE's in FlexOlmo.
    "mellum": {
        **MOE_ARCHITECTURES["qwen3_moe"],
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "flex_olmo": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "intermediate_size": 32,  # the experts' width: no dense MLP
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    # GPT-OSS: a biased softmax router; transposed, biased experts with a clamped GLU; sliding-window layers with
    # attention sinks. Plain rotary positions (its YaRN scaling assumes 4,096 of them).
    "gpt_oss": {
        **EXPERTS_BY_INTERMEDIATE_SIZE,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    },
    # MiniMax-M2: a sigmoid router whose correction bias is its block's buffer.
    "minimax_m2": EXPERTS_BY_INTERMEDIATE_SIZE,
}
FUSED_MOE_ARCHITECTURES = {
    **MOE_ARCHITECTURES,
    **{name: spec for name, spec in MORE_FUSED_MOE_ARCHITECTURES.items() if name in CONFIG_MAPPING},
}


def kernel_sized_qwen3_moe():
    """A Qwen3-MoE config for the GPU tests of the fused block's kernels: wide enough to fill their tiles
    (hidden 256, 16 experts 128 wide, 4 a token)."""
    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4,
    )  # fmt: skip


def tiny_config(architecture: str):
    return AutoConfig.for_model(
        architecture, **{**COMMON, **{**ARCHITECTURES, **FUSED_MOE_ARCHITECTURES}[architecture]}
    )


def write_tiny_model(directory: Path, architecture: str) -> Path:
    """A model directory (config + tokenizer, no weights: train it with model.init=random)."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_config(architecture).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL / name, directory / name)
    return directory

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
    # dots3-note's text model: DeepSeek-V3's MoE block after a dense first layer, MLA with a sparse-attention indexer
    # in every layer (its sliding-window layers, which take attention sizes of their own, left out).
    "dots3_note_text": {
        **GLM_AFTER_45,
        "index_topk": 16,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "head_dim": 16,
        "shared_experts_intermediate_size": 32,
        "layer_types": ["indexed_attention"] * 3,
    },
    # Llama 4 (text): the sigmoid of each chosen logit scales the expert's input, its experts' weights are (E, in, out),
    # a shared expert beside them; a dense first layer (moe_layers), chunked attention and NoPE layers by default.
    "llama4_text": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "moe_layers": [1, 2],
    },
    # Hunyuan-MoE (Hunyuan-A13B): the top-k softmax probabilities renormalized, from its router's Linear (gate.wg); a
    # shared MLP beside the experts (shared_mlp) in every layer.
    "hunyuan_v1_moe": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    # MiniMax-M2: a sigmoid router whose correction bias is its block's buffer.
    "minimax_m2": EXPERTS_BY_INTERMEDIATE_SIZE,
    # MiMo-V2-Flash: DeepSeek-V3's block without shared experts (one group); sliding-window layers with attention
    # sinks, a dense first layer.
    "mimo_v2_flash": {
        **{key: MOE_ARCHITECTURES["glm4_moe"][key] for key in ("num_key_value_heads", "tie_word_embeddings")},
        "head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
    },
    # Ling's hybrid (bailing_hybrid): DeepSeek-V3's block (2 groups of 4 experts) with MLA in every third layer and
    # Kimi Delta Attention (linear) in the others, a dense first layer.
    "bailing_hybrid": {
        **{key: value for key, value in DEEPSEEK_V3.items() if key not in ("n_routed_experts", "q_lora_rank")},
        "num_local_experts": 8,
        "head_dim": 16,
        "layer_group_size": 3,
        "first_k_dense_replace": 1,
    },
    # AFMoE: a router holding its logits' Linear (router.gate), sigmoid scores chosen with its block's correction bias,
    # renormalized and scaled; shared experts; a dense first layer, sliding-window and global attention.
    "afmoe": {
        **EXPERTS_BY_INTERMEDIATE_SIZE,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_shared_experts": 1,
        "route_scale": 2.5,
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "global_attn_every_n_layers": 2,
    },
    # HY-V4: GLM-4.7-Flash's block (DeepSeek-V3's: one group, a shared expert) whose experts clamp their gate and up
    # at a SwiGLU limit, low enough here that the clamp acts on a random model's rows; MLA with a sparse-attention
    # indexer, hyper-connections of 2 streams.
    "hy_v4": {
        **GLM_AFTER_45,
        "index_topk": 16,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "hc_mult": 2,
        "swiglu_limit": 0.05,
    },
    # Hy3 (hy_v3): a sigmoid router whose correction bias is its block's buffer (MiniMax-M2's block), renormalized and
    # scaled, a shared expert; a dense first layer.
    "hy_v3": {
        **EXPERTS_BY_INTERMEDIATE_SIZE,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_shared_experts": 1,
        "router_scaling_factor": 2.5,
        "num_hidden_layers": 3,
    },
    # A.X-K1: DeepSeek-V3 whose MoE block normalizes its output.
    "axk1": DEEPSEEK_V3,
    # A.X-K2: DeepSeek-V3.2 with gated norms; the experts outside the chosen groups keep a score of 0 for the choice.
    "axk2": {**DEEPSEEK_V3, "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "gated_norm_rank": 8},
    # Beam: DeepSeek-V3's router, whose scaling its block applies to the routed experts' sum; no shared expert;
    # sliding-window layers and a full-attention one without positions; two dense layers.
    "beam": {
        **{key: value for key, value in MOE_ARCHITECTURES["qwen3_moe"].items() if key != "decoder_sparse_step"},
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "num_hidden_layers": 3,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "sliding_window": 16,
    },
    # Flint: a sigmoid router without a correction bias; a shared expert added ungated; a dense first layer;
    # sliding-window layers with attention sinks.
    "flint": {**QWEN2_MOE, "mlp_only_layers": [0], "num_hidden_layers": 3, "sliding_window": 16},
    # Kolibri-1: a sigmoid router whose correction bias is added to the logits; a shared expert; every layer sparse.
    "kolibri1": {
        **{key: value for key, value in QWEN2_MOE.items() if key not in ("intermediate_size", "decoder_sparse_step")},
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # Laguna: tanh-capped router logits, sigmoid scores chosen with a correction bias; its block scales the routed
    # experts' sum before adding the shared expert; a dense first layer.
    "laguna": {
        **{key: value for key, value in QWEN2_MOE.items() if key not in ("decoder_sparse_step", "norm_topk_prob")},
        "moe_routed_scaling_factor": 2.5,
        "moe_router_logit_softcapping": 3.0,
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    },
    # LaraMini: Flint's block with a softmax router; Gated DeltaNet (linear), sliding-window and full-attention layers.
    "lara_mini": {
        **{key: value for key, value in QWEN2_MOE.items() if key not in ("intermediate_size", "decoder_sparse_step")},
        **HYBRID_ATTENTION,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "sliding_attention", "full_attention"],
        "sliding_window": 16,
    },
    # MiniMax-Text-01: Mixtral's block; lightning attention (linear) in one of two layers.
    "minimax": {**EXPERTS_BY_INTERMEDIATE_SIZE, "layer_types": ["linear_attention", "full_attention"]},
    # Phi-3.5-MoE: SparseMixer's router, two experts a token drawn at random in training (the tests seed each run), the
    # tokens jittered by its block and again by its router; a tolerance (router_jitter_noise) wide enough that about
    # half the tokens have a second candidate (Phi-3.5-MoE's own: 0.01, and 0.01 of input noise).
    "phimoe": {**EXPERTS_BY_INTERMEDIATE_SIZE, "router_jitter_noise": 0.3, "input_jitter_noise": 0.05},
    # Jamba: the top-k softmax probabilities not renormalized; Mamba layers but the attention one (the second), sparse
    # and dense MLPs alternating.
    "jamba": {
        **{key: EXPERTS_BY_INTERMEDIATE_SIZE[key] for key in ("num_key_value_heads", "tie_word_embeddings")},
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 0,
    },
    # Granite-4.0's layouts: Granite-MoE's block and a shared MLP beside it, with Mamba-2 layers (hybrid) or
    # sliding-window attention.
    "granitemoehybrid": {
        **GRANITE_MOE,
        "shared_intermediate_size": 48,
        "layer_types": ["linear_attention", "full_attention"],
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 16,
    },
    "granitemoe_swa": {**GRANITE_MOE, "sliding_window": 16},
    # Nemotron-H (Nemotron-3-Nano's layout): DeepSeek-V3's router; ungated experts, down(relu2(up(x))), between a
    # latent projection down from the hidden size and one back up (Nemotron-3-Super's; Nano's are identities); a Mamba-2
    # layer, an attention layer and a sparse one.
    "nemotron_h": {
        **{key: DEEPSEEK_V3[key] for key in ("tie_word_embeddings", "moe_intermediate_size", "n_routed_experts")},
        **{key: DEEPSEEK_V3[key] for key in ("num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor")},
        "layers_block_type": ["linear_attention", "moe", "full_attention"],
        "num_hidden_layers": 3,
        "head_dim": 16,
        "num_key_value_heads": 2,
        "moe_shared_expert_intermediate_size": 48,
        "moe_latent_size": 32,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "n_groups": 2,
        "chunk_size": 16,
    },
    # DeepSeek-V4: the square roots of the logits' softplus, chosen with a correction bias, renormalized and scaled, in
    # its second layer; in its first (mlp_layer_types "hash_moe") the experts are its router's table's at the token
    # ids; experts with a SwiGLU limit low enough to act here, a shared expert; hyper-connections of 2 streams,
    # attention with one key-value head over a sliding window and compressed keys (CSA with an indexer, HCA).
    "deepseek_v4": {
        "tie_word_embeddings": False,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "partial_rotary_factor": 0.5,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 0.05,
        "mlp_layer_types": ["hash_moe", "moe"],
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 16,
        "hc_mult": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 16,
    },
    # LongCat-Flash: softmax scores over 8 SiLU-gated experts and 2 zero-computation (identity) ones, 2 a token chosen
    # with a correction bias, not renormalized, scaled; each decoder layer holds two MLA attentions, two dense MLPs and
    # the MoE block as a shortcut beside them (num_hidden_layers counts the attentions: 2 decoder layers; transformers
    # 5.17 reads num_layers). The rotary width is head_dim, which its configs set to qk_rope_head_dim.
    "longcat_flash": {
        "tie_word_embeddings": False,
        "num_hidden_layers": 4,
        "num_layers": 2,
        "ffn_hidden_size": 64,
        "expert_ffn_hidden_size": 32,
        "n_routed_experts": 8,
        "zero_expert_num": 2,
        "moe_topk": 2,
        "routed_scaling_factor": 2.5,
        **{key: DEEPSEEK_V3[key] for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")},
        "v_head_dim": 16,
        "head_dim": 8,
    },
    # DBRX: a softmax router whose top-k probabilities are divided by their p-norm (moe_normalize_expert_weights; 1:
    # their sum), its Linear the router's child layer; SiLU-gated experts held as 2-D (experts x width, hidden) slabs
    # (w1 gate, v1 up, w2 down: each expert's rows (in, out) for down); fused query-key-value attention clipped at
    # clip_qkv. transformers 5.24 copies d_model into ffn_config before the standard keys land, and clamps with
    # clip_qkv unconditionally; its attention reads a rope_theta of attn_config's.
    "dbrx": {
        "d_model": 64,
        "tie_word_embeddings": False,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    },
    # Cohere2-MoE: sigmoid scores of the top-k logits renormalized (its other choice, their softmax, is Mixtral's rule),
    # a shared expert averaged with the routed ones, a dense first layer, attention and MLP in parallel.
    "cohere2_moe": {
        **{key: value for key, value in EXPERTS_BY_INTERMEDIATE_SIZE.items() if key != "num_local_experts"},
        "num_experts": 8,
        "expert_selection_fn": "sigmoid",
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "prefix_dense_intermediate_size": 128,
        "num_hidden_layers": 3,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    # Qwen4-Exp's text model: the Qwen2-MoE family's block, between hyper-connections (two residual streams), with
    # linear attention (Gated DeltaNet) and an attention layer whose indexer keeps every token of these batches.
    "qwen4_exp_text": {
        **QWEN2_MOE,
        **{key: HYBRID_ATTENTION[key] for key in HYBRID_ATTENTION if key.startswith("linear_")},
        "layer_types": ["linear_attention", "full_attention"],
        "hc_count": 2,
        "hc_lowrank": 8,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 32,
        "indexer_compress_ratio": 4,
    },
    # JetMoE: a softmax of the top-k logits; the experts a pair of modules (input_linear, output_linear) and a bias
    # added to the block's output; the attention a mixture of 4 query/output experts too (2 a token, 2 key/value heads
    # each: 4 query heads), which stays on transformers' code.
    "jetmoe": {
        "kv_channels": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    # Gemma 4 (26B-A4B's layout): the decoder layer is the MoE block, GELU-tanh-gated routed experts beside a dense MLP
    # on the same residual, each through norms of its own; the router normalizes and scales its input, and each chosen
    # weight by its expert's per_expert_scale. A sliding-window layer, then a full-attention one with wider heads and
    # keys as values (attention_k_eq_v); no per-layer inputs.
    "gemma4_text": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "intermediate_size": 128,
        "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
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

"""Named shapes of real models as transformers configs: ``shardtune bench`` builds them with random
weights, so nothing is downloaded. Any HF ``config.json`` (or a directory holding one) works too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from shardtune.errors import InputError

SHAPES = {
    # meta-llama/Llama-3.2-1B: 16 layers, 1.24B parameters (tied embeddings).
    "llama3.2-1b": (
        "llama",
        {
            "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        },
    ),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 8.03B parameters.
    "llama3-8b": (
        "llama",
        {
            "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        },
    ),
    # mistralai/Mistral-7B-v0.1: 32 layers, 7.24B parameters.
    "mistral-7b": (
        "mistral",
        {
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "sliding_window": None,
        },
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, 128 experts (8 active), 30.5B total / 3.3B active parameters.
    "qwen3-30b-a3b": (
        "qwen3_moe",
        {
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "norm_topk_prob": True,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    ),
    # zai-org/GLM-4.5-Air: 46 layers (the first dense), 128 routed + 1 shared expert (8 active), 106B / 12B.
    "glm-4.5-air": (
        "glm4_moe",
        {
            "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
            "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
            "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
            "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # zai-org/GLM-4.7: the glm4_moe architecture of GLM-4.5 and GLM-4.6 at GLM-4.5's size (slime's
    # glm4.5-355B-A32B model arguments; transformers' Glm4Moe docs cover all three; NVIDIA Megatron Bridge's GLM-4.7
    # page) with GLM-4.6's 202,752 positions: 92 layers, the first 3 dense (12,288 wide), then 160 routed experts
    # (1,536 wide, 8 active, sigmoid routing scaled by 2.5) and 1 shared expert. As transformers builds it, without
    # the multi-token-prediction layer it leaves out: 352.9B parameters (358B with that layer).
    "glm-4.7": (
        "glm4_moe",
        {
            "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
            "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
            "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
            "max_position_embeddings": 202752, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts (2 active), 46.7B / 12.9B.
    "mixtral-8x7b": (
        "mixtral",
        {
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # deepseek-ai/DeepSeek-V2-Lite: 27 layers (the first dense), MLA attention without a query compression, 64 routed
    # experts (6 active, softmax routing, greedy top-k) and 2 shared ones; 15.7B / 2.4B.
    "deepseek-v2-lite": (
        "deepseek_v2",
        {
            "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
            "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    ),
    # baidu/ERNIE-4.5-21B-A3B-PT: 28 layers (the first dense), 64 routed experts (6 active, softmax scores chosen
    # with a correction bias) and 2 shared ones, tied embeddings; 21.8B / 3B.
    "ernie-4.5-21b-a3b": (
        "ernie4_5_moe",
        {
            "vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288, "moe_intermediate_size": 1536,
            "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128,
            "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_k": 6, "moe_layer_start_index": 1,
            "moe_layer_interval": 1, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "use_bias": False, "tie_word_embeddings": True,
        },
    ),
    # openai/gpt-oss-20b: 24 layers alternating sliding-window (128) and full attention with sinks, 32 experts (4
    # active; transposed, biased, clamped GLU) on every layer; 20.9B / 3.6B. Its experts ship in MXFP4; transformers
    # trains them in bf16, as built here.
    "gpt-oss-20b": (
        "gpt_oss",
        {
            "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
            "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,  # layer_types: the config's default, sliding and full in turn
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096,
            },
            "swiglu_limit": 7.0, "tie_word_embeddings": False,
        },
    ),
    # meta-llama/Llama-4-Scout-17B-16E (its text model): 48 layers, each an MoE block of 16 routed experts (1 active,
    # its routing weight scaling the expert's input) and a shared one; chunked attention (8,192) in three of four
    # layers, the fourth without rotary positions; 107.8B / 17.2B.
    "llama4-scout-17b-16e": (
        "llama4_text",
        {
            "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8192, "use_qk_norm": True, "max_position_embeddings": 10485760,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},  # its llama3 scaling aside
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        },
    ),
    # google/gemma-4-26B-A4B-it (its text model, as its config.json's text_config gives it: read from MaxText's
    # gemma4-26b config and from other readers of that file, which agree): 30 layers, five of each six with
    # sliding-window attention (1,024), the sixth full attention (512-wide heads, 2 key-value heads, the keys serving as
    # values too); in each layer a dense MLP (2,112 wide) beside 128 routed experts (704 wide, 8 active,
    # GELU-tanh-gated); as transformers builds it, 25.2B / 3.8B parameters, Google's published counts.
    "gemma4-26b-a4b": (
        "gemma4_text",
        {
            "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
            "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
            "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "hidden_size_per_layer_input": 0,
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024, "final_logit_softcapping": 30.0,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        },
    ),
    # LiquidAI/LFM2-8B-A1B: 24 layers, 18 of them gated short convolutions and 6 grouped-query attention (layers 2, 6,
    # 10, 14, 18 and 21), the first two with a dense MLP, the rest 32 routed experts (1,792 wide, 4 active, sigmoid
    # scores with a correction bias); as transformers builds it, 8.3B / 1.6B parameters (Liquid AI's counts: 8.3B /
    # 1.5B).
    "lfm2-8b-a1b": (
        "lfm2_moe",
        {
            "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
            "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8, "num_dense_layers": 2,
            "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "conv_L_cache": 3, "conv_bias": False,
            "layer_types": [
                "full_attention" if layer in (2, 6, 10, 14, 18, 21) else "conv" for layer in range(24)
            ],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "max_position_embeddings": 128000, "norm_eps": 1e-5, "tie_word_embeddings": True,
        },
    ),
    # microsoft/Phi-3.5-MoE-instruct: 32 layers, 16 experts (6,400 wide) of which 2 per token, chosen by sparsemixer
    # (sampled in training, with router and input jitter); biased attention and LM head, LayerNorms; 41.9B / 6.6B
    # parameters (its long-context rope scaling left out: these sequences stay within its original 4,096 positions).
    "phi3.5-moe": (
        "phimoe",
        {
            "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
            "router_jitter_noise": 0.01, "input_jitter_noise": 0.01, "attention_bias": True, "lm_head_bias": True,
            "sliding_window": 131072, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
        },
    ),
    # jetmoe/jetmoe-8b: 24 layers, each with a mixture of 8 attention experts (query and output projections, 2 per
    # token, sharing one key-value projection) and of 8 MLP experts (5,632 wide, 2 per token); 8.5B / 2.2B parameters.
    "jetmoe-8b": (
        "jetmoe",
        {
            "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "num_key_value_heads": 16,
            "kv_channels": 128, "intermediate_size": 5632, "num_local_experts": 8, "num_experts_per_tok": 2,
            "activation_function": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": True,
        },
    ),
    # databricks/dbrx-base: 40 layers, 16 experts (10,752 wide) of which 4 per token, stored as 2-D slabs; query,
    # key and value clipped at 8; 131.6B / 36.5B parameters (--layers 8 fits one H200 with HF + PEFT beside it).
    "dbrx": (
        "dbrx",
        {
            "vocab_size": 100352, "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768,
            "attn_config": {"clip_qkv": 8.0, "kv_n_heads": 8, "rope_theta": 500000.0},
            "ffn_config": {
                "ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4,
                "moe_jitter_eps": 0.0, "moe_loss_weight": 0.05, "moe_normalize_expert_weights": 1.0,
            },
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False,
        },
    ),
    # google/gemma-2-9b: 42 layers, sliding-window (4,096) and full attention alternating, the attention scores and
    # the logits capped by tanh (at 50 and 30): no sdpa, so training on a GPU takes FlexAttention; 9.2B parameters
    # (tied embeddings).
    "gemma2-9b": (
        "gemma2",
        {
            "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    # google/gemma-3-12b-it's text model (its config.json's text_config): 48 layers, five of each six with
    # sliding-window attention (1,024), the sixth full; qk-norm, no capped scores or logits; 11.8B parameters (tied
    # embeddings; its linear rope scaling for 128k positions left out: it changes no shape).
    "gemma3-12b": (
        "gemma3_text",
        {
            "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
            "sliding_window": 1024, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        },
    ),
    # Tiny stand-ins to try the benchmarks on a CPU.
    "llama-tiny": (
        "llama",
        {
            "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-moe-tiny": (
        "qwen3_moe",
        {
            "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        },
    ),
}  # fmt: skip


# Hub ids of the models above -> (shape, where the model's own config.json differs from the shape): what
# ``shardtune plan`` sizes a hub model by without its config.json. The Mistral and Llama 3 shapes stretch their
# positions for long-sequence benchmarks; the hub configs' own values come back here.
MISTRAL_V01 = {"max_position_embeddings": 32768, "sliding_window": 4096}
# v0.3: a 32,768-token vocabulary and rope theta 1e6, no sliding window.
MISTRAL_V03 = {"vocab_size": 32768, "rope_theta": 1e6, "max_position_embeddings": 32768}
HUB_SHAPES = {
    "mistralai/Mistral-7B-v0.1": ("mistral-7b", MISTRAL_V01),
    "mistralai/Mistral-7B-Instruct-v0.1": ("mistral-7b", MISTRAL_V01),
    "mistralai/Mistral-7B-v0.3": ("mistral-7b", MISTRAL_V03),
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral-7b", MISTRAL_V03),
    "meta-llama/Meta-Llama-3-8B": ("llama3-8b", {"max_position_embeddings": 8192}),
    "meta-llama/Llama-3.2-1B": ("llama3.2-1b", {}),
    "Qwen/Qwen3-30B-A3B": ("qwen3-30b-a3b", {}),
    "zai-org/GLM-4.5-Air": ("glm-4.5-air", {}),
    "zai-org/GLM-4.7": ("glm-4.7", {}),
    "mistralai/Mixtral-8x7B-v0.1": ("mixtral-8x7b", {}),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("mixtral-8x7b", {}),
    "deepseek-ai/DeepSeek-V2-Lite": ("deepseek-v2-lite", {}),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": ("deepseek-v2-lite", {}),
    "baidu/ERNIE-4.5-21B-A3B-PT": ("ernie-4.5-21b-a3b", {}),
    "openai/gpt-oss-20b": ("gpt-oss-20b", {}),
    "meta-llama/Llama-4-Scout-17B-16E": ("llama4-scout-17b-16e", {}),
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": ("llama4-scout-17b-16e", {}),
    "google/gemma-4-26B-A4B": ("gemma4-26b-a4b", {}),
    "google/gemma-4-26B-A4B-it": ("gemma4-26b-a4b", {}),
    "LiquidAI/LFM2-8B-A1B": ("lfm2-8b-a1b", {}),
    "microsoft/Phi-3.5-MoE-instruct": ("phi3.5-moe", {}),
    "jetmoe/jetmoe-8b": ("jetmoe-8b", {}),
    "databricks/dbrx-base": ("dbrx", {}),
    "databricks/dbrx-instruct": ("dbrx", {}),
    "google/gemma-2-9b": ("gemma2-9b", {}),
    "google/gemma-2-9b-it": ("gemma2-9b", {}),
}


def shape_config(name: str, layers: int | None = None, **overrides) -> PretrainedConfig:
    """A named shape, a hub id of ``HUB_SHAPES``, or the config of a ``config.json`` path or a model directory,
    with ``overrides``; ``layers`` keeps only the first that many decoder layers (the dense first layers of
    GLM-4.5 and DeepSeek-style models stay)."""
    if layers is not None and layers <= 0:
        raise InputError(f"--layers: must be positive, got {layers}")
    # Here, not at the top: the command line's parser lists SHAPES, and transformers takes a second to import.
    from transformers import AutoConfig

    from shardtune.model.load import read_pretrained_config

    if name in HUB_SHAPES:
        shape, differences = HUB_SHAPES[name]
        return shape_config(shape, layers, **{**differences, **overrides})
    if name in SHAPES:
        model_type, values = SHAPES[name]
        values = {**values, **overrides}
        if layers:
            check_layers_kept(name, AutoConfig.for_model(model_type, **values), layers)
            values["num_hidden_layers"] = layers
            if "layer_types" in values:  # the attention kinds of a hybrid model follow the layers kept
                values["layer_types"] = values["layer_types"][:layers]
        return AutoConfig.for_model(model_type, **values)
    path = Path(name)
    if path.is_file() or (path / "config.json").is_file():
        config = read_pretrained_config(path.parent if path.is_file() else path)
        for key, value in overrides.items():
            setattr(config, key, value)
        if layers is not None:
            check_layers_kept(name, config, layers)
            text = config.get_text_config()
            text.num_hidden_layers = layers
            # Per-layer lists (attention kinds of hybrid models) follow the layers kept.
            if isinstance(getattr(text, "layer_types", None), list):
                text.layer_types = text.layer_types[:layers]
        return config
    raise InputError(
        f"--shape {name}: neither a named shape ({', '.join(SHAPES)}), a hub id of one, nor a config.json or "
        "model directory"
    )


def check_layers_kept(name: str, config: PretrainedConfig, layers: int) -> None:
    """``--layers`` keeps the first that many decoder layers: more than the model has would build a model of
    another shape (repeating no real layer), not a cut of this one."""
    have = config.get_text_config().num_hidden_layers
    if layers > have:
        raise InputError(f"--layers {layers}: {name} has {have} decoder layers; --layers keeps the first N of them")

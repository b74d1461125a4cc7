"""The FLOP model of MFU against hand counts and against the parameters of the models themselves (built on
the meta device): active weights only for MoE, frozen weights at 4 FLOPs, adapters at 6, attention scores
in full."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.bench.shapes import shape_config
from shardtune.metrics.flops import active_matmul_params, run_token_flops, token_flops


def test_qwen3_30b_a3b_by_hand():
    config = shape_config("qwen3-30b-a3b")
    attention = 2 * 2048 * (32 * 128) + 2 * 2048 * (4 * 128)
    sparse = attention + 2048 * 128 + 8 * 3 * 2048 * 768  # router + 8 of 128 experts (SwiGLU: 3 matrices)
    assert active_matmul_params(config) == 48 * sparse + 151936 * 2048 == 3_041_656_832
    # Qwen-MoE's dense layers: mlp_only_layers and decoder_sparse_step.
    mixed = shape_config("qwen3-30b-a3b", mlp_only_layers=[0, 5])
    dense = attention + 3 * 2048 * 6144
    assert active_matmul_params(mixed) == 2 * dense + 46 * sparse + 151936 * 2048
    every_other = shape_config("qwen3-30b-a3b", decoder_sparse_step=2, num_hidden_layers=4)
    assert active_matmul_params(every_other) == 2 * dense + 2 * sparse + 151936 * 2048


def test_glm_shapes_by_hand():
    air = shape_config("glm-4.5-air")  # first layer dense, then 8 routed + 1 shared expert per token
    attention = 2 * 4096 * (96 * 128) + 2 * 4096 * (8 * 128)
    dense, sparse = attention + 3 * 4096 * 10944, attention + 4096 * 128 + 9 * 3 * 4096 * 1408
    assert active_matmul_params(air) == dense + 45 * sparse + 151552 * 4096
    glm47 = shape_config("glm-4.7")  # 3 dense layers, 160 routed experts
    attention = 2 * 5120 * (96 * 128) + 2 * 5120 * (8 * 128)
    dense, sparse = attention + 3 * 5120 * 12288, attention + 5120 * 160 + 9 * 3 * 5120 * 1536
    assert active_matmul_params(glm47) == 3 * dense + 89 * sparse + 151552 * 5120
    # --layers keeps the dense first layer: 1 dense + 3 sparse.
    assert (
        active_matmul_params(shape_config("glm-4.5-air", layers=4))
        == (attention_air := 2 * 4096 * 12288 + 2 * 4096 * 1024)
        + 3 * 4096 * 10944
        + 3 * (attention_air + 4096 * 128 + 9 * 3 * 4096 * 1408)
        + 151552 * 4096
    )


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-30b-a3b",
        "glm-4.5-air",
        "glm-4.7",
        "mixtral-8x7b",
        "deepseek-v2-lite",
        "ernie-4.5-21b-a3b",
        "gpt-oss-20b",
        "llama4-scout-17b-16e",
        "gemma4-26b-a4b",
        "lfm2-8b-a1b",
        "phi3.5-moe",
        "dbrx",
    ],
)
def test_active_weights_match_the_built_model(name):
    """Every matmul weight of the model itself, with each routed expert's weights counted top_k / E times."""
    config = shape_config(name, layers=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    ffn = getattr(text, "ffn_config", None)  # DBRX keeps its MoE settings there
    experts = (
        getattr(text, "num_experts", None)
        or getattr(text, "n_routed_experts", None)
        or getattr(text, "num_local_experts", None)
        or ffn.moe_num_experts
    )
    active = 0.0
    for parameter_name, parameter in model.named_parameters():
        if parameter.dim() < 2 or parameter is model.get_input_embeddings().weight:
            continue  # norms, biases, correction biases; the input embedding is a lookup
        top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None) or ffn.moe_top_k
        share = top_k / experts if ".experts." in parameter_name else 1.0
        active += parameter.numel() * share
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:  # tied (ERNIE 4.5, Gemma 4): the head's matmul takes the embedding
        active += head.numel()
    assert active_matmul_params(config) == pytest.approx(active, rel=1e-12)


def test_only_the_layers_that_compute_attention_scores_count_them():
    """LFM2-8B-A1B: 6 of its 24 layers are attention, the others short convolutions (no attention scores);
    --layers keeps the first layers' kinds (4 layers: one attention layer, the third)."""
    config = shape_config("lfm2-8b-a1b")
    flops = token_flops(config, 4096, None)
    assert flops.layers == 6
    assert flops.per_token == 6 * active_matmul_params(config) + 12 * 6 * 2048 * 4096
    assert token_flops(shape_config("lfm2-8b-a1b", layers=4), 4096, None).layers == 1
    # A model without layer_types: every layer.
    assert token_flops(shape_config("qwen3-30b-a3b", layers=4), 4096, None).layers == 4


def test_lora_counts_frozen_weights_at_4_adapters_at_6_and_attention_in_full():
    config = shape_config("qwen3-30b-a3b")
    matmul, attention = 3_041_656_832, 12 * 48 * 4096 * 4096
    assert token_flops(config, 4096, None).per_token == 6 * matmul + attention
    # LoRA on attention: 13.4M adapter weights, all used by every token.
    assert run_token_flops(config, 4096, True, 13_369_344).per_token == 4 * matmul + 6 * 13_369_344 + attention
    # LoRA on attention + routed experts: a token uses 8 of the 128 experts' adapters.
    routed = 629_145_600
    flops = run_token_flops(config, 4096, True, 13_369_344 + routed, routed_trainable=routed)
    assert flops.adapter_params == 13_369_344 + routed * 8 // 128
    assert flops.per_token == 4 * matmul + 6 * (13_369_344 + routed // 16) + attention
    assert run_token_flops(config, 4096, False, 30_000_000_000).per_token == 6 * matmul + attention


def test_routed_expert_adapters_are_told_apart(tmp_path):
    """Of LoRA on attention, shared and routed experts (tiny GLM-4.5 layout: 3 layers, the first dense, 8
    routed experts of which 2 per token), only the routed experts' adapters count at top_k / num_experts."""
    from tiny_models import MOE_ARCHITECTURES, write_tiny_model
    from transformers import AutoConfig

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.metrics.flops import routed_expert_trainable
    from shardtune.model.lora import apply_lora, count_parameters
    from shardtune.model.moe import find_moe_blocks

    directory = write_tiny_model(tmp_path / "glm", "glm4_moe")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    blocks = find_moe_blocks(model, decoder_layers(model))
    groups = ["attention", "shared_experts", "routed_experts"]
    model = apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, moe_targets=groups))
    trainable, _ = count_parameters(model)
    spec = MOE_ARCHITECTURES["glm4_moe"]
    hidden, moe_inter, experts = 64, spec["moe_intermediate_size"], spec["n_routed_experts"]
    # PEFT's per-expert update of fused (experts, out, in) tensors, in the 2 sparse layers.
    routed = 2 * 4 * experts * ((hidden + 2 * moe_inter) + (moe_inter + hidden))
    assert routed_expert_trainable(blocks) == routed < trainable
    flops = run_token_flops(model.config, 64, True, trainable, routed)
    top_k = AutoConfig.from_pretrained(directory).num_experts_per_tok
    assert flops.adapter_params == trainable - routed + routed * top_k // experts


def test_jetmoe_counts_its_mixture_of_attention_experts_at_top_k_of_them(tmp_path):
    """JetMoE's attention is a mixture of query/output experts (JetMoeMoA, on transformers' code): a token passes
    through top_k / num_experts of their weights and adapters, as of its MLP's pair of expert modules; their routers
    and the key/value projection in full."""
    from tiny_models import FUSED_MOE_ARCHITECTURES, write_tiny_model
    from transformers import AutoConfig

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.metrics.flops import routed_expert_trainable
    from shardtune.model.lora import apply_lora
    from shardtune.model.moe import find_moe_blocks

    if "jetmoe" not in FUSED_MOE_ARCHITECTURES:
        pytest.skip("this transformers has no JetMoE")
    config = AutoConfig.from_pretrained(write_tiny_model(tmp_path / "jetmoe", "jetmoe"))
    hidden, width, experts, top_k = config.hidden_size, config.intermediate_size, 4, 2
    assert (config.num_local_experts, config.num_experts_per_tok) == (experts, top_k)
    attention_width = config.num_key_value_heads * config.kv_channels  # each attention expert's query width
    mlp_experts = experts * (2 * width * hidden + hidden * width)
    attention_experts = experts * 2 * attention_width * hidden
    dense = 2 * experts * hidden + hidden * 2 * attention_width  # the two routers, kv_proj
    layer = (mlp_experts + attention_experts) * top_k / experts + dense
    head = config.vocab_size * hidden  # tied: the head's matmul takes the embedding
    assert active_matmul_params(config) == pytest.approx(config.num_hidden_layers * layer + head, rel=1e-12)

    model = AutoModelForCausalLM.from_config(config)
    blocks = find_moe_blocks(model, decoder_layers(model))
    groups = ["attention", "routed_experts"]
    model = apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, moe_targets=groups))
    rank = 4 * experts  # PEFT's per-expert factors: (r * E, in) and (out, r * E)
    mlp = rank * (hidden + 2 * width) + rank * (width + hidden)
    attention = 2 * rank * (hidden + attention_width)
    layers = config.num_hidden_layers
    assert routed_expert_trainable(blocks) == layers * mlp
    assert routed_expert_trainable(blocks, model) == layers * (mlp + attention)

"""Model FLOPs per trained token and model FLOPs utilization (MFU), in the Megatron/NeMo convention.

Full fine-tuning: 6 FLOPs per matmul parameter and token (forward 2, input gradients 2, weight
gradients 2) plus the attention scores, 12 x layers x attention width x sequence length (QK^T and AV,
forward and backward, counted over the whole sequence as Megatron, NeMo and torchtitan do, though a
causal mask skips half). The matmul parameters are those a token passes through: every weight except
the input embedding (a lookup), and for MoE models only the experts a token is routed to (top_k routed
plus the shared ones), not all of them.

LoRA: frozen weights skip their weight gradients, so a step costs (2 + P_lora / P_frozen) / 3 of full
fine-tuning's FLOPs (P_lora the adapter's parameters, P_frozen the model's). Recomputation under
activation checkpointing is not counted: MFU measures useful work. Peak: dense bf16 of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peak, FLOP/s (SXM parts; PCIe H100 is lower and named "H100 PCIe").
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12}


@dataclass(frozen=True)
class TokenFlops:
    matmul_params: int  # parameters a token passes through (active ones for MoE)
    layers: int
    attention_width: int  # heads x head_dim
    # Tokens per sequence; a token-weighted mean (sum of squared lengths / sum of lengths) for sequences
    # of mixed lengths, which makes per_token x tokens the exact sum of every sequence's attention cost.
    sequence_length: float
    lora_fraction: float | None  # P_lora / P_frozen for LoRA, None for full fine-tuning

    @property
    def per_token(self) -> float:
        full = 6 * self.matmul_params + 12 * self.layers * self.attention_width * self.sequence_length
        return full if self.lora_fraction is None else full * (2 + self.lora_fraction) / 3


def active_matmul_params(config) -> int:
    """Weights one token passes through, from a transformers config (dense or MoE): attention, MLP or
    router + top_k routed + shared experts per layer, and the LM head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    expert_keys = ("num_experts", "n_routed_experts", "num_local_experts")
    experts = next((getattr(config, key) for key in expert_keys if getattr(config, key, None)), None)
    dense_mlp = 3 * hidden * config.intermediate_size
    if not experts:
        per_layer = [attention + dense_mlp] * layers
    else:
        expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "n_shared_experts", None) or 0
        active = config.num_experts_per_tok + shared
        sparse = attention + hidden * experts + active * 3 * hidden * expert_width
        dense_layers = getattr(config, "first_k_dense_replace", 0) or 0
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse_layers = [i >= dense_layers and (i + 1) % step == 0 for i in range(layers)]
        per_layer = [sparse if is_sparse else attention + dense_mlp for is_sparse in sparse_layers]
    return sum(per_layer) + config.vocab_size * hidden


def token_flops(config, sequence_length: float, lora_params: int | None, frozen_params: int | None) -> TokenFlops:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return TokenFlops(
        matmul_params=active_matmul_params(text),
        layers=text.num_hidden_layers,
        attention_width=text.num_attention_heads * head_dim,
        sequence_length=sequence_length,
        lora_fraction=None if lora_params is None else lora_params / max(frozen_params or 1, 1),
    )


def run_token_flops(model_config, sequence_length: float, lora: bool, trainable: int, total: int) -> TokenFlops:
    """The FLOP model of a run: LoRA runs count their trainable parameters as the adapter, the rest as frozen."""
    return token_flops(model_config, sequence_length, trainable if lora else None, total - trainable if lora else None)


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The dense bf16 peak of a device by its name (longest matching key), or None when unknown;
    ``override_tflops`` (``logging.peak_tflops``) wins, for devices the table lacks."""
    if override_tflops is not None:
        return override_tflops * 1e12
    matches = [key for key in PEAK_BF16_FLOPS if key in device_name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None

"""Model FLOPs per trained token and model FLOPs utilization (MFU), in the Megatron/NeMo convention.

Per token, over the weights a token passes through (every matmul weight except the input embedding, a
lookup; for MoE models only the router, the top_k routed experts and the shared experts of a sparse layer,
not all experts):

- full fine-tuning: 6 FLOPs per weight (forward 2, input gradients 2, weight gradients 2);
- LoRA: 4 per frozen weight (forward and input gradients; no weight gradients) and 6 per adapter weight
  a token passes through (all of them, except that adapters with one slice per routed expert count
  top_k / num_experts of their size);
- plus the attention scores, 12 x layers x attention width x sequence length (QK^T and AV, forward and
  backward, counted over the whole sequence as Megatron, NeMo and torchtitan do, though a causal mask
  skips half); LoRA needs all of it, since gradients flow through every layer's attention.

Recomputation under activation checkpointing is not counted: these are model FLOPs (useful work), not
hardware FLOPs. Peak: dense bf16 of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peak, FLOP/s (SXM parts; PCIe H100 is lower and named "H100 PCIe").
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12}


@dataclass(frozen=True)
class TokenFlops:
    matmul_params: int  # model weights a token passes through (active ones for MoE)
    layers: int
    attention_width: int  # heads x head_dim
    # Tokens per sequence; a token-weighted mean (sum of squared lengths / sum of lengths) for sequences
    # of mixed lengths, which makes per_token x tokens the exact sum of every sequence's attention cost.
    sequence_length: float
    adapter_params: int | None  # LoRA: adapter weights a token passes through; None for full fine-tuning

    @property
    def per_token(self) -> float:
        attention = 12 * self.layers * self.attention_width * self.sequence_length
        if self.adapter_params is None:
            return 6 * self.matmul_params + attention
        return 4 * self.matmul_params + 6 * self.adapter_params + attention


EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def routed_experts(config) -> int | None:
    """The number of routed experts of an MoE config, None for a dense one."""
    return next((getattr(config, key) for key in EXPERT_COUNT_KEYS if getattr(config, key, None)), None)


def sparse_layers(config) -> list[bool]:
    """Per decoder layer, whether its MLP is a sparse MoE block: not one of GLM-4.5's / DeepSeek's first
    ``first_k_dense_replace`` dense layers, on Qwen-MoE's ``decoder_sparse_step`` and not in its
    ``mlp_only_layers``."""
    dense_first = getattr(config, "first_k_dense_replace", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense_listed = set(getattr(config, "mlp_only_layers", None) or [])
    return [i >= dense_first and (i + 1) % step == 0 and i not in dense_listed for i in range(config.num_hidden_layers)]


def sparse_mlp_params(config) -> int:
    """Weights a token passes through in one sparse MoE block: the router, its top_k routed experts and the
    shared experts (DeepSeek / GLM: n_shared_experts of the routed experts' width; Qwen2-MoE: one of
    shared_expert_intermediate_size with its sigmoid gate)."""
    hidden = config.hidden_size
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = (getattr(config, "n_shared_experts", None) or 0) * 3 * hidden * expert_width
    if getattr(config, "shared_expert_intermediate_size", None):
        shared += 3 * hidden * config.shared_expert_intermediate_size + hidden
    return hidden * routed_experts(config) + config.num_experts_per_tok * 3 * hidden * expert_width + shared


def active_matmul_params(config) -> int:
    """Weights one token passes through, from a transformers config (dense or MoE): attention, MLP or
    router + top_k routed + shared experts per layer, and the LM head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    dense_mlp = 3 * hidden * config.intermediate_size
    if not routed_experts(config):
        per_layer = [attention + dense_mlp] * layers
    else:
        sparse = attention + sparse_mlp_params(config)
        per_layer = [sparse if is_sparse else attention + dense_mlp for is_sparse in sparse_layers(config)]
    return sum(per_layer) + config.vocab_size * hidden


def token_flops(config, sequence_length: float, adapter_params: int | None) -> TokenFlops:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return TokenFlops(
        matmul_params=active_matmul_params(text),
        layers=text.num_hidden_layers,
        attention_width=text.num_attention_heads * head_dim,
        sequence_length=sequence_length,
        adapter_params=adapter_params,
    )


def routed_expert_trainable(blocks) -> int:
    """Trainable parameters inside the routed experts of MoE blocks (``shardtune.model.moe.MoeBlock``),
    adapters included: per-expert adapters a token uses top_k / num_experts of."""
    return sum(
        parameter.numel()
        for block in blocks
        for name, parameter in block.block.named_parameters()
        if parameter.requires_grad and name.split(".", 1)[0] == "experts"
    )


def run_token_flops(
    model_config, sequence_length: float, lora: bool, trainable: int, routed_trainable: int = 0
) -> TokenFlops:
    """The FLOP model of a run: LoRA runs count their trainable parameters as the adapter (those inside
    routed experts at top_k / num_experts), full fine-tuning all active weights at 6."""
    if not lora:
        return token_flops(model_config, sequence_length, None)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    used = text.num_experts_per_tok / routed_experts(text) if routed_trainable else 1.0
    return token_flops(model_config, sequence_length, round(trainable - routed_trainable * (1 - used)))


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The dense bf16 peak of a device by its name (longest matching key), or None when unknown;
    ``override_tflops`` (``logging.peak_tflops``) wins, for devices the table lacks."""
    if override_tflops is not None:
        return override_tflops * 1e12
    matches = [key for key in PEAK_BF16_FLOPS if key in device_name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None

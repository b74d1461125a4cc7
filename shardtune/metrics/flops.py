"""Model FLOPs per trained token and model FLOPs utilization (MFU), in the Megatron/NeMo convention.

Per token, over the weights a token passes through, counted on the model's own modules whatever the
architecture calls them or however it fuses them (GPT-2's Conv1D, Falcon's and GPT-NeoX's fused
query_key_value, Phi-3's gate_up_proj): every weight of two or more dimensions except embedding lookups
(token and learned position embeddings) and LoRA adapters, plus the LM head even when it shares the input
embedding's weight; in an MoE block each routed expert weight counts top_k / num_experts of itself (the
router, the top_k routed experts and the shared experts a token passes through), and so does each expert weight of a
mixture of attention (JetMoE's query and output projections):

- full fine-tuning: 6 FLOPs per weight (forward 2, input gradients 2, weight gradients 2);
- LoRA: 4 per frozen weight (forward and input gradients; no weight gradients) and 6 per adapter weight
  a token passes through (all of them, except that adapters with one slice per routed expert count
  top_k / num_experts of their size);
- plus the attention scores, 12 x attention layers x attention width x sequence length (QK^T and AV, forward
  and backward, counted over the whole sequence as Megatron, NeMo and torchtitan do, though a causal mask
  skips half, and a sliding window more); LoRA needs all of it, since gradients flow through every layer's
  attention. The attention width comes from the config through transformers' own names for it
  (``num_attention_heads`` is GPT-2's ``n_head``). The attention layers are the decoder layers whose token
  mixer computes attention scores: in hybrid models not those of linear attention, Mamba mixers or short
  convolutions, by the config's ``layer_types``.

Recomputation under activation checkpointing is not counted: these are model FLOPs (useful work), not
hardware FLOPs. Peak: dense bf16 of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, PretrainedConfig

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.moe import ATTENTION_EXPERTS, EXPERT_PAIR_NAMES, ExpertPair, find_moe_blocks

# Dense bf16 tensor-core peak, FLOP/s (SXM parts; PCIe H100 is lower and named "H100 PCIe").
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12}


@dataclass(frozen=True)
class TokenFlops:
    matmul_params: int  # parameters a token passes through (active ones for MoE)
    layers: int  # the layers that compute attention scores (attention_layers)
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


def as_model(model: torch.nn.Module | PretrainedConfig) -> torch.nn.Module:
    """The model itself, or for a config the causal LM it describes, built on the meta device (no memory)."""
    if not isinstance(model, PretrainedConfig):
        return model
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model)


def active_matmul_params(model: torch.nn.Module | PretrainedConfig) -> int:
    """Weights one token passes through, counted on the model's modules (see the module docstring):
    for a transformers model (dense or MoE, under LoRA, FSDP or activation checkpointing) or its config."""
    model = as_model(model)
    moe_blocks = find_moe_blocks(model, decoder_layers(model))
    share = {id(param): block.top_k / block.num_experts for block in moe_blocks for param in block.experts.parameters()}
    share |= {id(param): used for param, used in attention_expert_parameters(model)}
    lookups = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    adapters = {
        id(param)
        for module in model.modules()
        if isinstance(module, BaseTunerLayer)
        for name in module.adapter_layer_names
        for param in getattr(module, name).parameters()
    }
    matmul = sum(
        param.numel() * share.get(id(param), 1)
        for param in model.parameters()
        if param.dim() >= 2 and id(param) not in lookups and id(param) not in adapters
    )
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in lookups:  # tied: the head's matmul uses the embedding's weight
        matmul += head.weight.numel()
    return round(matmul)


def attention_width(model: torch.nn.Module, heads_key: str = "num_attention_heads") -> int:
    """Query heads x head size: what one token's attention scores and weighted values cost per position, over the
    decoder layers (``layer_attention_widths``; Gemma 4's full-attention layers have other heads: their mean)."""
    widths = layer_attention_widths(model, heads_key)
    return round(sum(widths) / len(widths))


def layer_attention_widths(model: torch.nn.Module, heads_key: str = "num_attention_heads") -> list[int]:
    """Each decoder layer's query heads x head size, from its own config where the layers differ (transformers'
    per_layer_config: Gemma 4's full-attention layers have wider heads, and fewer key/value ones), else the model's;
    the hidden size when the config has no head size of its own (heads of hidden / heads each). With ``heads_key``
    ``num_key_value_heads``, the keys' (and values') width the same way."""
    text = model.config.get_text_config()
    hidden = getattr(text, "hidden_size", None) or model.get_input_embeddings().embedding_dim
    heterogeneous = getattr(text, "is_heterogeneous", False)
    widths = []
    for layer in list(text.per_layer_config) if heterogeneous else [text] * len(decoder_layers(model)):
        heads, head_dim = getattr(layer, "num_attention_heads", None), getattr(layer, "head_dim", None)
        counted = getattr(layer, heads_key, None) or heads
        if heads and head_dim:
            widths.append(counted * head_dim)
        else:
            widths.append(hidden * counted // heads if heads else hidden)
    return widths


# transformers' layer_types of the layers whose token mixer computes no attention scores: linear attention and Mamba
# mixers ("linear_attention"), LFM2's short convolutions ("conv"), Nemotron-H's layers of an MoE block alone ("moe").
NO_ATTENTION_SCORES = frozenset({"linear_attention", "conv", "moe"})


def attention_layers(model: torch.nn.Module) -> int:
    """The decoder layers of ``model`` that compute attention scores: all of them, but for hybrid models those
    whose ``layer_types`` entry (transformers' per-layer kind) is in ``NO_ATTENTION_SCORES``."""
    layers = len(decoder_layers(model))
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if not layer_types:
        return layers
    return sum(kind not in NO_ATTENTION_SCORES for kind in layer_types[:layers])


def token_flops(
    model: torch.nn.Module | PretrainedConfig, sequence_length: float, adapter_params: int | None
) -> TokenFlops:
    """The FLOP model of ``model`` (a transformers model, possibly under LoRA, FSDP or checkpointing, or
    its config) at ``sequence_length``; ``adapter_params``: LoRA's adapter weights a token passes through."""
    model = as_model(model)
    return TokenFlops(
        matmul_params=active_matmul_params(model),
        layers=attention_layers(model),
        attention_width=attention_width(model),
        sequence_length=sequence_length,
        adapter_params=adapter_params,
    )


def attention_expert_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, float]]:
    """The parameters of ``model``'s mixtures of attention's experts (``moe.ATTENTION_EXPERTS``: JetMoE's query and
    output projections, with their LoRA factors), each with the share of it a token passes through (top_k /
    num_experts); not their router."""
    return [
        (param, module.top_k / module.num_experts)
        for module in model.modules()
        if type(module).__name__ in ATTENTION_EXPERTS
        for name in EXPERT_PAIR_NAMES
        for param in getattr(module, name).parameters()
    ]


def routed_expert_trainable(blocks, model: torch.nn.Module | None = None) -> int:
    """Trainable parameters inside the routed experts of MoE blocks (``shardtune.model.moe.MoeBlock``),
    adapters included: per-expert adapters a token uses top_k / num_experts of; with ``model``, also those of its
    mixtures of attention's experts (JetMoE's, whose top_k and number of experts are its MLP's)."""
    routed = sum(
        parameter.numel()
        for block in blocks
        for name, parameter in block.block.named_parameters()
        if parameter.requires_grad
        and name.split(".", 1)[0] in (EXPERT_PAIR_NAMES if isinstance(block.experts, ExpertPair) else ("experts",))
    )
    attention = attention_expert_parameters(model) if model is not None else []
    return routed + sum(param.numel() for param, _ in attention if param.requires_grad)


def run_token_flops(
    model: torch.nn.Module | PretrainedConfig,
    sequence_length: float,
    lora: bool,
    trainable: int,
    routed_trainable: int = 0,
) -> TokenFlops:
    """The FLOP model of a run: LoRA runs count their trainable parameters as the adapter (those inside
    routed experts at top_k / num_experts), full fine-tuning all active weights at 6."""
    model = as_model(model)
    if not lora:
        return token_flops(model, sequence_length, None)
    used = 1.0
    if routed_trainable:
        block = find_moe_blocks(model, decoder_layers(model))[0]
        used = block.top_k / block.num_experts
    return token_flops(model, sequence_length, round(trainable - routed_trainable * (1 - used)))


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The dense bf16 peak of a device by its name (longest matching key), or None when unknown;
    ``override_tflops`` (``logging.peak_tflops``) wins, for devices the table lacks."""
    if override_tflops is not None:
        return override_tflops * 1e12
    matches = [key for key in PEAK_BF16_FLOPS if key in device_name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None

"""What the memory estimate needs to know about a model, read off the model exactly as training builds it
(``build_model``, LoRA adapters included) on the meta device: no weights are read or allocated.

``shardtune doctor`` builds it for the device it runs on; ``shardtune plan`` for the GPUs it plans for, from
the model's ``config.json`` when the model is on this machine, else from bench's shape of the hub model
(``shardtune.bench.shapes.HUB_SHAPES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardtune.config import Config, looks_local, model_path_problem
from shardtune.errors import ConfigError

# torch where it is used, not here: the command line imports this module to build its parser, and torch takes
# seconds to import.
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from shardtune.metrics.flops import TokenFlops
    from shardtune.model.load import Precision
    from shardtune.model.moe import MoeBlock

# Where configs of different families keep the MLP width (Llama, GPT-2, OPT, Falcon); 4 x hidden otherwise.
MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
# The names of the query and key RMSNorms of an attention that normalizes them (LFM2's are q_layernorm, k_layernorm)
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
# Matrices of a gated (SwiGLU) expert or MLP: gate, up and down, each hidden x width.
GATED_MATRICES = 3


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: the widths its activations have per token, and its FSDP units' sizes."""

    mlp_width: int  # a dense layer's MLP intermediate width; 0 in an MoE layer
    expert_row_width: int  # MoE: one routed row's first projection output (gated experts' 2I, ungated ones' I)
    top_k: int  # MoE: routed experts per token
    num_experts: int  # MoE: routed experts (0: a dense layer)
    shared_width: int  # MoE: the shared experts' intermediate width
    adapter_inputs: int  # LoRA: the input features of its adapted linear layers, summed (dropout copies them)
    expert_adapter_rank: int  # LoRA on the routed experts' first projection (gate/up, or up): its rank (0: none)
    params: int  # parameters outside its routed experts: one FSDP unit
    expert_params: int  # its routed experts' parameters: an FSDP unit of their own
    # Its query heads x head size and its key/value heads x head size (``metrics.flops.layer_attention_widths``): the
    # model's, but where the layers differ (Gemma 4's full-attention layers: wider heads, fewer key/value ones)
    attention_width: int
    kv_width: int
    sublayers: bool = True  # its attention and its MLP are modules of their own (``layer_sublayers``)
    qk_norm: bool = False  # its attention normalizes queries and keys (RMSNorm: Qwen3, GLM-4.5 with use_qk_norm)
    # Its attention normalizes the values too, which have a projection of their own (Gemma 4's v_norm beside v_proj;
    # its full-attention layers take the keys as the values, attention_k_eq_v)
    value_norm: bool = False
    # A mixture of attention experts (JetMoE's): per token, the elements its top_k query and output experts' rows keep
    # (``moe.ATTENTION_EXPERTS``, transformers' code; 0: none)
    attention_expert_rows: int = 0
    # MoE: the multiplicative noise tensors its block draws over the tokens in training (``jitter_noises``), each kept
    # for backward
    jitter_noises: int = 0
    # MoE: how many of its routed experts are identities (LongCat-Flash's zero-computation ones), which expert
    # parallelism splits apart from the GEMM experts (``ParallelDims.check_experts``)
    identity_experts: int = 0
    # sdpa as transformers calls it (``sdpa_key_values``): the elements per token its key and value heads, repeated to
    # the query heads, keep beyond the 2kv counted, and whether it takes a materialized mask (a sliding window shorter
    # than the sequence)
    repeated_kv: int = 0
    sliding_mask: bool = False
    # Eager attention (``eager_attention``): the score elements per token it computes (heads x S), each kept twice
    attention_scores: int = 0
    # sdpa's output laid out by token (``sdpa_key_values``), so that the output projection's input is that output itself
    token_major_output: bool = False
    # Norms of what its feed-forward computes, applied before the sum joins the residual (``post_norms``: Gemma's
    # post_feedforward_layernorm, and Gemma 4's _1 and _2 of its dense MLP's and routed experts' outputs)
    post_norms: int = 0
    # LoRA on the routed experts: the elements of its adapters' factors as the fused block lays them out for the grouped
    # GEMMs in each forward (``expert_adapter_factors``), kept for backward with the block's activations
    expert_adapter_factors: int = 0
    # A token mixer that is not plain multi-head attention (``token_mixer_elements``: DeepSeek's multi-head latent
    # attention, LFM2's short convolutions): the elements per token it keeps beyond the layer input and its normalized
    # copy, in place of the attention's 3q + 2kv (0: plain attention)
    token_mixer: int = 0
    # Whether anything of its dense MLP (an MoE layer's: its shared experts, or Gemma 4's dense MLP) trains, and
    # whether anything of its MoE block does (router, routed or shared experts: weights or LoRA adapters), read off
    # ``requires_grad``: a frozen part keeps less for backward (``plan.memory.layer_token_bytes``)
    mlp_trains: bool = True
    block_trains: bool = True


@dataclass(frozen=True)
class ModelShape:
    """The model as a run trains it."""

    trainable: int
    total: int
    stored_bytes: int  # every parameter as training stores it: frozen in model.dtype, trainable fp32
    compute_bytes: int  # per element, in the compute dtype (activations; final/ of a full fine-tune)
    hidden: int
    vocab: int
    layers: tuple[LayerShape, ...]
    flops: TokenFlops  # training's FLOP count (for MFU) at data.max_length
    routed_trainable: int = 0  # the trainable parameters inside routed experts (LoRA on them, or full fine-tuning)
    loss_head_vocab: int | None = None  # ``train.loss.head_vocab``: None where no chunked loss can stand in
    # The model caps its logits (``train.loss.SOFTCAP``: Gemma's cap * tanh(logits / cap)), outside the chunked loss
    softcapped_logits: bool = False

    @property
    def flops_per_token(self) -> float:
        return self.flops.per_token

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (embeddings, LM head, final norm): FSDP's root unit."""
        return self.total - sum(layer.params + layer.expert_params for layer in self.layers)

    @property
    def moe_layers(self) -> list[LayerShape]:
        return [layer for layer in self.layers if layer.num_experts]

    @property
    def expert_counts(self) -> list[tuple[int, int]]:
        """Each MoE layer's routed experts and how many of them are identities, which expert parallelism splits
        (``ParallelDims.check_model``)."""
        return [(layer.num_experts, layer.identity_experts) for layer in self.moe_layers]


def read_model_shape(model: torch.nn.Module, config: Config, precision: Precision) -> ModelShape:
    """The shape of ``model``, built by ``build_model`` for ``config`` with ``precision`` (on any device)."""
    from peft.tuners.lora import Linear as LoraLinear

    from shardtune.distributed.activations import layer_sublayers
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.metrics.flops import layer_attention_widths, routed_expert_trainable, run_token_flops
    from shardtune.model.fused_moe import (
        expert_activation,
        expert_row_width,
        identity_experts,
        input_projection,
        parameter_adapters,
    )
    from shardtune.model.lora import count_parameters
    from shardtune.model.moe import ATTENTION_EXPERTS, find_moe_blocks
    from shardtune.train.loss import SOFTCAP, head_vocab, logit_transforms

    params = list(model.parameters())
    trainable, total = count_parameters(model)
    text = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    hidden = getattr(text, "hidden_size", None) or embedding.embedding_dim
    mlp_width = next((getattr(text, key) for key in MLP_WIDTH_KEYS if getattr(text, key, None)), 4 * hidden)
    layers = decoder_layers(model)
    widths = zip(layer_attention_widths(model), layer_attention_widths(model, "num_key_value_heads"), strict=True)
    blocks = {block.layer: block for block in find_moe_blocks(model, layers)}
    shapes = []
    for index, (layer, (width, kv_width)) in enumerate(zip(layers, widths, strict=True)):
        adapter_inputs = sum(module.in_features for module in layer.modules() if isinstance(module, LoraLinear))
        layer_params = sum(p.numel() for p in layer.parameters())
        block = blocks.get(index)
        repeated_kv, sliding_mask, token_major = sdpa_key_values(layer, model.config, config.data.max_length)
        eager_repeated_kv, attention_scores = eager_attention(layer, model.config, config.data.max_length)
        repeated_kv += eager_repeated_kv
        sublayers = layer_sublayers(layer) is not None
        qk_norm = any(name.rsplit(".", 1)[-1] in QK_NORMS for name, _ in layer.named_modules())
        value_norm = any(
            getattr(module, "v_proj", None) is not None for module in layer.modules() if hasattr(module, "v_norm")
        )
        attention = {"attention_width": width, "kv_width": kv_width, "value_norm": value_norm,
                     "token_major_output": token_major, "post_norms": post_norms(layer),
                     "attention_scores": attention_scores}  # fmt: skip
        attention_expert_rows = sum(
            mixture.top_k * 2 * (hidden + parameter_adapters(mixture.input_linear)[0].weight.shape[1])
            for mixture in layer.modules()
            if type(mixture).__name__ in ATTENTION_EXPERTS
        )
        token_mixer = token_mixer_elements(layer, hidden)
        if block is None:
            dense = getattr(layer, "mlp", None)
            shapes.append(
                LayerShape(
                    mlp_width, 0, 0, 0, 0, adapter_inputs, 0, layer_params, 0, sublayers=sublayers, qk_norm=qk_norm,
                    attention_expert_rows=attention_expert_rows, repeated_kv=repeated_kv, sliding_mask=sliding_mask,
                    token_mixer=token_mixer, mlp_trains=dense is None or trains(dense), **attention,
                )
            )  # fmt: skip
            continue
        expert_params = sum(p.numel() for p in block.experts.parameters())
        shared = block.block.get_submodule(block.shared_name) if block.shared_name else None
        if shared is None and not block.path:  # the block is its decoder layer (Gemma 4's): its dense MLP runs beside
            shared = getattr(block.block, "mlp", None)  # the experts on every token, as shared experts do
        shared_params = sum(p.numel() for p in shared.parameters()) if shared is not None else 0
        base_experts, adapters = parameter_adapters(block.adapted_experts)
        activation = expert_activation(base_experts)
        # Read from the weights where the fused block computes the layout; else taken as gated: gate, up and down,
        # each hidden x I.
        row_width = expert_row_width(base_experts) or 2 * expert_params // (GATED_MATRICES * block.num_experts * hidden)
        first_projection = input_projection(activation) if activation else "gate_up_proj"
        shapes.append(
            LayerShape(
                mlp_width=0,
                expert_row_width=row_width,
                top_k=block.top_k,
                num_experts=block.num_experts,
                identity_experts=identity_experts(base_experts),
                shared_width=shared_params // (GATED_MATRICES * hidden),
                adapter_inputs=adapter_inputs,
                expert_adapter_rank=sum(adapter[3] for adapter in adapters.get(first_projection, [])),
                params=layer_params - expert_params,
                expert_params=expert_params,
                **attention,
                sublayers=sublayers,
                qk_norm=qk_norm,
                attention_expert_rows=attention_expert_rows,
                jitter_noises=jitter_noises(block),
                repeated_kv=repeated_kv,
                sliding_mask=sliding_mask,
                expert_adapter_factors=expert_adapter_factors(adapters),
                token_mixer=token_mixer,
                mlp_trains=shared is None or trains(shared),
                # The block is its decoder layer (Gemma 4's): its router, experts and dense MLP
                block_trains=trains(block.block)
                if block.path
                else any(trains(part) for part in (block.router_child, block.experts, shared) if part is not None),
            )
        )
    routed = routed_expert_trainable(list(blocks.values()), model)
    flops = run_token_flops(model, config.data.max_length, config.lora.enabled, trainable, routed)
    return ModelShape(
        trainable=trainable,
        total=total,
        stored_bytes=sum(p.numel() * p.element_size() for p in params),
        compute_bytes=(precision.autocast or precision.compute).itemsize,
        hidden=hidden,
        vocab=embedding.num_embeddings,
        layers=tuple(shapes),
        flops=flops,
        routed_trainable=routed,
        loss_head_vocab=head_vocab(model),
        softcapped_logits=SOFTCAP in logit_transforms(text),
    )


def expert_adapter_factors(adapters: dict[str, list[tuple]]) -> int:
    """Elements of the routed experts' LoRA factors as ``fused_moe._projection`` multiplies by them, for ``adapters``
    (``fused_moe.parameter_adapters``: per adapted weight, (lora_A, lora_B, scaling, rank, shared, dropout)): a copy in
    the compute dtype made every forward and kept for backward by the grouped GEMMs that take it. Per-expert adapters:
    ``expert_lora_factors``' A_e^T and B_e^T, (E, in, r') and (E, r', out) for the rank r padded to r' (a multiple of
    8); an adapter shared by the experts: the mean of its blocks, (r, in) and (out, r)."""
    elements = 0
    for lora_a, lora_b, _, rank, shared, _ in (adapter for listed in adapters.values() for adapter in listed):
        fan_in, fan_out = lora_a.shape[1], lora_b.shape[0]
        experts, padded = (1, rank) if shared else (lora_a.shape[0] // rank, rank + -rank % 8)
        elements += experts * padded * (fan_in + fan_out)
    return elements


def trains(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` trains (its own weights, or LoRA adapters on them)."""
    return any(parameter.requires_grad for parameter in module.parameters())


def token_mixer_elements(layer: torch.nn.Module, hidden: int) -> int:
    """Elements per token that ``layer``'s token mixer keeps for backward beyond the layer input and its normalized
    copy, where it is not plain multi-head attention (whose 3q + 2kv ``plan.memory.layer_token_bytes`` counts); 0
    otherwise. Measured with saved_tensors_hooks on tiny DeepSeek-V2 and LFM2-MoE layers compiled on CPU:

    - multi-head latent attention (DeepSeek-V2/V3: a module with ``kv_lora_rank``), for H heads, query/key heads dq
      (nope dn + rope dr) wide, value heads dv, the latent c: the query (Hdq; with ``q_lora_rank`` r_q also its
      compressed rows and their normalized copy, 2r_q), the compressed key/value rows (c + dr) and their normalized
      copy (c, kv_b_proj's input), kv_b_proj's output (H(dn + dv): the values are a view of it), the key as attention
      takes it (Hdq, nope and rope concatenated), attention's output and the output projection's contiguous input
      (2Hdv). DeepSeek-V2-Lite: 19,520 elements a token against the 9,216 the plain formula gave, whose head size
      (the config's head_dim, the rope part) is not MLA's;
    - LFM2's short convolution (a module whose class name ends in ``ShortConv``): in_proj's output (3h: B, C and x),
      the gated input of the depthwise convolution (h), its output (h) and out_proj's input (h): 6h."""
    for module in layer.modules():
        if hasattr(module, "kv_lora_rank") and hasattr(module, "qk_rope_head_dim"):
            heads = module.num_heads
            query = heads * (module.qk_nope_head_dim + module.qk_rope_head_dim)
            compressed = 2 * module.q_lora_rank if module.q_lora_rank else 0
            latent = 2 * module.kv_lora_rank + module.qk_rope_head_dim
            return compressed + 2 * query + latent + heads * (module.qk_nope_head_dim + 3 * module.v_head_dim)
        if type(module).__name__.endswith("ShortConv"):
            return 6 * hidden
    return 0


def sdpa_key_values(layer: torch.nn.Module, model_config: PretrainedConfig, max_length: int) -> tuple[int, bool, bool]:
    """What transformers' sdpa attention (``integrations.sdpa_attention``) keeps in ``layer`` beyond the key and value
    heads themselves: (elements per token, whether it takes a materialized mask, whether its output is laid out by
    token).

    A layer whose window (``sliding_window``) is shorter than the sequence gets a materialized mask: sdpa turns it
    into an additive one in the compute dtype (batch x 1 x S x S, kept for backward by each layer's attention: S
    elements a token). Key and value heads fewer than the query heads go to sdpa as they are (``enable_gqa``) only
    with no mask and heads of at most 256 (``use_gqa_in_sdpa``); otherwise ``repeat_kv`` copies them to the query
    heads, and those copies are what attention keeps: 2(q - kv) elements a token more than 2kv (Gemma 4's
    sliding-window layers, 16 query heads on 8 key/value ones of 256, and its full-attention layers, 512 wide, 2
    key/value heads); a single key/value head is repeated as a view of itself (an expand): nothing more. With a mask or
    heads wider than 256, sdpa runs its memory-efficient kernel (on CPU, its one kernel), which writes its output token
    by token: the output projection's contiguous input is that output, not a copy."""
    attention = attention_module(layer)
    if attention is None or model_config._attn_implementation != "sdpa":
        return 0, False, False
    window = getattr(attention, "sliding_window", None)
    masked = bool(window) and window < max_length
    token_major = masked or attention.head_dim > 256
    return (repeated_key_values(attention, model_config) if token_major else 0), masked, token_major


def eager_attention(layer: torch.nn.Module, model_config: PretrainedConfig, max_length: int) -> tuple[int, int]:
    """What transformers' eager attention (``eager_attention_forward``: an architecture without sdpa on a CPU or
    without FlexAttention either, or ``model.attn_implementation: eager``) keeps in ``layer`` beyond the key and value
    heads themselves: (elements per token of the key/value heads repeated to the query heads, score elements per token).
    ``repeat_kv`` copies fewer key/value heads to the query heads (2(q - kv) more; a single one is a view of itself),
    and the scores are a heads x S x S product of each sequence: heads x S elements a token, kept twice
    (``plan.memory.layer_token_bytes`` says in which dtypes)."""
    attention = attention_module(layer)
    if attention is None or model_config._attn_implementation != "eager":
        return 0, 0
    return repeated_key_values(attention, model_config), model_config.get_text_config().num_attention_heads * max_length


def attention_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    """``layer``'s attention module as transformers writes it (its key/value groups and head size), if it has one."""
    return next(
        (
            module
            for module in layer.modules()
            if all(hasattr(module, name) for name in ("num_key_value_groups", "head_dim"))
        ),
        None,
    )


def repeated_key_values(attention: torch.nn.Module, model_config: PretrainedConfig) -> int:
    """Elements per token ``repeat_kv`` adds where it copies ``attention``'s key and value heads to its query heads:
    2(q - kv) for fewer key/value heads than query heads, nothing for as many, nor for a single one (repeated as a view
    of itself, an expand)."""
    heads = model_config.get_text_config().num_attention_heads
    groups = attention.num_key_value_groups
    if groups <= 1 or heads == groups:
        return 0
    return 2 * (heads - heads // groups) * attention.head_dim


def post_norms(layer: torch.nn.Module) -> int:
    """How many norms of ``layer`` normalize what its feed-forward computes before it joins the residual (Gemma 2-4's
    post_feedforward_layernorm; Gemma 4's MoE layers also normalize the dense MLP's and the routed experts' outputs
    apart, post_feedforward_layernorm_1 and _2, before the one of their sum): its children so named."""
    return sum(name.startswith("post_feedforward_layernorm") for name, _ in layer.named_children())


def jitter_noises(block: MoeBlock) -> int:
    """How many multiplicative noise tensors ``block`` draws over its tokens in training, as the fused block draws them
    (``FusedMoeBlock``: the block's, Mixtral's jitter_noise and Phi-3.5-MoE's input_jitter_noise, and its router's,
    Phi-3.5-MoE's input_jitter_noise again and DBRX's moe_jitter_eps), or transformers' block under the same names.
    Each is a token-shaped tensor that multiplies the tokens, so autograd keeps it for their gradient."""
    from shardtune.model.fused_moe import FusedMoeBlock, parameter_adapters

    module = block.block
    if isinstance(module, FusedMoeBlock):
        noises = (module.jitter_noise, module.router_jitter_noise)
    else:
        router = parameter_adapters(block.router_child)[0]
        noises = (
            getattr(module, "jitter_noise", None) or getattr(module, "input_jitter_noise", None),
            getattr(router, "input_jitter_noise", None) or getattr(router, "moe_jitter_eps", None),
        )
    return sum(1 for noise in noises if noise and noise > 0)


def model_shape_on(config: Config, device: torch.device) -> ModelShape:
    """The shape of the model a run of ``config`` trains on ``device`` (this machine's: ``shardtune doctor``)."""
    import torch

    from shardtune.model.load import Precision, build_model

    precision = Precision.resolve(config, device)
    # The LoRA adapters on the meta device too (PEFT makes them where tensors are made by default): for a
    # 7B model that is 0.2 GB and 3 s of host work the estimate has no use for.
    with torch.device("meta"):
        model = build_model(config, device, training=True, materialize=False)
    return read_model_shape(model, config, precision)


def gpu_precision(config: Config) -> Precision:
    """The precision of a run of ``config`` on the GPUs ``shardtune plan`` plans for: bf16-capable ones
    (A100, H100, H200, B200)."""
    import torch

    from shardtune.model.load import Precision

    return Precision.resolve(config, torch.device("cuda"), bf16_supported=True)


def planned_model_config(config: Config) -> tuple[PretrainedConfig, str]:
    """The model's architecture without its weights, and where it came from: the ``config.json`` of a local
    model directory, the hub's copy in this machine's Hugging Face cache, or bench's shape of a hub model."""
    from shardtune.bench.shapes import HUB_SHAPES, shape_config
    from shardtune.model.load import read_pretrained_config
    from shardtune.train.preflight import read_model_config

    model = config.model
    problem = model_path_problem(model)
    if problem:
        raise ConfigError(problem)
    if looks_local(model.name_or_path):
        return read_model_config(config), f"{model.name_or_path}/config.json"
    try:
        cached = read_pretrained_config(
            model.name_or_path,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            local_files_only=True,
        )
        return cached, "its config.json in the Hugging Face cache"
    except (OSError, ValueError):
        pass  # not downloaded here: bench's shape of it, if it has one
    if model.name_or_path in HUB_SHAPES:
        return shape_config(model.name_or_path), f"bench's shape {HUB_SHAPES[model.name_or_path][0]}"
    raise ConfigError(
        f"model.name_or_path: {model.name_or_path}: no config.json on this machine and no shape of it in "
        f"shardtune/bench/shapes.py ({', '.join(HUB_SHAPES)}); point model.name_or_path at a directory holding the "
        "model's config.json"
    )


def planned_model_shape(config: Config) -> tuple[ModelShape, str]:
    """The shape of the model ``config`` trains, on the GPUs ``shardtune plan`` plans for (the attention training
    takes there: ``load.training_attention``), and where its architecture came from (``planned_model_config``)."""
    import torch

    from shardtune.model.load import build_model
    from shardtune.train.preflight import check_model_config

    model_config, source = planned_model_config(config)
    check_model_config(config, model_config)
    precision = gpu_precision(config)
    with torch.device("meta"):  # adapters too, as in ``model_shape_on``
        model = build_model(
            config, torch.device("cuda"), training=True, materialize=False, precision=precision,
            model_config=model_config, patch_kernels=False,
        )  # fmt: skip
    return read_model_shape(model, config, precision), source

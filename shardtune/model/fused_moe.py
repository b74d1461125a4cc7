"""shardtune's MoE block for training (``model.experts_implementation: fused``).

Each sparse MoE block of a supported architecture is swapped for a :class:`FusedMoeBlock` that keeps the
original's children under their names (router, experts, shared experts), so parameter names, PEFT's
adapters, checkpoints and exports are unchanged; only the computation differs:

- the router runs in fp32 with its architecture's exact rule (:class:`Routing`);
- the (token, choice) pairs are sorted by expert once, on the device (``expert_order``: a counting sort in
  two Triton kernels on GPUs, a stable ``torch.sort`` and ``searchsorted`` elsewhere), so nothing waits for
  the host and every shape is static (``torch.compile`` traces the block as one graph);
- gate/up and down projections are grouped GEMMs over the sorted rows (``model.grouped_gemm``: quack's
  varlen GEMM or ``torch._grouped_mm``, see ``grouped_gemm.py``), with LoRA on the routed experts computed as
  two more grouped low-rank products on the same rows from PEFT's own ``lora_A``/``lora_B`` (W + ΔW is
  never formed);
- each row's routing weight is applied to its expert's hidden activation, in the one elementwise op that
  computes SiLU(gate) * up (ungated experts: ReLU(up)²) (the down projection is linear, so this equals weighting
  its output) and that keeps only the gate/up GEMM output for backward: the weight's gradient is a dot product
  over the expert's width, and the down projection's output rows need not be kept for it (Megatron-LM and
  torchtitan can weight before the experts the same way). On Qwen3-30B-A3B that is 256 MiB less per layer at
  8,192 tokens;
- the sum back to token order is the adjoint of the gather that made the rows: each token's ``top_k`` rows
  summed in fp32, and its backward that gather (for a frozen down projection without LoRA, inside the
  input gradient's GEMM where quack's kernel gathers rows itself: ``ProjectionSummed``).

A block that is its decoder layer (Gemma 4's: routed experts beside the dense MLP) keeps the layer and its forward:
its router child is swapped for a :class:`FusedRouter`, which routes as the fused block does, and its experts compute
the same ``routed_experts``.

Blocks report their routing to the ``RoutingRecorder`` themselves (their router module's forward no
longer runs) from inside the graph: a compiled decoder layer has no graph break (``report_routing``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardtune.errors import ConfigError
from shardtune.model.casts import in_dtype
from shardtune.model.float8 import (
    FLOAT8,
    Float8Product,
    float8_grouped_mm,
    gathered_rowwise_float8,
    quantize_expert_weight,
    quantize_gate_and_up,
    resolve_float8_grouped_gemm,
    rowwise_float8,
)
from shardtune.model.grouped_gemm import (
    describe,
    gathered_grouped_mm,
    grouped_mm,
    grouped_mm_weight_grad,
    resolve_grouped_gemm,
)
from shardtune.model.moe import (
    ATTENTION_EXPERTS,
    ROUTING_RULES,
    SCORING_FUNCTIONS,
    SHARED_EXPERT_NAMES,
    ExpertPair,
    MoeBlock,
    Routing,
    RoutingRecorder,
    correction_bias,
    expert_pair,
    find_moe_blocks,
    logits_linear_name,
    routing_probabilities,
    sum_real,
    token_statistics,
)
from shardtune.model.triton_kernels import KERNELS_MAY_RUN, runs_on

# Without Triton, or on a CPU build of torch, these run as torch ops.
routing_kernels = weighted_silu_mul_backward = weighted_silu_mul_backward_float8 = weighted_silu_mul_float8 = None
FLOAT8_ROW_TILE = 0
if KERNELS_MAY_RUN:
    with contextlib.suppress(ImportError):
        from shardtune.model import routing_kernels
    with contextlib.suppress(ImportError):
        from shardtune.model.weighted_silu_kernel import (
            FLOAT8_ROW_TILE,
            weighted_silu_mul_backward,
            weighted_silu_mul_backward_float8,
            weighted_silu_mul_float8,
        )

log = logging.getLogger("shardtune")

MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) (torch 2.8 and later)

TRANSFORMERS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


# Blocks whose forward returns (output, a routing tensor), which their decoder layers drop: GPT-OSS's each token's
# routing weights, Llama 4's router logits.
SECOND_OUTPUT = {"GptOssMLP": "weights", "Llama4TextMoe": "logits"}

# Blocks that add a (hidden,) parameter of their own to their output, by class name: its name. JetMoE's.
OUTPUT_BIAS = {"JetMoeMoE": "bias"}

# The routed-expert layouts (``expert_activation``) that float8 experts and expert parallelism take: expert e at index
# e of each weight's first dimension (of a bias's too; a 2-D slab's rows e*I..(e+1)*I, ``split_silu``), the activation
# one of the weighted ones below; ``identity``:
# identity experts (IDENTITY_EXPERTS) beside the GEMM experts of any of them. Float8 experts add GPT-OSS's biases in
# their own dtype after the float8 GEMMs. Under expert parallelism identity experts are no rank's work: their pairs
# stay on their own rank (``routed_experts``), and only LongCat-Flash's gate_up_proj rows of them, which nothing reads,
# are split over the ranks beside the GEMM experts' (``expert_parallel.shard_experts``).
EXPERT_PARALLEL_LAYOUTS = ("silu", "transposed_silu", "relu2", "clamped_glu", "gelu_tanh", "split_silu", "identity")
FLOAT8_LAYOUTS = EXPERT_PARALLEL_LAYOUTS
# What a layout, or identity experts, have that one of them does not take, for its refusal.
LAYOUT_TRAITS = {
    "identity": "zero-computation identity experts",  # IDENTITY_EXPERTS, whatever their GEMM experts' layout
}

# Experts whose last ids are "zero-computation" identities, by class name: the attribute of the experts, or else of
# their config, that holds how many (transformers up to 5.24 keeps it on LongCat-Flash's experts; 5.25 computes the
# identities in the MoE block, which shardtune's fused block replaces, and keeps it in the experts' config alone).
# An identity expert's output is the token itself (times its routing weight); the GEMM experts are the first
# down_proj.shape[0] (LongCat-Flash's gate_up_proj had a row for each identity expert too up to 5.24, which nothing
# reads).
IDENTITY_EXPERTS = {"LongcatFlashExperts": "zero_expert_num"}


# Experts that hold each projection as one 2-D (experts x width, hidden) slab of every expert, by class name: the child
# holding them and the names of gate, up and down (DBRX's DbrxExperts: mlp.w1, mlp.v1, mlp.w2). Expert e's rows are
# e*I..(e+1)*I of each (I the experts' ffn_hidden_size), so (E, I, H) views of them are the weights, with no copy: gate
# and up (E, out, in), down (E, in, out) (h @ w2_e) (``expert_slabs``; ``expert_activation``: ``split_silu``). Under
# expert parallelism a rank's slabs hold the rows of its run of experts; with float8 experts the slabs hold e4m3 values
# (``use_float8_experts``).
SLAB_EXPERTS = {"DbrxExperts": ("mlp", "w1", "v1", "w2")}


def slab_names(experts: torch.nn.Module) -> tuple[str, ...] | None:
    """``SLAB_EXPERTS``' names of slab ``experts`` (under no PEFT wrapper), or None: looked up by their class or the
    class FSDP made of it (FSDPDbrxExperts, whose bases hold DbrxExperts), as ``routed_experts`` finds them in every
    forward."""
    return next((SLAB_EXPERTS[cls.__name__] for cls in type(experts).__mro__ if cls.__name__ in SLAB_EXPERTS), None)


# SiLU-gated experts that clamp the gate from above and up on both sides at a limit first (a SwiGLU limit), by class
# name: the attribute that holds the limit. HY-V4's call F.silu themselves (no act_fn).
CLAMPED_SILU_EXPERTS = {"HYV4Experts": "swiglu_limit", "DeepseekV4Experts": "limit"}


def expert_activation(experts: torch.nn.Module) -> str | None:
    """How routed experts (transformers' module, under no wrapper) turn their gate/up projection into the down
    projection's input: ``silu``, SiLU(gate) * up of its [gate | up] halves (the gate and up clamped first where
    the experts have a ``swiglu_limit``), with (E, out, in) weights and no biases (most architectures);
    ``transposed_silu``, the same with (E, in, out) weights (Llama 4's);
    ``clamped_glu``, GPT-OSS's: gate and up interleaved, each clamped at ``limit`` (up on both sides),
    gate * sigmoid(alpha * gate) * (up + 1), with (E, in, out) weights and a bias on each projection;
    ``relu2``, ungated experts: ReLU(up)², an (E, I, H) ``up_proj`` and no gate (Nemotron-H's);
    ``gelu_tanh``, ``silu``'s layout with GELU's tanh approximation for the SiLU (Gemma 4's gelu_pytorch_tanh);
    None for any other kind. A block's pair of expert modules (``moe.ExpertPair``: JetMoE's input_linear and
    output_linear) names its weights and activation as an experts module does: its SiLU is ``silu``.
    ``split_silu``, SiLU(gate) * up of gate and up apart and down, each a 2-D slab of every expert (DBRX's,
    ``SLAB_EXPERTS``)."""
    if type(experts).__name__ == "GptOssExperts":
        return "clamped_glu"
    if (slabs := slab_names(experts)) is not None:
        act_fn = getattr(getattr(experts, slabs[0]), "activation_fn", None)
        return "split_silu" if type(act_fn).__name__ in ("SiLU", "SiLUActivation") else None
    if getattr(experts, "has_bias", False):
        return None
    if isinstance(getattr(experts, "up_proj", None), torch.Tensor) and not hasattr(experts, "gate_up_proj"):
        return "relu2" if type(getattr(experts, "act_fn", None)).__name__ == "ReLUSquaredActivation" else None
    if type(experts).__name__ in CLAMPED_SILU_EXPERTS:
        return "silu"
    act_fn = getattr(experts, "act_fn", None)
    if act_fn is F.silu or type(act_fn).__name__ in ("SiLU", "SiLUActivation"):  # LFM2: F.silu itself
        return "transposed_silu" if _weights_transposed(experts) else "silu"
    if type(act_fn).__name__ == "GELUTanh" and not _weights_transposed(experts):
        return "gelu_tanh"
    return None


def input_projection(activation: str) -> str:
    """The name of the routed experts' first projection, for their ``expert_activation``: ungated experts' up_proj,
    everyone else's gate_up_proj."""
    return "up_proj" if activation == "relu2" else "gate_up_proj"


def _weights_transposed(experts: torch.nn.Module) -> bool:
    """Whether gate/up and down are (E, in, out): marked so (transformers' ``is_transposed``) or, unmarked (Llama 4's),
    told by their shapes: gate/up's input width is then down's output width, where (E, out, in) weights have 2I
    against I there."""
    if getattr(experts, "is_transposed", False):
        return True
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.shape[1] == down.shape[2]


def expert_row_width(experts: torch.nn.Module) -> int | None:
    """What one routed row's first projection gives per expert of ``experts`` (transformers' module, under no
    wrapper): gated experts' [gate | up], 2I wide, ungated ones' up, I wide; None for a layout the fused block does not
    compute (``expert_activation``)."""
    activation = expert_activation(experts)
    if activation is None:
        return None
    if activation == "split_silu":
        return 2 * expert_slabs(experts)[0].shape[1]
    weight = getattr(experts, input_projection(activation))
    return weight.shape[2] if _weights_transposed(experts) else weight.shape[1]


def expert_slabs(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Slab experts' (``SLAB_EXPERTS``: DBRX's; transformers' module, under no wrapper) gate, up and down weights as
    (E, I, H) views of their 2-D slabs, no copy: gate and up (E, out, in), down (E, in, out); None for other experts.
    E is the experts the slabs hold: under expert parallelism this rank's run of them."""
    names = slab_names(experts)
    if names is None:
        return None
    holder = getattr(experts, names[0])
    return tuple(
        getattr(holder, name).view(-1, experts.ffn_hidden_size, getattr(holder, name).shape[-1]) for name in names[1:]
    )


def identity_experts(experts: torch.nn.Module) -> int:
    """How many of ``experts`` (transformers' module, under no wrapper) are identities, the last ids
    (``IDENTITY_EXPERTS``; looked up by their class or the class FSDP made of it, as ``slab_names``)."""
    attribute = _identity_attribute(experts)
    if attribute is None:
        return 0
    return int(getattr(experts, attribute, None) or getattr(getattr(experts, "config", None), attribute, None) or 0)


def identity_rows(experts: torch.nn.Module, weight: str) -> int:
    """How many identity experts' rows (or LoRA factors) ``experts``' routed weight named ``weight`` holds after its
    GEMM experts' (``experts``: transformers' module, under no wrapper). LongCat-Flash's experts up to transformers
    5.24 keep the count themselves and a gate_up_proj row for each identity expert, which nothing reads; 5.25's keep
    it in their config alone, and their gate_up_proj holds the GEMM experts' rows alone, as every down_proj does."""
    attribute = _identity_attribute(experts)
    if attribute is None or weight == "down_proj":
        return 0
    return int(getattr(experts, attribute, None) or 0)


def routed_expert_count(experts: torch.nn.Module) -> int:
    """Every routed expert of ``experts`` (transformers' module, under no wrapper), the identities too, whether its
    input projection holds rows for them or not (``identity_rows``)."""
    activation = expert_activation(experts)
    if activation == "split_silu":
        return expert_slabs(experts)[0].shape[0]
    projection = input_projection(activation)
    return getattr(experts, projection).shape[0] - identity_rows(experts, projection) + identity_experts(experts)


def _identity_attribute(experts: torch.nn.Module) -> str | None:
    names = (IDENTITY_EXPERTS.get(cls.__name__) for cls in type(experts).__mro__)
    return next((name for name in names if name is not None), None)


def swiglu_limit(experts: torch.nn.Module) -> float | None:
    """The limit SiLU-gated ``experts`` (transformers' module, under no wrapper) clamp their gate and up at, or None
    (``CLAMPED_SILU_EXPERTS``)."""
    attribute = CLAMPED_SILU_EXPERTS.get(type(experts).__name__)
    return None if attribute is None else float(getattr(experts, attribute))


def _unsupported(block: MoeBlock) -> str | None:
    """Why ``block`` cannot be fused, or None."""
    name = type(block.block).__name__
    if name not in ROUTING_RULES:
        return f"{name} is not one of {', '.join(ROUTING_RULES)}"
    if expert_activation(block.experts) is None:
        return (
            f"{type(block.experts).__name__} is neither SiLU- or GELU-tanh-gated experts, ReLU²-activated ones nor "
            "GPT-OSS's"
        )
    return None


def resolve_experts_implementation(requested: str | None, blocks: list[MoeBlock]) -> str:
    """What ``model.experts_implementation`` means for this model: ``auto`` is ``fused`` wherever every
    MoE block is supported (on GPUs and CPUs alike: the same code, so CI tests what GPUs run), and
    transformers' default otherwise."""
    requested = requested or "auto"
    if not blocks or requested in TRANSFORMERS_IMPLEMENTATIONS:
        return requested
    reason = next((why for why in map(_unsupported, blocks) if why), None)
    if reason is None:
        return "fused"
    if requested == "fused":
        raise ConfigError(f"model.experts_implementation: fused cannot run this model: {reason}; choose grouped_mm")
    log.info("moe experts: transformers' default (%s)", reason)
    return "transformers"


def use_fused_experts(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    requested: str | None,
    grouped_gemm: str = "auto",
    device: torch.device | None = None,
) -> list[MoeBlock]:
    """Swap every sparse MoE block of ``model`` for a FusedMoeBlock when the implementation resolves to
    ``fused``, log the implementation in use, and return the model's MoE blocks as they now are.
    ``grouped_gemm`` (``model.grouped_gemm``) picks the grouped GEMM kernel for ``device``, where the
    model trains (default: the CPU).

    Call it after PEFT has wrapped the model (the experts' outermost wrapper gets the fused forward).
    """
    blocks = find_moe_blocks(model, layers)
    implementation = resolve_experts_implementation(requested, blocks)
    shared = any(getattr(module, "shared_across_experts", False) for module in model.modules())
    if shared and implementation != "fused":
        raise ConfigError(
            "lora.shared_expert_adapter: needs model.experts_implementation fused (or auto), which this "
            f"model does not run ({implementation}): transformers' experts would train each expert's copy apart"
        )
    if implementation != "fused":
        if blocks and implementation != "transformers":
            log.info("moe experts: transformers' %s", implementation)
        return blocks
    backend = resolve_grouped_gemm(grouped_gemm, device or torch.device("cpu"))
    mixtures = [module for module in model.modules() if type(module).__name__ in ATTENTION_EXPERTS]
    for mixture in mixtures:
        use_grouped_attention_experts(mixture, backend)
    if mixtures:
        # Its query and output experts run apart, the attention between them (map, attention, reduce): no one block
        # to swap. Their adapters are LoRA's attention group; their routers are no MoE block's (not recorded).
        log.info(
            "moe experts: the mixture of attention (%s) keeps transformers' code but for its gating's row counts (kept "
            "on the device) and its experts' grouped GEMMs; its routers are not recorded",
            ", ".join(sorted({type(mixture).__name__ for mixture in mixtures})),
        )
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        # transformers collects router logits from the router modules' forwards, which fused blocks do
        # not run; its auxiliary loss is not shardtune's objective anyway (training.moe_aux_loss_coef).
        config.output_router_logits = False
        log.info(
            "moe experts: the model's output_router_logits is off (training.moe_aux_loss_coef sets the balance loss)"
        )
    for block in blocks:
        if block.path:
            parent, replaced = _parent_of(model, block.block), block.block
            fused = FusedMoeBlock(replaced, block.routing, backend)
        else:  # the block is its decoder layer (Gemma 4's), whose forward stays: its router child is swapped
            parent, replaced = block.block, getattr(block.block, block.router_name)
            fused = FusedRouter(block.block, block.router_name, block.routing, backend)
        for name, child in list(parent.named_children()):
            if child is replaced:
                parent.register_module(name, fused)
    log.info(
        "moe experts: fused (shardtune's grouped-GEMM block) on %d MoE layers; grouped GEMMs: %s",
        len(blocks),
        describe(backend),
    )
    return find_moe_blocks(model, layers)


def use_grouped_attention_experts(mixture: torch.nn.Module, grouped_gemm: str) -> None:
    """Make a mixture of attention experts (JetMoE's JetMoeMoA, ``moe.ATTENTION_EXPERTS``), whose map and reduce stay
    transformers', compute its query and output experts as grouped GEMMs (``grouped_gemm``: ``model.grouped_gemm``)
    on row counts its gating keeps on the device. transformers' gating reads the counts to the host
    (``expert_size.tolist()``) and its experts loop over them: a host sync in every layer's forward, which also breaks
    each compiled layer in two. The experts' outermost modules (PEFT's wrappers, where adapted) get the forward, which
    reads their adapters as the routed experts' does, never building W + ΔW."""
    mixture.router.forward = types.MethodType(_gating_with_counts_on_device, mixture.router)
    for experts in (mixture.input_linear, mixture.output_linear):
        experts.forward = types.MethodType(_grouped_attention_experts, experts)
        experts.grouped_gemm = grouped_gemm


def _gating_with_counts_on_device(
    gating: torch.nn.Module, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """JetMoE's top-k gating, as transformers' computes it (the same ops, so the same order of the rows), but for its
    per-expert row counts, which stay on the device as the grouped GEMMs' bounds (expert e's rows bounds[e]:bounds[e +
    1]) where transformers reads them to the host: (rows' pairs in expert order, their tokens, their gates, the
    bounds, the fp32 logits). Both the query and the output experts take the bounds."""
    logits = gating.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(gating.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    chosen = torch.zeros(top_k_gates.shape[0], gating.num_experts, dtype=top_k_gates.dtype, device=logits.device)
    counts = chosen.scatter(1, top_k_indices, 1).long().sum(0)
    bounds = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(gating.top_k, rounding_mode="trunc")
    return index_sorted_experts, batch_index, top_k_gates.flatten()[index_sorted_experts], bounds, logits


def _grouped_attention_experts(experts: torch.nn.Module, rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """JetMoE's JetMoeParallelExperts on ``rows`` in expert order, expert e's rows bounds[e]:bounds[e + 1]
    (``_gating_with_counts_on_device``): rows @ W_e^T (W (E, out, in)) and each LoRA adapter's low-rank product."""
    base, adapters = parameter_adapters(experts)
    dtype = _compute_dtype(base.weight, rows)
    return _projection(rows.to(dtype), base.weight, adapters.get("weight", []), bounds, dtype, experts.grouped_gemm)


def unsupported_layout(experts: torch.nn.Module, layouts: tuple[str, ...]) -> str | None:
    """What routed ``experts`` (prepared by ``use_routed_experts``) have that a feature taking ``layouts``
    (``FLOAT8_LAYOUTS``, ``EXPERT_PARALLEL_LAYOUTS``) does not take (``LAYOUT_TRAITS``), or None: another layout, or
    identity experts where ``layouts`` has no ``identity``. A pair of expert modules (JetMoE's ``ExpertPair``) is its
    layout's (``silu``): both features take its weights where the block holds them (``expert_weight_holder``)."""
    if experts.activation not in layouts:
        return LAYOUT_TRAITS.get(experts.activation, experts.activation)
    return LAYOUT_TRAITS["identity"] if experts.identity_experts and "identity" not in layouts else None


def use_float8_experts(model: torch.nn.Module, grouped_gemm: str = "auto") -> tuple[int, str]:
    """``model.float8_experts``: quantize the frozen routed experts of every fused MoE block of ``model`` to
    float8 (``float8.py``) where they are now; returns the number of blocks and the grouped GEMM they compute
    with (``resolve_float8_grouped_gemm`` of ``model.grouped_gemm``, ``grouped_gemm``). Each weight's parameter
    keeps its name, shape and object and holds its e4m3 values scaled per row of each expert's matrix (the forward's
    operand, or for transposed weights (Llama 4's, GPT-OSS's) the input gradient's), with the scales and the
    transpose's copy as buffers beside it (``_float8_weight``), so the bf16 weight's memory is freed. Every layout in
    ``FLOAT8_LAYOUTS`` (gated, transposed, ungated, with a SwiGLU limit, GELU-tanh-gated, GPT-OSS's, identity experts
    beside them, DBRX's 2-D slabs: ``_quantize_slabs``) is taken; GPT-OSS's biases stay in their dtype, LongCat-Flash's
    gate_up_proj rows of its identity experts are quantized with the others and never read. A pair of expert modules
    (JetMoE's ``ExpertPair``) keeps each weight's float8 forms on the module that holds it (``weight``,
    ``weight_scale``, ...: ``expert_weight_holder``). A mixture of attention's query and output experts (JetMoE's
    JetMoeMoA) stay in their dtype: they are its attention's projections, which float8 experts leave alone in every
    model (quantized, the tiny model's attention adapters' gradients were measured 7.9e-2 from fp32's, against 3e-5
    with them left alone). Only the adapter is ever saved from such a model: the checkpoints and ``final/`` of LoRA
    hold trainable parameters only."""
    blocks = [module for module in model.modules() if isinstance(module, FusedMoeBlock)]
    if not blocks:
        raise ConfigError(
            "model.float8_experts: this model has no fused MoE blocks (model.experts_implementation: fused runs "
            "the routed experts' GEMMs it quantizes); set it to false"
        )
    backend = "torch"
    for block in blocks:
        experts, activation = parameter_adapters(block.experts)[0], block.experts.activation
        if (layout := unsupported_layout(block.experts, FLOAT8_LAYOUTS)) is not None:
            raise ConfigError(
                f"model.float8_experts: {type(experts).__name__} ({layout}) has no float8 path; set it to false"
            )
        names = (input_projection(activation), "down_proj")
        slabs = expert_slabs(experts)
        weights = slabs if slabs is not None else tuple(getattr(experts, name) for name in names)
        backend = resolve_float8_grouped_gemm(grouped_gemm, weights[0].device)
        block.experts.float8_grouped_gemm = backend  # read by routed_experts, as grouped_gemm is
        if any(weight.requires_grad for weight in weights):
            raise ConfigError(
                "model.float8_experts: the routed experts train in this run; float8 is for frozen ones "
                "(lora.enabled: true, the experts' weights frozen); set it to false"
            )
        if slabs is not None:
            _quantize_slabs(experts)
            continue
        for name in names:
            _quantize_expert_weight(*expert_weight_holder(experts, name))
    return len(blocks), backend


def expert_weight_holder(experts: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module that holds routed ``experts``' (under no wrapper) weight ``name`` (``gate_up_proj``, ``down_proj``,
    ...) and the weight's attribute there: the experts module and ``name``, or for a pair of expert modules (JetMoE's
    ``ExpertPair``) the block's module holding it (input_linear, output_linear) and ``weight``."""
    if isinstance(experts, ExpertPair):
        return experts.get_submodule(ExpertPair.PROJECTIONS[name]), "weight"
    return experts, name


def _quantize_expert_weight(holder: torch.nn.Module, name: str) -> None:
    """Frozen expert weight ``name`` of ``holder`` in float8, its scales and transposed copy buffers beside it."""
    weight = getattr(holder, name)
    # Quantized as the parameter is laid out: (E, out, in) weights hold the forward's operand, transposed
    # (E, in, out) ones (Llama 4's) the input gradient's, and the *_t buffers the other (_float8_weight).
    values, scales, values_t, scales_t = quantize_expert_weight(weight.detach())
    # The same parameter object, holding the float8 values: whoever listed the model's parameters before
    # (DDP does, when it is built, and keeps the list) lets the bf16 weight go with it. With a new parameter,
    # a 24-layer Qwen3-30B-A3B under DDP on 2 H100s peaked 27.4 GiB above the planner's estimate: its
    # experts' and projections' bf16 weights (27.9 GiB) stayed.
    weight.data = values
    holder.register_buffer(f"{name}_scale", scales, persistent=False)
    holder.register_buffer(f"{name}_t", values_t, persistent=False)
    holder.register_buffer(f"{name}_t_scale", scales_t, persistent=False)


def _quantize_slabs(experts: torch.nn.Module) -> None:
    """``use_float8_experts`` for slab experts (``SLAB_EXPERTS``: DBRX's), each slab keeping its parameter object,
    name and (E*I, H) shape, the buffers beside it in its module: gate and up (w1, v1) hold the forward's e4m3 values,
    each expert's rows scaled per row (``w1_scale``, ``v1_scale``, (E, I)), as the [gate | up] rows of a gate_up_proj
    are; ``w1_v1_t`` (E, H, 2I) holds each expert's [gate | up]^T scaled per row (``w1_v1_t_scale``, (E, H)), the input
    gradient's one GEMM, as a gate_up_proj's ``_t`` buffer does (``quantize_gate_and_up``); down (w2), whose rows are
    each expert's W_e^T (in, out), holds them scaled per row, the input gradient's operand, and ``w2_t`` (E, H, I) W_e's
    (the forward's), as transposed weights (Llama 4's) do. The forward's values are the rows of the weights that
    ``quantize_expert_weight`` would give the (E, 2I, H) concatenation of gate and up and the (E, H, I) down, so the
    experts compute what the ``silu`` layout's float8 experts compute of those weights."""
    holder_name, gate_name, up_name, down_name = slab_names(experts)
    holder = getattr(experts, holder_name)
    gate, up, down = (slab.detach() for slab in expert_slabs(experts))
    gate_values, gate_scales, up_values, up_scales, values_t, scales_t = quantize_gate_and_up(gate, up)
    down_values, down_scales, down_values_t, down_scales_t = quantize_expert_weight(down)
    del gate, up, down  # the bf16 slabs go with the parameters' old data
    for name, values, scales in (
        (gate_name, gate_values, gate_scales), (up_name, up_values, up_scales), (down_name, down_values, down_scales)
    ):  # fmt: skip
        slab = getattr(holder, name)
        slab.data = values.view(slab.shape)  # the same parameter object (use_float8_experts says why)
        holder.register_buffer(f"{name}_scale", scales, persistent=False)
    holder.register_buffer(f"{gate_name}_{up_name}_t", values_t, persistent=False)
    holder.register_buffer(f"{gate_name}_{up_name}_t_scale", scales_t, persistent=False)
    holder.register_buffer(f"{down_name}_t", down_values_t, persistent=False)
    holder.register_buffer(f"{down_name}_t_scale", down_scales_t, persistent=False)


def _float8_slabs(
    experts: torch.nn.Module, slabs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """The float8 forms of slab experts' gate/up and down that ``_quantize_slabs`` made, as ``Float8Experts`` takes
    them: gate's and up's forward (values, scales) apart, then [gate | up]^T's (values, scales); down's as a
    transposed weight's (``_float8_weight``); (None, None) for slabs in their own dtype. ``slabs``: their
    ``expert_slabs`` views, the forward's e4m3 values of gate and up and down's transposed ones."""
    holder_name, gate_name, up_name, down_name = slab_names(experts)
    holder = getattr(experts, holder_name)
    if not hasattr(holder, f"{gate_name}_scale"):
        return None, None
    gate, up, down = slabs
    gate_up_t = f"{gate_name}_{up_name}_t"
    gate_up = (
        gate, getattr(holder, f"{gate_name}_scale"), up, getattr(holder, f"{up_name}_scale"),
        getattr(holder, gate_up_t), getattr(holder, f"{gate_up_t}_scale"),
    )  # fmt: skip
    down_forms = (
        getattr(holder, f"{down_name}_t"), getattr(holder, f"{down_name}_t_scale"), down,
        getattr(holder, f"{down_name}_scale"),
    )  # fmt: skip
    return gate_up, down_forms


def _float8_weight(
    experts: torch.nn.Module, name: str, transposed: bool = False, count: int | None = None
) -> tuple[torch.Tensor, ...] | None:
    """The float8 forms of expert weight ``name`` that ``use_float8_experts`` made: (values, scales) of W_e (out, in)
    and of W_e^T, as ``Float8Product`` takes them, of its first ``count`` experts (default: all; LongCat-Flash's
    gate_up_proj: its GEMM experts'); None for a weight in its own dtype. A ``transposed`` parameter holds W_e^T, its
    ``_t`` buffers W_e. A pair of expert modules' (``ExpertPair``) are on the module holding the weight
    (``expert_weight_holder``)."""
    holder, name = expert_weight_holder(experts, name)
    if not hasattr(holder, f"{name}_scale"):
        return None
    forms = tuple(getattr(holder, name + suffix)[:count] for suffix in ("", "_scale", "_t", "_t_scale"))
    return (*forms[2:], *forms[:2]) if transposed else forms


def _parent_of(model: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if any(child is target for child in module.children()):
            return module
    raise ValueError(f"{type(target).__name__} is not inside {type(model).__name__}")


class FusedMoeBlock(torch.nn.Module):
    """A sparse MoE block computed as described in this module's docstring."""

    reports_routing = True  # to the RoutingRecorder, from inside its forward (see report_routing)

    def __init__(
        self,
        original: torch.nn.Module,
        routing: Routing,
        grouped_gemm: str = "torch",
        experts: torch.nn.Module | None = None,
        replaced: str | None = None,
    ):
        """``original``: the transformers block it replaces, whose children (router, experts, shared experts) and
        own tensors it takes over; for a :class:`FusedRouter`, a router child, with the ``experts`` of its decoder
        layer (``replaced``)."""
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        # The block's own tensors: a correction bias, a buffer (MiniMax-M2's) or a frozen parameter (AFMoE's).
        for name, buffer in original.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
        for name, parameter in original.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        self.routing = routing
        self.replaced = replaced or type(original).__name__
        if experts is None:
            self.router_name = "gate" if hasattr(self, "gate") else "router"
            if "experts" not in self._modules:  # experts held as two modules of the block (JetMoE's): seen as one
                self.__dict__["experts"] = expert_pair(self)
        else:  # the router itself, beside experts that stay its layer's child (not registered here)
            self.router_name = ""
            self.__dict__["experts"] = experts
        self.shared_name = next((name for name in SHARED_EXPERT_NAMES if name in self._modules), None)
        # Multiplicative uniform noise on the tokens in training, drawn as transformers draws it (a seeded run draws the
        # same noise): the block's (Mixtral's jitter_noise, Phi-3.5-MoE's input_jitter_noise) and its router's
        # (Phi-3.5-MoE's input_jitter_noise again, DBRX's moe_jitter_eps: such a router multiplies its input in place,
        # so the experts take the jittered tokens too).
        block_noise = getattr(original, "jitter_noise", 0.0) or getattr(original, "input_jitter_noise", 0.0)
        self.jitter_noise = float(block_noise or 0.0)
        router = parameter_adapters(getattr(original, self.router_name))[0] if experts is None else original
        router_noise = getattr(router, "input_jitter_noise", 0.0) or getattr(router, "moe_jitter_eps", 0.0)
        self.router_jitter_noise = float(router_noise or 0.0)
        # Set by a RoutingRecorder that trains the load-balancing loss: the router probabilities then take
        # its gradient in this block's backward.
        self.trains_balance = False
        self.train(original.training)
        # The layer's routed experts, all of them: under expert parallelism this rank holds a run of them.
        self.num_routed_experts = use_routed_experts(self.experts, routing, grouped_gemm)
        self.second_output = SECOND_OUTPUT.get(self.replaced)
        self.output_bias = OUTPUT_BIAS.get(self.replaced)
        # Shared experts whose output is averaged with the routed experts', not added to it (Cohere2-MoE's
        # shared_expert_combination_strategy "average").
        self.averages_shared = getattr(original, "shared_expert_combination_strategy", "sum") == "average"

    def extra_repr(self) -> str:
        return f"replaces={self.replaced}, {self.routing}"

    def routed(
        self, tokens: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``route`` of (tokens, hidden) ``tokens`` by the block's router child and rule, the routing reported to the
        RoutingRecorder in training (``report_routing``): (fp32 logits, fp32 weights, expert ids)."""
        router = self.get_submodule(self.router_name)
        logits, weights, chosen = route(router, tokens, self.routing, self, input_ids, self.training)
        if self.training:
            weights = report_routing(logits, weights, chosen, self.routing.scoring, self.trains_balance)
        return logits, weights, chosen

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output; ``input_ids``, the tokens' ids, as the decoder layer of a block that routes by them
        passes them (``Routing.choice_table``: DeepSeek-V4's hash layers)."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's and Phi-3.5-MoE's multiplicative input noise
            hidden_states = hidden_states * _jitter(hidden_states, self.jitter_noise)
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.training and self.router_jitter_noise > 0:  # Phi-3.5-MoE's and DBRX's router's (after the block's)
            tokens = tokens * _jitter(tokens, self.router_jitter_noise)
        logits, weights, chosen = self.routed(tokens, input_ids)
        if hasattr(self, "fc1_latent_proj"):  # Nemotron-H: the routed experts work in a latent space (or identities)
            output = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(tokens), chosen, weights))
        else:
            output = self.experts(tokens, chosen, weights)  # transformers' experts signature
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(tokens)
            if hasattr(self, "shared_expert_gate"):  # the Qwen2-MoE family: each token's share set by a gate
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            output = output + shared
            if self.averages_shared:
                output = output / 2
        if hasattr(self, "post_mlp_layernorm"):  # A.X-K1's block normalizes its output
            output = self.post_mlp_layernorm(output)
        if self.output_bias is not None:  # JetMoE's, added after the routed experts' sum
            output = output + getattr(self, self.output_bias)
        if self.second_output is not None:
            return output.reshape(shape), {"weights": weights, "logits": logits}[self.second_output]
        return output.reshape(shape)


def _jitter(hidden_states: torch.Tensor, noise: float) -> torch.Tensor:
    """Uniform noise from 1 - ``noise`` to 1 + ``noise`` shaped as ``hidden_states``, drawn as transformers draws it
    (the same shape, dtype and generator calls: a seeded run multiplies by the same numbers)."""
    return torch.empty_like(hidden_states).uniform_(1.0 - noise, 1.0 + noise)


class FusedRouter(FusedMoeBlock):
    """The fused path of a MoE block that is its decoder layer (Gemma 4's: the routed experts beside the dense MLP),
    which keeps transformers' forward: this module takes the router child's place (its children and tensors under
    their names) and routes as :class:`FusedMoeBlock` does, fp32 and reported; the layer's ``experts`` child stays
    where it is and computes ``routed_experts`` (``use_routed_experts``), called by the layer with the weights and
    experts returned here. Float8 experts, expert parallelism and the planner's checks find it as a FusedMoeBlock,
    whose ``experts`` it names (not a child of its own: the parameter names stay the layer's)."""

    def __init__(self, layer: torch.nn.Module, router_name: str, routing: Routing, grouped_gemm: str = "torch"):
        super().__init__(
            getattr(layer, router_name), routing, grouped_gemm, experts=layer.experts, replaced=type(layer).__name__
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What Gemma 4's router returns for (tokens, hidden) ``hidden_states``: (fp32 probabilities, fp32 weights,
        expert ids), each (tokens, ...). Its layer uses the last two."""
        logits, weights, chosen = self.routed(hidden_states)
        return routing_probabilities(logits, self.routing.scoring), weights, chosen


def use_routed_experts(experts: torch.nn.Module, routing: Routing, grouped_gemm: str = "torch") -> int:
    """Make routed ``experts`` (transformers' module, under PEFT's wrappers) compute ``routed_experts`` with the
    ``grouped_gemm`` kernel (``model.grouped_gemm``), for blocks routed by ``routing``; returns their number.

    The experts run through their outermost module's call, so that hooks on it (FSDP2 gathers the experts as a unit
    of their own) fire; its forward becomes the grouped computation, which reads PEFT's adapters itself instead of
    PEFT's forward building W + ΔW."""
    base_experts = parameter_adapters(experts)[0]
    activation = expert_activation(base_experts)
    experts.forward = types.MethodType(routed_experts, experts)
    experts.grouped_gemm = grouped_gemm  # the kernel routed_experts computes with (model.grouped_gemm)
    experts.activation = activation
    experts.weights_input = routing.weights_input
    experts.swiglu_limit = swiglu_limit(base_experts)
    experts.identity_experts = identity_experts(base_experts)
    return routed_expert_count(base_experts)


def report_routing(
    logits: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, scoring: str, trains_balance: bool
) -> torch.Tensor:
    """Hand one training forward's routing to the current RoutingRecorder; returns ``weights`` (a copy).

    Without a graph break: the per-token statistics are computed and summed over the real tokens in the graph
    (which tokens are real, an opaque op reads from the recorder when it runs: ``shardtune::real_tokens``), and
    an opaque op hands the sums over when it runs (``shardtune::report_routing``). That op decides at run time
    what a traced graph cannot: whether a recording is on, and whether this is activation checkpointing's
    recomputation inside backward (which records nothing, compiled or eager).
    The routing weights pass through it so that it runs in the forward, in order, and, with
    ``trains_balance``, so that its backward can give the router probabilities the load-balancing loss's
    gradient (Megatron-LM attaches its auxiliary loss to the activations the same way): the loss pools
    every layer, so that gradient is known only once the forward is over, when the recorder sets it.
    """
    probabilities = routing_probabilities(logits, scoring)
    sums = sum_real(token_statistics(probabilities, chosen), torch.ops.shardtune.real_tokens(weights.detach()))
    return torch.ops.shardtune.report_routing(weights, sums, probabilities if trains_balance else None)


# Defined with the dispatcher directly, not by torch.library.custom_op, for the host time a call: see
# float8_grouped_kernel.py's float8_grouped_mm. Its operand takes no gradient.
torch.library.define("shardtune::real_tokens", "(Tensor like) -> Tensor")


@torch.library.impl("shardtune::real_tokens", ["CUDA", "CPU"])
def _real_tokens(like: torch.Tensor) -> torch.Tensor:
    """Which tokens of ``like`` (tokens, ...) are real, as 0/1 in its dtype: the recording's mask where the
    forward is recorded, every token otherwise (its statistics are not reported)."""
    recorder = RoutingRecorder.current
    if recorder is None or not recorder.records_now():
        return like.new_ones(like.shape[0])
    return recorder.real_tokens(like)


@torch.library.register_fake("shardtune::real_tokens")
def _(like):
    return like.new_empty(like.shape[0])


@torch.library.custom_op("shardtune::report_routing", mutates_args=())
def _report_routing(weights: torch.Tensor, sums: torch.Tensor, probabilities: torch.Tensor | None) -> torch.Tensor:
    if RoutingRecorder.current is not None:
        RoutingRecorder.current.report(sums)
    return weights.clone()


@_report_routing.register_fake
def _(weights, sums, probabilities):
    return torch.empty_like(weights)


def _report_setup(ctx, inputs, output) -> None:
    probabilities = inputs[2]
    ctx.experts = None if probabilities is None else probabilities.shape[-1]


def _report_backward(ctx, grad: torch.Tensor):
    if not ctx.needs_input_grad[2]:
        return grad, None, None
    real, gradient = torch.ops.shardtune.balance_gradient(grad, ctx.experts)
    return grad, None, real.unsqueeze(-1) * gradient  # d(objective)/d(probabilities) of each real token


_report_routing.register_autograd(_report_backward, setup_context=_report_setup)


@torch.library.custom_op("shardtune::balance_gradient", mutates_args=())
def _balance_gradient(like: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(which tokens of ``like`` (tokens, ...) are real, as 0/1, and the objective's gradient with respect
    to the probability sum): the recorder's, read when the backward runs; zeros before any recording."""
    if RoutingRecorder.current is None:
        return like.new_zeros(like.shape[0]), like.new_zeros(experts)
    return RoutingRecorder.current.balance_gradient(like)


@_balance_gradient.register_fake
def _(like, experts):
    return like.new_empty(like.shape[0]), like.new_empty(experts)


def parameter_adapters(module: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, list[tuple]]]:
    """The module under PEFT's ParamWrappers (or the Linear under PEFT's LoRA layer: a router's, AFMoE's or Jamba's
    in transformers 5.17, whose adapters are its weight's) and, per wrapped parameter name, the active adapters'
    (lora_A weight, lora_B weight, scaling, rank, shared by the experts, the dropout on the adapter's input: an
    identity but for a Linear's). Merged or disabled adapters are left out: their effect is in the base weight
    already, or off. A pair of expert modules (``ExpertPair``: JetMoE's) is its own base; each of its weights'
    adapters are those of the module that holds it (``weight``), under the pair's name for it (``gate_up_proj``,
    ``down_proj``)."""
    if isinstance(module, ExpertPair):
        held = {name: parameter_adapters(child)[1].get("weight") for name, child in module.adapted().items()}
        return module, {name: adapters for name, adapters in held.items() if adapters}
    adapters: dict[str, list[tuple]] = {}
    while hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        if not module.disable_adapters and not module.merged:
            shared = getattr(module, "shared_across_experts", False)  # see lora.share_expert_adapters
            adapters[getattr(module, "parameter_name", "weight")] = [
                (
                    module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name], module.r[name],
                    shared, module.lora_dropout[name],
                )
                for name in module.active_adapters
                if name in module.lora_A
            ]  # fmt: skip
        module = module.base_layer
    return module, adapters


def _compute_dtype(weight: torch.Tensor, tokens: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's, else the weight's (the tokens' for float8 weights, whose
    rows are quantized from the tokens' dtype)."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tokens.dtype if weight.dtype == FLOAT8 else weight.dtype


def route(
    router: torch.nn.Module,
    tokens: torch.Tensor,
    routing: Routing,
    block: torch.nn.Module | None = None,
    input_ids: torch.Tensor | None = None,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 logits (tokens, experts), fp32 weights (tokens, top_k), expert ids (tokens, top_k)) by ``routing``'s
    rule; ``router``, a block's router child or the Linear of its logits it holds (``logits_linear_name``), computes
    the logits (its weight, and a bias where it has one and the rule adds it), under PEFT's adapters. A router's
    correction bias is its own or its ``block``'s (``moe.correction_bias``); the tensors the rule names
    (``input_scale``, ``expert_scale``) are the router child's. ``input_ids``, the tokens' ids in the same order, are
    where a ``routing.choice_table`` of the router's looks the experts up. ``training``: a router that samples
    (``routing.sparsemixer``) draws its experts at random, as transformers' in training mode."""
    router, adapters = parameter_adapters(router)
    holder = router
    if linear_name := logits_linear_name(router):
        router, adapters = parameter_adapters(getattr(router, linear_name))
    device = tokens.device.type
    if routing.sparsemixer is not None:
        # The dtype of the logits of transformers' router, in which SparseMixer draws its random numbers (read before
        # autocast is switched off below).
        if torch.is_autocast_enabled(device):
            draw_dtype = torch.get_autocast_dtype(device)
        else:
            draw_dtype = torch.promote_types(tokens.dtype, router.weight.dtype)
    with torch.autocast(device, enabled=False):
        if routing.input_norm is not None:  # Gemma 4: the router's input RMS-normalized and scaled, in fp32
            tokens = tokens.float()
            tokens = tokens * torch.rsqrt(tokens.square().mean(dim=-1, keepdim=True) + routing.input_norm)
            if routing.input_scale is not None:
                tokens = tokens * getattr(holder, routing.input_scale).float()
            tokens = tokens * routing.input_scaling
        logits = Fp32Linear.apply(tokens, router.weight)
        if routing.logits_bias and isinstance(getattr(router, "bias", None), torch.Tensor):  # GPT-OSS's router
            logits = logits + router.bias.float()
        for lora_a, lora_b, scaling, _, _, dropout in adapters.get("weight", []):
            logits = logits + F.linear(F.linear(dropout(tokens.float()), lora_a.float()), lora_b.float()) * scaling
        if routing.logit_softcap > 0:  # the capped logits are the router's: its hooks record them
            logits = torch.tanh(logits / routing.logit_softcap) * routing.logit_softcap
        if routing.sparsemixer is not None:  # Phi-3.5-MoE's
            weights, chosen = sparsemixer(logits, routing.sparsemixer, training, draw_dtype)
            return logits, weights, chosen
        scores = SCORING_FUNCTIONS[routing.scoring](logits)
        if routing.choice_table is not None:
            if input_ids is None:
                raise ValueError(
                    f"{type(router).__name__} chooses experts by token id ({routing.choice_table}): the block needs "
                    "the tokens' input_ids"
                )
            chosen = getattr(router, routing.choice_table)[input_ids.reshape(-1)].long()
        else:
            chosen = _best_experts(logits, scores, routing, correction_bias(router, block))
        weights = scores.gather(1, chosen)
        if routing.normalize:
            if routing.norm_p == 1.0:
                total = weights.sum(dim=-1, keepdim=True)
            else:  # DBRX's moe_normalize_expert_weights
                total = torch.linalg.vector_norm(weights, ord=routing.norm_p, dim=-1, keepdim=True)
            weights = weights / (total + routing.epsilon)
        weights = weights * routing.scaling
        if routing.expert_scale is not None:  # Gemma 4's per_expert_scale, at each chosen expert
            weights = weights * getattr(holder, routing.expert_scale).float()[chosen]
        return logits, weights, chosen


def sparsemixer(
    logits: torch.Tensor, tolerance: float, training: bool, draw_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's routing (GRIN, arXiv 2409.12136), as Phi-3.5-MoE's router computes it: (weights, experts), each
    (tokens, 2), from fp32 ``logits`` (tokens, experts).

    Two rounds, each choosing one expert among those not chosen yet. The round's candidates are the experts whose logit
    is within ``tolerance`` (router_jitter_noise) of the round's best b, relatively: (b - logit) / max(|logit|, b) is
    at most 2 x tolerance (the others' logits -inf). The expert's weight is its share of the candidates' softmax. In
    evaluation the expert is the round's best; in ``training`` it is drawn from that softmax by the Gumbel-max trick
    (the best of the masked logits minus the logs of Exp(1) draws), and its weight in the forward is multiplied by 1
    where it is the most probable candidate or a uniform draw exceeds 0.75, else by 0.3333, while its gradient stays
    the unscaled weight's (the paper's midpoint rule for Heun's third-order method: transformers' PhimoeMultiplier
    returns g x w x (onehot - p) for the logits, which is the autograd gradient of w = p[chosen] itself).

    The random numbers are drawn in transformers' order, shapes and ``draw_dtype`` (its logits'), so a seeded run
    draws what transformers' does: per round an (tokens, experts) Exp(1) tensor, then a (tokens, 1) uniform one, drawn
    twice in the second round (transformers fills it with rand_like, then again with uniform_, and reads the second).
    """
    weights, chosen = [], []
    remaining = logits  # the logits, the experts chosen in earlier rounds at -inf
    for round_ in range(2):
        with torch.no_grad():
            best, best_expert = remaining.max(dim=-1, keepdim=True)
            outside = (best - logits) / logits.abs().clamp(min=best) > 2 * tolerance
        candidates = remaining.masked_fill(outside, float("-inf"))
        if training:
            exponential = torch.empty(candidates.shape, dtype=draw_dtype, device=logits.device).exponential_()
            expert = (candidates - exponential.float().log()).max(dim=-1, keepdim=True).indices
        else:
            expert = best_expert
        probabilities = candidates.softmax(dim=-1)
        weight = probabilities.gather(1, expert)
        if training:
            uniform = torch.rand(weight.shape, dtype=draw_dtype, device=logits.device)
            if round_ == 1:
                uniform.uniform_()
            with torch.no_grad():
                likeliest = expert == probabilities.max(dim=-1, keepdim=True).indices
                factor = torch.where(likeliest | (uniform > 0.75), 1.0, 0.3333)
            # The value weight x factor (exactly: the second term is 0), the gradient the weight's alone.
            weight = (weight * factor).detach() + (weight - weight.detach())
        weights.append(weight)
        chosen.append(expert)
        remaining = remaining.scatter(1, expert, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)


def _best_experts(
    logits: torch.Tensor, scores: torch.Tensor, routing: Routing, bias: torch.Tensor | None
) -> torch.Tensor:
    """Each token's ``routing.top_k`` experts by their scores (or logits) plus the correction ``bias``, among the best
    groups (``Routing``)."""
    for_choice = logits if routing.choose_on == "logits" else scores
    if bias is not None:
        for_choice = for_choice + bias.float()
    if routing.groups > 1:
        # The group width given: a rank that routes no token (under expert parallelism) has a view of 0 elements.
        grouped = for_choice.view(for_choice.shape[0], routing.groups, for_choice.shape[1] // routing.groups)
        if routing.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(routing.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        for_choice = grouped.masked_fill(~keep.unsqueeze(-1), routing.masked_score).view_as(scores)
    # Best first as softmax routers' torch.topk returns them (it decides only the order of a token's sum).
    return top_k_experts(for_choice, routing.top_k, best_first=routing.scoring == "softmax")


def top_k_experts(scores: torch.Tensor, top_k: int, best_first: bool = True) -> torch.Tensor:
    """The columns of each row's ``top_k`` largest ``scores`` (tokens, experts): one Triton kernel where it runs
    (best first, ``routing_kernels.top_k_experts``), else ``torch.topk``, sorted when ``best_first``."""
    if routing_kernels is not None and runs_on(scores.device):
        return routing_kernels.top_k_experts(scores, top_k)
    return scores.topk(top_k, dim=-1, sorted=best_first).indices


def expert_order(expert_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs ``expert_ids`` (pairs,) in expert order, stably: (``order``, row p of the
    expert-sorted layout is pair order[p]; ``inverse``, pair q's row; ``bounds`` (experts + 1,) int32, expert e's
    rows are bounds[e]:bounds[e + 1], as the grouped GEMMs take them). On the device, with no host sync: two Triton
    kernels where they run (``routing_kernels.expert_order``), else a stable sort."""
    if routing_kernels is not None and runs_on(expert_ids.device):
        return routing_kernels.expert_order(expert_ids, experts)
    if experts <= torch.iinfo(torch.int16).max:
        # A radix sort makes one pass per key byte: 2 over 16-bit keys where int64 ids take 8, for the same
        # stable order (Qwen3-30B-A3B's 65,536 pairs on one H200: 47 against 93 us).
        expert_ids = expert_ids.to(torch.int16)
    expert_of_row, order = torch.sort(expert_ids, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    below_each = torch.arange(-1, experts, device=expert_ids.device, dtype=expert_ids.dtype)  # bounds[e + 1]: ids <= e
    return order, inverse, torch.searchsorted(expert_of_row, below_each, right=True, out_int32=True)


class Fp32Linear(torch.autograd.Function):
    """x @ w^T computed in fp32 from operands kept for backward in their own (bf16) dtype: an fp32 copy
    of every layer's input would otherwise stay alive until backward.

    On CUDA, bf16 (or fp16) operands of one dtype are multiplied by a tensor-core GEMM that accumulates and
    writes fp32: their products are exact in fp32, so it differs from the fp32 GEMM of their fp32 copies in
    summation order only. Qwen3-30B-A3B's router at 8,192 tokens on one H200: 15 against 93 us, and no fp32
    copies of the tokens (``mm.dtype`` has no derivative, hence this function also when compiled)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and MM_OUT_DTYPE:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.T @ x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def routed_experts(
    experts: torch.nn.Module, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(tokens[t]) for every token t, as grouped GEMMs; with the experts'
    ``weights_input`` (Llama 4's), sum_j expert_{chosen[t, j]}(weights[t, j] * tokens[t]).

    Identity experts (``identity_experts``: LongCat-Flash's zero-computation ones, the last ids, so their rows come
    last in expert order) skip the GEMMs: those run over the GEMM experts' rows alone, by their bounds, and each
    token adds its identity choices' summed weight times itself. A grouped GEMM over the GEMM experts' bounds leaves
    the other rows of its output, and of its input gradient, unwritten (any values, NaN among them): they are set to 0
    (``masked_fill``, whose backward does the same to the gradient) where they would reach a sum. No host sync, every
    shape static. Under expert parallelism the identity experts' rows stay here: only the GEMM experts' rows go through
    the token exchange (``ExpertDispatch.send``), and their outputs come back with zeros in the identity rows' place."""
    # Set under expert parallelism (distributed/expert_parallel.py): this rank holds a run of the experts,
    # and rows travel to the rank of their expert and back.
    dispatch = getattr(experts, "expert_dispatch", None)
    backend = experts.grouped_gemm
    float8_backend = getattr(experts, "float8_grouped_gemm", "torch")
    activation, weights_input, limit = experts.activation, experts.weights_input, experts.swiglu_limit
    identities = experts.identity_experts
    experts, adapters = parameter_adapters(experts)
    # (E, 2I, H), (E, H, I): this rank's experts; transposed (Llama 4's), (E, H, 2I) and (E, I, H), which torch's
    # grouped GEMM takes as they are (as GPT-OSS's); ungated, an (E, I, H) up projection. Slab experts (DBRX's):
    # gate and up (E, I, H) views apart, each its own GEMM, and down an (E, I, H) view, (in, out) as transposed
    # experts' (torch's grouped GEMM takes it as it is).
    slabs = expert_slabs(experts)
    if slabs is not None:
        gate_up, up, down = slabs
    else:
        gate_up, down = getattr(experts, input_projection(activation)), experts.down_proj
    if identities:
        gate_up = gate_up[: down.shape[0]]  # LongCat-Flash's: the identity experts' rows are never read
    transposed = activation in ("transposed_silu", "clamped_glu")
    if transposed:
        backend = "torch"
    down_transposed, down_backend = (True, "torch") if slabs is not None else (transposed, backend)
    # PEFT reads a 3-D weight as (E, out, in) unless its module is marked is_transposed: on unmarked transposed
    # weights its A factor multiplies from the output side (_projection).
    lora_reversed = transposed and not getattr(experts, "is_transposed", False)
    dtype = _compute_dtype(gate_up, tokens)
    top_k = chosen.shape[1]
    # The layer's GEMM experts, all of them (under expert parallelism the group's; the identity experts' ids follow).
    gemm_experts = gate_up.shape[0] if dispatch is None else dispatch.ep_size * dispatch.local_experts
    order, inverse, bounds = expert_order(chosen.reshape(-1), gemm_experts + identities)  # e: rows bounds[e]:[e+1]
    row_weights = Permute.apply(weights.reshape(-1), order, inverse)  # the fp32 routing weight of each row
    identity_rows = None
    if identities:  # the GEMM experts' bounds; the rows after them, (pairs, 1) True, are the identity experts'
        bounds = bounds[: gemm_experts + 1]
        identity_rows = (torch.arange(order.shape[0], device=order.device) >= bounds[-1]).unsqueeze(-1)
    # The rows the GEMMs leave unwritten, on the experts' side: under expert parallelism they got only GEMM rows.
    unwritten = identity_rows if dispatch is None else None
    if slabs is not None:  # gate's and up's forms apart (Float8Experts takes them so), down's as a transposed weight's
        gate_up_float8, down_float8 = _float8_slabs(experts, slabs)
    else:
        gate_up_float8 = _float8_weight(experts, input_projection(activation), transposed, gate_up.shape[0])
        down_float8 = _float8_weight(experts, "down_proj", transposed)
    # LoRA on attention, the MoE default; not for experts that take weighted rows (Llama 4's): those are not the tokens,
    # nor for biased ones (GPT-OSS's, _clamped_glu_experts: float8 products, then the biases).
    if (
        gate_up_float8 is not None
        and dispatch is None
        and not adapters
        and not weights_input
        and activation != "clamped_glu"
    ):
        token_of_row = (order // top_k).to(torch.int32)
        output = Float8Experts.apply(
            tokens.to(dtype), row_weights, token_of_row, inverse, top_k, bounds, float8_backend, activation, limit,
            identity_rows, *gate_up_float8, *down_float8,
        )  # fmt: skip
        return output if identity_rows is None else _plus_identities(output, tokens, weights, chosen, gemm_experts)
    rows = GatherRows.apply(tokens.to(dtype), order, inverse, top_k)  # (pairs, H), the only copy of the inputs
    if identity_rows is not None:  # masked_fill's backward sets their input gradient, which the GEMMs leave unwritten
        rows = rows.masked_fill(identity_rows, 0)

    # LoRA's A factors take their rows without autograd keeping them: backward builds them again from what the
    # block keeps anyway (LowRankOfRebuiltRows). Rows that came from other ranks (expert parallelism) cannot be
    # gathered here, so those are kept.
    def regathered(a: torch.Tensor) -> torch.Tensor:
        return LowRankOfRebuiltRows.apply(rows, a, bounds, "gathered", tokens, order, top_k)

    if weights_input:
        # Each row scaled by its weight before gate/up, the activation by 1: the experts are not linear in their
        # input. LoRA's A factors on gate/up then keep these rows, which gathering the tokens again would not give.
        rows = rows * row_weights.to(dtype).unsqueeze(-1)
        row_weights = torch.ones_like(row_weights)
    if dispatch is not None:
        rows, row_weights, bounds, receive_back = dispatch.send(rows, row_weights, bounds)
    low_rank = regathered if dispatch is None and not weights_input else None
    if activation == "clamped_glu":
        outputs = _clamped_glu_experts(
            experts, adapters, rows, bounds, row_weights, dtype, low_rank, gate_up_float8, down_float8, float8_backend
        )  # fmt: skip
        if dispatch is not None:
            outputs = receive_back(outputs)
        return SumRows.apply(outputs, order, inverse, top_k)
    gate_up_adapters = adapters.get(input_projection(activation), [])
    if slabs is not None:
        # No adapters (lora.moe_targets refuses routed_experts); float8 slabs took Float8Experts above (they have no
        # adapters, and float8 experts no dispatch: expert parallelism shards them under FSDP, which float8 refuses).
        projected = torch.cat([_projection(rows, weight, [], bounds, dtype, backend) for weight in (gate_up, up)], -1)
    else:
        projected = _projection(
            rows, gate_up, gate_up_adapters, bounds, dtype, backend, low_rank, gate_up_float8, float8_backend,
            transposed, lora_reversed,
        )  # fmt: skip
    if unwritten is not None:  # the identity rows' gate/up output, unwritten: 0, and so is their activation
        projected = projected.masked_fill(unwritten, 0)

    def reactivated(a: torch.Tensor) -> torch.Tensor:
        fp32 = _activation_precision(projected) == torch.float32
        return LowRankOfRebuiltRows.apply(
            hidden, a, bounds, "activated", projected, row_weights, fp32, limit, activation
        )  # fmt: skip

    if activation == "relu2":
        hidden = WeightedReluSquared.apply(projected, row_weights)
    else:
        hidden = WeightedSiluMul.apply(projected, row_weights, limit, activation)
    if unwritten is not None:  # the activation's gradient: the down projection leaves the identity rows' unwritten
        hidden = hidden.masked_fill(unwritten, 0)
    down_adapters = adapters.get("down_proj", [])
    if (
        dispatch is None
        and not down_adapters
        and not down.requires_grad
        and down_float8 is None
        and identity_rows is None
    ):
        # A frozen down projection without LoRA sums its rows back to the tokens in the same function, whose
        # backward gathers each row's token gradient inside the input gradient's GEMM where the kernel can.
        token_of_row = (order // top_k).to(torch.int32)
        weight = down.to(dtype) if down_transposed else down.to(dtype).transpose(-2, -1)
        return ProjectionSummed.apply(hidden, weight, bounds, token_of_row, inverse, top_k, down_backend)
    outputs = _projection(
        hidden, down, down_adapters, bounds, dtype, down_backend, reactivated, down_float8, float8_backend,
        down_transposed, lora_reversed,
    )  # fmt: skip
    if dispatch is not None:
        outputs = receive_back(outputs)  # this rank's (pair) rows again, in expert-sorted order
    if identity_rows is None:
        return SumRows.apply(outputs, order, inverse, top_k)
    output = SumRows.apply(outputs.masked_fill(identity_rows, 0), order, inverse, top_k)
    return _plus_identities(output, tokens, weights, chosen, gemm_experts)


def _plus_identities(
    output: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gemm_experts: int
) -> torch.Tensor:
    """The GEMM experts' ``output`` plus each token's identity experts (ids from ``gemm_experts`` on): their summed
    weight times the token (per token, not per row: nothing of the (pairs, H) rows is kept for the weights'
    gradient)."""
    identity_weight = (weights * (chosen >= gemm_experts)).sum(dim=-1, keepdim=True)
    return output + (identity_weight * tokens.float()).to(output.dtype)


def _clamped_glu_experts(
    experts: torch.nn.Module,
    adapters: dict[str, list[tuple]],
    rows: torch.Tensor,
    bounds: torch.Tensor,
    row_weights: torch.Tensor,
    dtype: torch.dtype,
    low_rank: Callable[[torch.Tensor], torch.Tensor] | None,
    gate_up_float8: tuple[torch.Tensor, ...] | None = None,
    down_float8: tuple[torch.Tensor, ...] | None = None,
    float8_backend: str = "torch",
) -> torch.Tensor:
    """GPT-OSS's experts (``expert_activation``: ``clamped_glu``) on the expert-sorted ``rows`` (expert e: rows
    bounds[e]:bounds[e+1] of this rank's experts), as output rows in the same order: each projection adds its expert's
    bias, and the routing weight multiplies the down projection's input and its bias (w (h W + b) = (w h) W + w b).
    The activation is :class:`WeightedSiluMul`'s ``clamped_glu``, in fp32, which keeps only the gate/up output (its
    bias added) and the routing weights for backward, and the down projection's weighted bias
    :class:`WeightedBiasRows`, which keeps no rows. The grouped GEMMs are torch's, which take the (E, in, out) weights
    as they are, or with float8 experts the weights' float8 forms (``Float8Product``), the biases added after in their
    own dtype. LoRA's A factors build their rows again in backward: gate/up's where ``low_rank`` does
    (``regathered``, as in ``routed_experts``), down's from the gate/up output (``reactivated``)."""
    positions = torch.arange(rows.shape[0], device=rows.device, dtype=bounds.dtype)
    # Over the whole bounds, not bounds[1:]: torch 2.11's inductor reads a sliced searchsorted boundary from its base
    # tensor's start, which gave the last expert's rows an expert id past the biases (a device-side assert on GPUs).
    expert_of_row = torch.searchsorted(bounds, positions, right=True) - 1
    projected = _projection(
        rows, experts.gate_up_proj, adapters.get("gate_up_proj", []), bounds, dtype, "torch", low_rank,
        gate_up_float8, float8_backend, transposed=True,
    )  # fmt: skip
    projected = projected + experts.gate_up_proj_bias.to(dtype).index_select(0, expert_of_row)
    limit, alpha = float(experts.limit), float(experts.alpha)
    hidden = WeightedSiluMul.apply(projected, row_weights, limit, "clamped_glu", alpha)

    def reactivated(a: torch.Tensor) -> torch.Tensor:
        compiled = torch.compiler.is_compiling()
        return LowRankOfRebuiltRows.apply(
            hidden, a, bounds, "activated", projected, row_weights, compiled, limit, "clamped_glu", alpha
        )  # fmt: skip

    outputs = _projection(
        hidden, experts.down_proj, adapters.get("down_proj", []), bounds, dtype, "torch", reactivated, down_float8,
        float8_backend, transposed=True,
    )  # fmt: skip
    return outputs + WeightedBiasRows.apply(experts.down_proj_bias, expert_of_row, row_weights, outputs.dtype)


class WeightedBiasRows(torch.autograd.Function):
    """weights[p] * bias[expert[p]] for each row p (the fp32 routing weight times its expert's bias), in ``dtype``;
    backward gathers the bias rows again instead of keeping them (the product's autograd kept the gathered rows, a
    pairs x hidden fp32 tensor, for the routing weights' gradient)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, expert: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype):
        ctx.save_for_backward(bias, expert, weights)
        return in_dtype(weights.unsqueeze(-1) * bias.index_select(0, expert).float(), dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        bias, expert, weights = ctx.saved_tensors
        grad, grad_bias, grad_weights = grad.float(), None, None
        if ctx.needs_input_grad[0]:
            summed = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            grad_bias = summed.index_add_(0, expert, grad * weights.unsqueeze(-1)).to(bias.dtype)
        if ctx.needs_input_grad[2]:
            # Cast, then gathered: an expression other than the forward's, which a compiled graph would otherwise
            # share with it and keep the pairs x hidden rows for (measured on tiny GPT-OSS compiled on CPU)
            grad_weights = (grad * bias.float().index_select(0, expert)).sum(dim=-1)
        return grad_bias, None, grad_weights, None


def _projection(
    rows: torch.Tensor,
    weight: torch.Tensor,
    adapters: list[tuple],
    bounds: torch.Tensor,
    dtype: torch.dtype,
    backend: str,
    low_rank: Callable[[torch.Tensor], torch.Tensor] | None = None,
    float8: tuple[torch.Tensor, ...] | None = None,
    float8_backend: str = "torch",
    transposed: bool = False,
    lora_reversed: bool = False,
) -> torch.Tensor:
    """rows @ W_e^T for each row's expert e (the ``backend`` kernel where it takes the weight; in float8 by
    ``float8_backend`` where ``float8``, W's quantized forms, is given), plus each LoRA adapter's
    rows @ A_e^T @ B_e^T * scaling (``low_rank``: computes rows @ A_e^T, or rows @ A^T for a shared adapter,
    without keeping ``rows`` for backward).

    ``weight`` is transformers' (E, out, in), or with ``transposed`` (GPT-OSS, Llama 4) (E, in, out), rows @ W_e.
    PEFT's ParamWrapper on it holds lora_A (r*E, in), whose rows e*r..(e+1)*r are A_e, and lora_B (out, r*E), whose
    columns e, e+E, ... are B_e (its get_delta_weight: ΔW_e = B_e @ A_e * scaling, transposed for a transposed
    weight). With ``lora_reversed`` PEFT took the transposed weight for (E, out, in) (Llama 4's experts are not
    marked is_transposed): its "in" is the rows' output, ΔW_e = B_e @ A_e is (in, out) as it is, and the rows take
    B_e first. A shared adapter is the same for every expert. An adapter may hold more experts than ``weight``
    (LongCat-Flash's gate_up_proj, whose identity experts' rows ``routed_experts`` leaves out): the first ones are
    ``weight``'s.
    """
    num_experts = weight.shape[0]
    if float8 is not None:
        result = Float8Product.apply(rows, *float8, bounds, float8_backend)
    else:
        result = grouped_mm(
            rows, weight.to(dtype) if transposed else weight.to(dtype).transpose(-2, -1), bounds, backend
        )
    for lora_a, lora_b, scaling, rank, shared, _ in adapters:  # no dropout: PEFT allows a parameter's none
        adapted = lora_a.shape[0] // rank  # the experts of the adapter
        if shared:  # one adapter for every expert: the mean of the (equal) per-expert blocks, dense GEMMs
            a = lora_a.view(adapted, rank, -1).mean(dim=0).to(dtype)  # (r, in)
            b = lora_b.view(lora_b.shape[0], rank, adapted).mean(dim=-1).to(dtype)  # (out, r)
            if lora_reversed:
                a, b = b.t(), a.t()
            low = F.linear(rows, a) if low_rank is None else low_rank(a.t())
            result = result + F.linear(low * scaling, b)
            continue
        a, b = expert_lora_factors(lora_a, lora_b, adapted, rank, dtype)
        if adapted != num_experts:
            a, b = a[:num_experts], b[:num_experts]
        if lora_reversed:
            a, b = b.transpose(-2, -1), a.transpose(-2, -1)
        low = (grouped_mm(rows, a, bounds) if low_rank is None else low_rank(a)) * scaling  # (pairs, r)
        result = result + grouped_mm(low, b, bounds)
    return result


# An opaque op, so that its outputs have exactly the strides its fake implementation states: the grouped
# GEMM takes its weight operand only row- or column-major per expert, and inductor, left to lay out this
# copy itself, kept lora_B's own order (the expert index innermost: "Invalid strides/sizes" from
# _grouped_mm) and dropped the copy that .contiguous() asked for.
@torch.library.custom_op("shardtune::expert_lora_factors", mutates_args=())
def expert_lora_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's per-expert factors as grouped-GEMM weights: A_e^T (E, in, r) and B_e^T (E, r, out), each
    expert's matrix column-major, the rank zero-padded to a multiple of 8 (16-byte aligned rows)."""
    a, b = _empty_lora_factors(lora_a, lora_b, num_experts, rank, dtype)
    if a.shape[-1] != rank:  # the padding's rows and columns
        a.zero_()
        b.zero_()
    a[..., :rank].copy_(lora_a.view(num_experts, rank, -1).transpose(-2, -1))  # A_e is rows e*r..(e+1)*r
    b[:, :rank].copy_(lora_b.view(lora_b.shape[0], rank, num_experts).permute(2, 1, 0))  # B_e: columns e, e+E, ...
    return a, b


@expert_lora_factors.register_fake
def _(lora_a, lora_b, num_experts, rank, dtype):
    return _empty_lora_factors(lora_a, lora_b, num_experts, rank, dtype)


def _empty_lora_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    padded_rank = rank + -rank % 8
    a = lora_a.new_empty(num_experts, padded_rank, lora_a.shape[1], dtype=dtype).transpose(-2, -1)
    b = lora_b.new_empty(num_experts, lora_b.shape[0], padded_rank, dtype=dtype).transpose(-2, -1)
    return a, b


def _lora_factors_setup(ctx, inputs, output) -> None:
    lora_a, lora_b, _, rank, _ = inputs
    ctx.rank, ctx.dtypes = rank, (lora_a.dtype, lora_b.dtype)


def _lora_factors_backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor):
    """The forward's re-layout undone: (E, in, r) to lora_A's (r*E, in), (E, r, out) to lora_B's (out, r*E)."""
    rank = ctx.rank
    num_experts, fan_in, fan_out = grad_a.shape[0], grad_a.shape[1], grad_b.shape[2]
    grad_lora_a = grad_a[..., :rank].transpose(-2, -1).reshape(num_experts * rank, fan_in)
    grad_lora_b = grad_b[:, :rank].permute(2, 1, 0).reshape(fan_out, rank * num_experts)
    return grad_lora_a.to(ctx.dtypes[0]), grad_lora_b.to(ctx.dtypes[1]), None, None, None


expert_lora_factors.register_autograd(_lora_factors_backward, setup_context=_lora_factors_setup)


def _gather_rows(tokens: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Row p of the expert-sorted layout: token order[p] // top_k."""
    return tokens.index_select(0, order // top_k)


def _sum_rows(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's ``top_k`` expert-sorted rows (token t's are rows inverse[t * top_k + j]) summed in fp32."""
    if torch.compiler.is_compiling():
        # A running sum over the k rows: inductor makes it one elementwise kernel with k gathered loads,
        # 3.3x faster on one H200 than the reduction over a (tokens, k, H) view, which it tiles poorly (108
        # against 360 us at 8,192 tokens, k 8, H 2,048; equal at k 2: benchmarks/moe_kernels.py).
        index = inverse.view(-1, top_k)
        total = rows.index_select(0, index[:, 0]).float()
        for choice in range(1, top_k):
            total = total + rows.index_select(0, index[:, choice]).float()
        return in_dtype(total, rows.dtype)
    per_choice = rows.index_select(0, inverse).view(-1, top_k, rows.shape[-1])
    return in_dtype(per_choice.sum(dim=1, dtype=torch.float32), rows.dtype)


class GatherRows(torch.autograd.Function):
    """Each (token, choice) pair's token as a row of the expert-sorted layout. The backward of a plain
    index_select is a scatter-add (atomics, slow in bf16); this one is the adjoint :func:`_sum_rows`."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return _gather_rows(tokens, order, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _sum_rows(grad, inverse, ctx.top_k), None, None, None


class SumRows(torch.autograd.Function):
    """The expert-sorted (already weighted) output rows summed back to token order, the adjoint of
    :class:`GatherRows`: its backward gathers each row's token gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _sum_rows(rows, inverse, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _gather_rows(grad, order, ctx.top_k), None, None, None


class ProjectionSummed(torch.autograd.Function):
    """The grouped GEMM by a weight that takes no gradient, then ``SumRows``. Backward: each row's token
    gradient gathered (SumRows' backward) inside the input gradient's GEMM where its kernel can."""

    @staticmethod
    def forward(ctx, rows, weight, bounds, token_of_row, inverse, top_k: int, backend: str) -> torch.Tensor:
        ctx.save_for_backward(weight, bounds, token_of_row)
        ctx.backend = backend
        return _sum_rows(grouped_mm(rows, weight, bounds, backend), inverse, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, bounds, token_of_row = ctx.saved_tensors
        grad_rows = gathered_grouped_mm(grad.contiguous(), token_of_row, weight.transpose(-2, -1), bounds, ctx.backend)
        return grad_rows, None, None, None, None, None, None


class Float8Experts(torch.autograd.Function):
    """The routed experts of a block whose expert weights are frozen in float8 (``use_float8_experts``) and carry
    no LoRA (LoRA on attention, the MoE default), as one function so that each GEMM's rows are written in e4m3 by
    the kernel that makes them, never in bf16 to be quantized after:

    - gate/up quantizes each token once and gathers its e4m3 row with its scale (a gathered row's rowwise scale
      is its token's): ``top_k`` times less quantization work than quantizing the gathered rows, and half the
      gathered bytes, for the same operands bit for bit;
    - the weighted SiLU writes the down projection's rows in e4m3 (``weighted_silu_mul_float8``), and its
      backward the gate/up input gradient's (``weighted_silu_mul_backward_float8``): Triton kernels on CUDA that
      read each row once, where inductor read the rows twice to quantize them (and in backward first wrote them
      in bf16); the activation itself is never kept, as ``WeightedSiluMul`` keeps only the gate/up output;
    - the down projection's rows are summed back to the tokens here, and its backward quantizes each token's
      gradient once before gathering the rows, as gate/up does its tokens.

    Elsewhere (CPU) the SiLU's kernels are the torch ops then ``rowwise_float8``: the same operands, up to the
    rounding of the SiLU's math. So are, everywhere, the activations the Triton kernels do not compute: ungated experts'
    ``activation`` ``relu2`` (``WeightedReluSquared``'s), ``gelu_tanh`` and a SwiGLU ``limit`` (``WeightedSiluMul``'s
    GELU and clamp). With ``identity_rows`` ((pairs, 1) True for identity experts' rows, which the GEMMs over the GEMM
    experts' ``bounds`` leave unwritten) those rows are set to 0 in every GEMM's output, forward and backward, as
    ``routed_experts`` does; their tokens' identity term is the caller's. ``weights``: gate/up's (values, scales,
    values_t, scales_t) (``Float8Product``'s forms), or for gate and up held apart (DBRX's slabs, ``_float8_slabs``)
    gate's (values, scales), up's and then their concatenation's (values_t, scales_t): two forward GEMMs whose outputs
    are the [gate | up] halves, one backward GEMM; then down's four forms. Gives the tokens' and the routing weights'
    gradients."""

    @staticmethod
    def forward(
        ctx, tokens, row_weights, token_of_row, inverse, top_k: int, bounds, backend: str, activation: str,
        limit: float | None, identity_rows: torch.Tensor | None, *weights,
    ):  # fmt: skip
        gate_up_forward, (gate_up_values_t, gate_up_scales_t) = weights[:-6], weights[-6:-4]
        down_values, down_scales, down_values_t, down_scales_t = weights[-4:]
        rows = gathered_rowwise_float8(tokens, token_of_row)
        projected = [
            float8_grouped_mm(*rows, values, scales, bounds, tokens.dtype, backend)
            for values, scales in zip(gate_up_forward[::2], gate_up_forward[1::2], strict=True)
        ]
        projected = _written(projected[0] if len(projected) == 1 else torch.cat(projected, dim=-1), identity_rows)
        hidden = _weighted_activation_float8(projected, row_weights, limit, activation)
        output = _written(
            float8_grouped_mm(*hidden, down_values, down_scales, bounds, tokens.dtype, backend), identity_rows
        )
        ctx.save_for_backward(
            projected, row_weights, token_of_row, inverse, bounds, identity_rows, gate_up_values_t, gate_up_scales_t,
            down_values_t, down_scales_t,
        )  # fmt: skip
        ctx.top_k, ctx.backend, ctx.activation, ctx.limit = top_k, backend, activation, limit
        ctx.weights = len(weights)
        return _sum_rows(output, inverse, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        projected, row_weights, token_of_row, inverse, bounds, identity_rows, *weights = ctx.saved_tensors
        gate_up_values_t, gate_up_scales_t, down_values_t, down_scales_t = weights
        rows = gathered_rowwise_float8(grad, token_of_row)
        grad_hidden = _written(
            float8_grouped_mm(*rows, down_values_t, down_scales_t, bounds, grad.dtype, ctx.backend), identity_rows
        )  # fmt: skip
        *grad_projected, grad_weights = _weighted_activation_backward_float8(
            projected, row_weights, grad_hidden, ctx.limit, ctx.activation
        )  # fmt: skip
        grad_rows = float8_grouped_mm(
            *grad_projected, gate_up_values_t, gate_up_scales_t, bounds, grad.dtype, ctx.backend
        )  # fmt: skip
        grad_tokens = _sum_rows(_written(grad_rows, identity_rows), inverse, ctx.top_k)
        return grad_tokens, grad_weights, *[None] * (8 + ctx.weights)


def _written(rows: torch.Tensor, identity_rows: torch.Tensor | None) -> torch.Tensor:
    """A grouped GEMM's output ``rows`` with the identity experts' rows, which it leaves unwritten, set to 0."""
    return rows if identity_rows is None else rows.masked_fill(identity_rows, 0)


# The layouts whose activation is a plain SiLU(gate) * up of a [gate | up] row: the Triton backward kernel's.
SILU_KERNEL_LAYOUTS = ("silu", "transposed_silu", "split_silu")


def _silu_kernel(activation: str, limit: float | None) -> bool:
    """Whether the Triton kernels (``weighted_silu_kernel.py``) compute the experts' ``activation``: an unclamped
    SiLU."""
    return activation in SILU_KERNEL_LAYOUTS and limit is None


def _weighted_activation_float8(
    gate_up: torch.Tensor, row_weights: torch.Tensor, limit: float | None = None, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rowwise_float8(_weighted_activation(gate_up, row_weights, ...))``: for an unclamped SiLU (``_silu_kernel``)
    one Triton kernel on CUDA, for rows it holds."""
    width = gate_up.shape[1] // 2
    if (
        weighted_silu_mul_float8 is not None
        and _silu_kernel(activation, limit)
        and runs_on(gate_up.device)
        and gate_up.shape[0] > 0
        and width <= FLOAT8_ROW_TILE
    ):
        return weighted_silu_mul_float8(gate_up.contiguous(), row_weights.contiguous())
    return rowwise_float8(_weighted_activation(gate_up, row_weights, _activation_precision(gate_up), limit, activation))


def _weighted_activation_backward_float8(
    gate_up: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor, limit: float | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``WeightedSiluMul``'s (``WeightedReluSquared``'s) backward with the gate/up gradient quantized by
    ``rowwise_float8``: (its e4m3 values, their scales, the routing weights' gradient); for an unclamped SiLU one
    Triton kernel on CUDA."""
    if activation == "relu2":
        grad_gate_up, grad_weights = _weighted_relu_squared_backward(gate_up, row_weights, grad)
        return *rowwise_float8(grad_gate_up), grad_weights
    if (
        weighted_silu_mul_backward_float8 is not None
        and _silu_kernel(activation, limit)
        and runs_on(gate_up.device)
        and gate_up.shape[0] > 0
    ):
        return weighted_silu_mul_backward_float8(gate_up.contiguous(), row_weights.contiguous(), grad.contiguous())
    grad_gate_up, grad_weights = _weighted_silu_mul_backward(gate_up, row_weights, grad, limit, activation)
    return *rowwise_float8(grad_gate_up), grad_weights


class Permute(torch.autograd.Function):
    """x[index] for a permutation ``index``; its backward is the gather by the inverse permutation, not
    index_select's scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class LowRankOfRebuiltRows(torch.autograd.Function):
    """``rows @ A_e`` for each row's expert e (LoRA's A factor on the routed rows; ``a`` (E, in, r), or
    (in, r) for an adapter shared by all experts), where backward builds ``rows`` again for A's gradient from
    what the block keeps anyway instead of keeping them:

    - ``"gathered"`` (sources: the block's input, ``order``, top_k): the routed rows of gate/up are the
      block's input gathered by expert (pairs x hidden: 256 MiB a layer for Qwen3-30B-A3B at 8,192 tokens;
      the input itself is top_k times smaller);
    - ``"activated"`` (sources: the gate/up output, the rows' routing weights, whether forward computed in
      fp32, the SwiGLU limit or None, the ``expert_activation``, for ``clamped_glu`` its alpha): the down
      projection's rows are :class:`WeightedSiluMul` (ungated experts: :class:`WeightedReluSquared`) of the gate/up
      output, which its own backward keeps (pairs x expert width: 96 MiB a layer for Qwen3-30B-A3B).
    """

    @staticmethod
    def forward(ctx, rows, a, bounds, how, *sources):
        ctx.save_for_backward(a, bounds, *(source for source in sources if isinstance(source, torch.Tensor)))
        ctx.how, ctx.sources = how, len(sources)
        ctx.constants = [source for source in sources if not isinstance(source, torch.Tensor)]
        return grouped_mm(rows, a, bounds) if a.dim() == 3 else rows @ a

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, bounds, first, second = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = grouped_mm(grad, a.transpose(-2, -1), bounds) if a.dim() == 3 else grad @ a.t()
        if ctx.how == "gathered":
            grad_a = torch.ops.shardtune.regathered_weight_grad(first, second, grad, bounds, a, *ctx.constants)
        else:
            grad_a = torch.ops.shardtune.reactivated_weight_grad(first, second, grad, bounds, a, *ctx.constants)
        return grad_rows, grad_a, None, None, *([None] * ctx.sources)


# Opaque, and taking the output gradient, so that a compiled backward builds the rows in backward: traced,
# the partitioner moved the gather into the forward graph and kept its output, the very rows to drop.
@torch.library.custom_op("shardtune::regathered_weight_grad", mutates_args=())
def regathered_weight_grad(
    tokens: torch.Tensor, order: torch.Tensor, grad: torch.Tensor, bounds: torch.Tensor, a: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``rows_e^T @ grad_e`` for each expert e, the rows gathered from ``tokens`` again."""
    return _low_rank_weight_grad(_gather_rows(tokens, order, top_k).to(a.dtype), a, bounds, grad)


@torch.library.custom_op("shardtune::reactivated_weight_grad", mutates_args=())
def reactivated_weight_grad(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    grad: torch.Tensor,
    bounds: torch.Tensor,
    a: torch.Tensor,
    fp32: bool,
    limit: float | None,
    activation: str,
    alpha: float | None = None,
) -> torch.Tensor:
    """``rows_e^T @ grad_e`` for each expert e, the rows computed from the gate/up output again by the experts'
    ``activation`` (clamped at the SwiGLU ``limit`` where there is one), in the precision forward computed them in
    (fp32: compiled forward, and compiled here too; ``clamped_glu``: fp32 always, compiled where forward was)."""
    rows = (
        _compiled_weighted_activation()(gate_up, row_weights, limit=limit, activation=activation, alpha=alpha)
        if fp32
        else _weighted_activation(gate_up, row_weights, gate_up.dtype, limit, activation, alpha)
    )
    return _low_rank_weight_grad(rows.to(a.dtype), a, bounds, grad)


def _low_rank_weight_grad(
    rows: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """The gradient of ``a`` in ``LowRankOfRebuiltRows``: ``rows_e^T @ grad_e`` for each expert e, or
    ``rows^T @ grad`` for an adapter shared by all experts."""
    if a.dim() == 2:
        return rows.t() @ grad
    return grouped_mm_weight_grad(rows, a, bounds, grad).contiguous()


@functools.cache
def _compiled_weighted_activation() -> Callable:
    # One fused kernel: run op by op in fp32, the recomputation read and wrote every row 6 times and cost 8.5% of
    # a step (Qwen3-30B-A3B, LoRA on the routed experts, one H200: 15,432 against 16,734 tokens/s). Shapes are
    # left to dynamo, which makes only a dimension that changes symbolic (the rows, under expert parallelism):
    # compiled with dynamic=True, the width was symbolic too, every element's index a 64-bit division by a
    # run-time value, and the kernel took 196 against 74 us at Qwen3-30B-A3B's shape (one H200).
    return torch.compile(functools.partial(_weighted_activation, compute=torch.float32))


@regathered_weight_grad.register_fake
def _(tokens, order, grad, bounds, a, top_k):
    return a.new_empty(a.shape)


@reactivated_weight_grad.register_fake
def _(gate_up, row_weights, grad, bounds, a, fp32, limit, activation, alpha=None):
    return a.new_empty(a.shape)


class WeightedSiluMul(torch.autograd.Function):
    """weight * SiLU(gate) * up for each row of a [gate | up] GEMM output and the row's fp32 routing weight;
    backward keeps only the GEMM output (and the weights). Compiled, inductor fuses the forward into one
    kernel that computes in fp32 and rounds once; eager, the math runs in the GEMM output's dtype: unfused
    fp32 copies of every row made eager bf16 steps 10% slower (Qwen3-30B-A3B LoRA, every layer checkpointed,
    one H200: 7,590 against 8,453 tokens/s). On CUDA the backward, compiled or eager, is one Triton kernel in
    fp32 (``weighted_silu_kernel.py``: 2.4x faster than inductor's kernels for it); elsewhere, torch ops in
    the forward's precision.

    With a ``limit`` (``swiglu_limit``: HY-V4's experts), the gate is clamped above and up on both sides at it before
    the SiLU; the backward is then torch ops everywhere (the Triton kernel has no clamp). The experts' ``activation``
    ``gelu_tanh`` (Gemma 4's) takes GELU's tanh approximation for the SiLU, its backward torch ops everywhere too (the
    Triton kernel computes SiLU). ``clamped_glu`` (GPT-OSS's): gate and up interleaved, each clamped at ``limit`` (up
    on both sides), gate * sigmoid(``alpha`` * gate) * (up + 1), forward and backward in fp32 always (torch ops)."""

    @staticmethod
    def forward(
        ctx,
        gate_up: torch.Tensor,
        row_weights: torch.Tensor,
        limit: float | None = None,
        activation: str = "silu",
        alpha: float | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(gate_up, row_weights)
        ctx.limit, ctx.activation, ctx.alpha = limit, activation, alpha
        compute = _activation_precision(gate_up, activation)
        return _weighted_silu_mul(gate_up, row_weights, compute, limit, activation, alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        saved = ctx.saved_tensors
        return *_weighted_silu_mul_backward(*saved, grad, ctx.limit, ctx.activation, ctx.alpha), None, None, None


def _weighted_silu_mul_backward(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    grad: torch.Tensor,
    limit: float | None = None,
    activation: str = "silu",
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``WeightedSiluMul``'s backward: the Triton kernel on CUDA (SiLU without a limit), torch ops elsewhere."""
    kernel = weighted_silu_mul_backward is not None and _silu_kernel(activation, limit)
    if kernel and runs_on(gate_up.device) and gate_up.shape[0] > 0:
        return weighted_silu_mul_backward(gate_up.contiguous(), row_weights.contiguous(), grad.contiguous())
    compute = _activation_precision(gate_up, activation)
    return weighted_silu_mul_backward_ops(gate_up, row_weights, grad, compute, limit, activation, alpha)


def weighted_silu_mul_backward_ops(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    grad: torch.Tensor,
    compute: torch.dtype,
    limit: float | None = None,
    activation: str = "silu",
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WeightedSiluMul's backward as torch ops computing in ``compute``: (the gradient of ``gate_up`` in its
    dtype, the fp32 gradient of ``row_weights``). With a ``limit``, a clamped element takes no gradient (as
    torch.clamp's backward: none outside the bounds, the bounds themselves included in them). ``gelu_tanh``: GELU's
    tanh approximation for the SiLU, its derivative torch's own (``aten.gelu_backward``). ``clamped_glu``: g *
    sigmoid(alpha g), whose derivative is sigmoid(alpha g) (1 + alpha g (1 - sigmoid(alpha g))), times up + 1 (the
    up operand of ``_silu_operands``), the gradient interleaved as gate and up are."""
    gate, up, weights = _silu_operands(gate_up, row_weights, compute, limit, activation)
    grad = grad.to(compute)
    if activation == "gelu_tanh":
        activated = F.gelu(gate, approximate="tanh")
        grad_weights = (grad * activated * up).sum(dim=-1, dtype=torch.float32)
        grad = grad * weights
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        grad_up = grad * activated
    elif activation == "clamped_glu":
        sigmoid = torch.sigmoid(gate * alpha)
        glu = gate * sigmoid
        grad_weights = (grad * glu * up).sum(dim=-1, dtype=torch.float32)
        grad = grad * weights
        grad_gate = grad * up * (sigmoid * (1 + gate * alpha * (1 - sigmoid)))
        grad_up = grad * glu
    else:
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        grad_weights = (grad * silu * up).sum(dim=-1, dtype=torch.float32)
        grad = grad * weights
        grad_gate = grad * up * (sigmoid * (1 + gate * (1 - sigmoid)))
        grad_up = grad * silu
    if limit is not None:
        raw_gate, raw_up = _gate_and_up(gate_up.to(compute), activation)
        grad_gate = grad_gate * (raw_gate <= limit)
        grad_up = grad_up * (raw_up.abs() <= limit)
    if activation == "clamped_glu":  # interleaved again
        return torch.stack([grad_gate, grad_up], dim=-1).flatten(-2).to(gate_up.dtype), grad_weights
    return torch.cat([grad_gate, grad_up], dim=-1).to(gate_up.dtype), grad_weights


def _activation_precision(gate_up: torch.Tensor, activation: str = "silu") -> torch.dtype:
    """The dtype WeightedSiluMul and WeightedReluSquared compute in (see WeightedSiluMul): ``clamped_glu``'s fp32."""
    fp32 = torch.compiler.is_compiling() or activation == "clamped_glu"
    return torch.float32 if fp32 else gate_up.dtype


def _weighted_activation(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    compute: torch.dtype,
    limit: float | None,
    activation: str,
    alpha: float | None = None,
) -> torch.Tensor:
    """The down projection's rows by the experts' ``activation`` (``expert_activation``): WeightedSiluMul's or
    WeightedReluSquared's forward (``clamped_glu``: in fp32 whatever ``compute`` says, as WeightedSiluMul's)."""
    if activation == "relu2":
        return _weighted_relu_squared(gate_up, row_weights, compute)
    if activation == "clamped_glu":
        compute = torch.float32
    return _weighted_silu_mul(gate_up, row_weights, compute, limit, activation, alpha)


def _weighted_silu_mul(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    compute: torch.dtype,
    limit: float | None = None,
    activation: str = "silu",
    alpha: float | None = None,
) -> torch.Tensor:
    """weight * SiLU(gate) * up (``gelu_tanh``: GELU's tanh approximation for the SiLU; ``clamped_glu``: gate *
    sigmoid(``alpha`` * gate), up + 1) in ``compute``."""
    gate, up, weights = _silu_operands(gate_up, row_weights, compute, limit, activation)
    if activation == "gelu_tanh":
        activated = F.gelu(gate, approximate="tanh")
    elif activation == "clamped_glu":
        activated = gate * torch.sigmoid(gate * alpha)
    else:
        activated = F.silu(gate)
    return in_dtype(activated * up * weights, gate_up.dtype)


def _gate_and_up(gate_up: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate/up output's gate and up: its [gate | up] halves, or ``clamped_glu``'s interleaved columns."""
    if activation == "clamped_glu":
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def _silu_operands(
    gate_up: torch.Tensor,
    row_weights: torch.Tensor,
    compute: torch.dtype,
    limit: float | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, ...]:
    """(gate, up, the weights as a column) in ``compute``; with a ``limit``, the gate clamped at it from above and up
    at plus or minus it; ``clamped_glu``'s up plus 1 (its GLU's factor)."""
    gate, up = _gate_and_up(gate_up, activation)
    gate, up = gate.to(compute), up.to(compute)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if activation == "clamped_glu":
        up = up + 1
    return gate, up, row_weights.to(compute).unsqueeze(-1)


class WeightedReluSquared(torch.autograd.Function):
    """weight * ReLU(up)² for each row of an ungated experts' up projection output and the row's fp32 routing weight
    (``expert_activation``: ``relu2``), as :class:`WeightedSiluMul` computes the gated ones': backward keeps only the
    GEMM output (and the weights), in the same precision. Its backward is torch ops everywhere (the Triton kernel
    computes SiLU)."""

    @staticmethod
    def forward(ctx, up: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(up, row_weights)
        return _weighted_relu_squared(up, row_weights, _activation_precision(up))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _weighted_relu_squared_backward(*ctx.saved_tensors, grad)


def _weighted_relu_squared_backward(
    up: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``WeightedReluSquared``'s backward: (the gradient of ``up`` in its dtype, the fp32 one of ``row_weights``)."""
    compute = _activation_precision(up)
    relu, weights, grad = F.relu(up.to(compute)), row_weights.to(compute).unsqueeze(-1), grad.to(compute)
    grad_weights = (grad * relu.square()).sum(dim=-1, dtype=torch.float32)
    return (grad * weights * 2 * relu).to(up.dtype), grad_weights


def _weighted_relu_squared(up: torch.Tensor, row_weights: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    return in_dtype(F.relu(up.to(compute)).square() * row_weights.to(compute).unsqueeze(-1), up.dtype)

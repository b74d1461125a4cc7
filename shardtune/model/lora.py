"""LoRA adapters through PEFT, so saved adapters load with ``PeftModel.from_pretrained`` anywhere.

Dense models default to every linear layer. MoE models default to the attention projections only (as
seed 000 trained GLM-4.5-Air); ``lora.moe_targets`` adds the dense MLPs of the first layers, the shared
experts, the routed experts and the router. Routed experts are fused 3-D parameters in transformers 5
and routers hold a bare weight, not ``nn.Linear`` modules: PEFT adapts those through
``target_parameters`` (one low-rank update per expert tensor).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections import Counter
from collections.abc import Iterator

import peft
import torch
from transformers import PreTrainedModel

from shardtune.config import DEFAULT_MOE_TARGETS, LoraConfig
from shardtune.errors import ConfigError
from shardtune.model.fused_moe import SLAB_EXPERTS
from shardtune.model.moe import ATTENTION_EXPERTS, EXPERT_PAIR_NAMES, MoeBlock, find_moe_blocks

log = logging.getLogger("shardtune")


def moe_lora_targets(
    layers: list[torch.nn.Module], blocks: list[MoeBlock], groups: list[str]
) -> tuple[list[str], list[str], Counter[str], dict[str, str]]:
    """PEFT's (target_modules, target_parameters) for the chosen groups of an MoE model, how many
    modules or parameters each group has, and by group the class of a module that reads a Linear's weight of
    that group itself (``unadaptable_linears``: no adapter reaches it, so it is in no group), or of routed experts
    that slice 2-D slabs themselves (DBRX's, ``fused_moe.SLAB_EXPERTS``: PEFT's parameter adapters break them).

    Both are paths relative to a decoder layer (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``):
    PEFT matches them as suffixes of the full names, so ``mlp.gate_proj`` (a dense layer's MLP) never
    matches ``mlp.shared_experts.gate_proj``. A mixture of attention's expert weights (``moe.ATTENTION_EXPERTS``:
    JetMoE's query and output projections, 3-D) are parameters of the attention group.
    """
    block_of_layer = {block.layer: block for block in blocks}
    chosen_modules: set[str] = set()
    chosen_parameters: set[str] = set()
    found: Counter[str] = Counter()
    unreachable: dict[str, str] = {}
    for index, layer in enumerate(layers):
        block = block_of_layer.get(index)
        read_directly = set(unadaptable_linears(layer))
        for path, module in layer.named_modules():
            if _adapted_as_module(module):
                group = _linear_group(layer, path, block)
                if path in read_directly:
                    unreachable.setdefault(group, type(layer.get_submodule(path.rpartition(".")[0])).__name__)
                    continue
                found[group] += 1
                if group in groups:
                    chosen_modules.add(path)
            elif type(module).__name__ in ATTENTION_EXPERTS:
                for name in EXPERT_PAIR_NAMES:
                    found["attention"] += 1
                    if "attention" in groups:
                        chosen_parameters.add(_joined(path, name, "weight"))
        if block is None:
            continue
        if type(block.experts).__name__ in SLAB_EXPERTS:
            unreachable.setdefault("routed_experts", type(block.experts).__name__)
        for name, param in block.expert_weights.items():
            if param.dim() == 3:
                found["routed_experts"] += 1
                if "routed_experts" in groups:
                    chosen_parameters.add(_joined(block.path, name))
        if not _adapted_as_module(block.router):
            found["router"] += 1
            if "router" in groups:
                chosen_parameters.add(_joined(block.path, block.router_name, "weight"))
    return sorted(chosen_modules), sorted(chosen_parameters), found, unreachable


def _unreachable_because(kind: str) -> str:
    """Why no LoRA adapter reaches a group that only ``kind`` holds (``moe_lora_targets``' unreachable groups)."""
    if (slabs := SLAB_EXPERTS.get(kind)) is not None:
        # DBRX's experts slice 2-D slabs of every expert, held by a child (mlp.w1, v1, w2), themselves: PEFT's
        # ParamWrapper around that child hides the other slabs from their forward (an AttributeError in transformers
        # and PEFT alike), where it would also be one adapter for the whole slab, not one per expert.
        holder, *names = slabs
        return (
            f"{kind} slices its 2-D expert slabs ({', '.join(f'{holder}.{name}' for name in names)}) itself, which "
            "PEFT's parameter adapters break (its forward fails under them in transformers and PEFT)"
        )
    return (
        f"{kind} multiplies by its Linear's weight itself, which no LoRA adapter reaches (transformers and PEFT would "
        "leave it out)"
    )


def _joined(*names: str) -> str:
    """A module path from its parts, an empty one (a block that is its decoder layer: Gemma 4's) left out."""
    return ".".join(name for name in names if name)


def _adapted_as_module(module: torch.nn.Module) -> bool:
    """Whether PEFT's LoRA layer can adapt ``module`` as a Linear, adding its low-rank product of the input to the
    output: a Linear whose forward is Linear's own. Others with a forward of their own are left out of the module
    groups: DeepSeek-V4's grouped output projection (o_a_proj) multiplies each head group by its own rows of the
    weight, which a product of the whole input does not match. A router that is no such Linear is adapted through its
    weight instead (Llama 4's returns its scores and logits, to which PEFT's LoRA layer cannot add its term)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


# ``self.<child>.weight`` in a module's code, where it is not just asked for its dtype, device or shape.
_WEIGHT_READ = re.compile(r"self\.(\w+)\.weight\b(?!\s*\.\s*(?:dtype|device|shape|size))")


@functools.cache
def _weights_read_directly(module_class: type) -> frozenset[str]:
    """The children whose weight ``module_class``'s own code reads instead of calling them: PEFT's LoRA layer on such
    a Linear is never called, so its adapter would get no gradient and never train (and DDP would stop at its unused
    parameters). Jamba's Mamba mixer multiplies by ``dt_proj.weight``; Mamba-2 mixers (Granite-4.0-H, Nemotron-H) hand
    ``out_proj.weight`` to their fused training kernel where it is installed. Read from the class's source, so that a
    new architecture doing the same is covered without a list to keep."""
    try:
        source = inspect.getsource(module_class)
    except (OSError, TypeError):  # no source: a class built at run time, or a builtin
        return frozenset()
    return frozenset(_WEIGHT_READ.findall(source))


def unadaptable_linears(root: torch.nn.Module) -> list[str]:
    """The paths under ``root`` of the Linear modules whose weight their parent reads itself
    (``_weights_read_directly``)."""
    return [
        _joined(path, name)
        for path, parent in root.named_modules()
        for name in sorted(_weights_read_directly(type(parent)))
        if isinstance(getattr(parent, name, None), torch.nn.Linear)
    ]


def _linear_group(layer: torch.nn.Module, path: str, block: MoeBlock | None) -> str:
    # A block that is its decoder layer (Gemma 4's, path ""): its router is the router group's, the rest of the layer
    # (attention, the dense MLP beside the experts) is grouped as any layer's.
    if block is not None and (not block.path or path == block.path or path.startswith(block.path + ".")):
        inside = path[len(block.path) :].lstrip(".").split(".")[0]
        # The Qwen2-MoE family's shared expert comes with the gate that scales it (shared_expert_gate).
        if block.shared_name and inside in (block.shared_name, f"{block.shared_name}_gate"):
            return "shared_experts"
        if inside == block.router_name:
            return "router"
        # Per-expert nn.Linear modules (older layouts), or the projections into and out of the routed experts' latent
        # space (Nemotron-H's fc1_latent_proj and fc2_latent_proj), which only the routed experts' path passes through.
        if block.path:
            return "routed_experts"
    name = path.split(".")[0]
    return "attention" if mixes_tokens(name, layer.get_submodule(name)) else "dense_mlp"


def mixes_tokens(name: str, child: torch.nn.Module) -> bool:
    """Whether a decoder layer's child ``name`` mixes tokens: softmax attention, and the token mixers of hybrid
    models: linear attention (Qwen3-Next's linear_attn), short convolutions (LFM2's ShortConv, whose in_proj and
    out_proj are its linear layers) and Mamba mixers (Jamba's, Granite-4.0-H's, Nemotron-H's)."""
    kind = type(child).__name__
    return any(word in kind for word in ("Attention", "ShortConv", "Mamba")) or name.endswith("attn")


@contextlib.contextmanager
def targets_as_given() -> Iterator[None]:
    """Keep PEFT from rewriting targets that were computed from the live transformers-5 model.

    PEFT converts the targets of adapters written for transformers 4 MoE layouts: for the Qwen2-MoE
    family (Qwen3-MoE, GLM-4.5, ...) any target ending in gate_proj/up_proj/down_proj becomes the fused
    routed-expert parameters, including a dense layer's MLP and the shared experts (huggingface/peft
    #3711). Targets taken from this model's own module tree need no conversion.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a PEFT without the conversion
        yield
        return
    original = getattr(conversion, "convert_peft_config_for_transformers", None)
    if original is None:
        yield
        return
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def apply_lora(model: PreTrainedModel, config: LoraConfig) -> peft.PeftModel:
    """Freeze the base model and add trainable LoRA adapters to the target modules."""
    from shardtune.distributed.parallelize import decoder_layers

    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    target_modules: str | list[str] | None
    target_parameters: list[str] = []
    as_given = contextlib.nullcontext()
    if not blocks:
        if config.moe_targets != DEFAULT_MOE_TARGETS:
            raise ConfigError(
                f"lora.moe_targets: {type(model).__name__} has no MoE layers; choose layers with lora.target_modules"
            )
        target_modules = config.target_modules or "all-linear"
    elif config.target_modules is not None:
        target_modules = config.target_modules
        if target_modules == "all-linear":  # every nn.Linear of this model, found by PEFT on its modules
            as_given = targets_as_given()
    else:
        modules, target_parameters, found, unreachable = moe_lora_targets(layers, blocks, config.moe_targets)
        missing = [group for group in config.moe_targets if not found[group]]
        for group in missing:
            if group in unreachable:
                raise ConfigError(
                    f"lora.moe_targets: {group}: {_unreachable_because(unreachable[group])}; drop {group}"
                )
        if missing:
            present = ", ".join(sorted(found)) or "none"
            raise ConfigError(
                f"lora.moe_targets: {type(model).__name__} has no {', '.join(missing)} (it has: {present})"
            )
        target_modules = modules or None
        as_given = targets_as_given()
    unadaptable = unadaptable_linears(model)
    if isinstance(target_modules, list) and config.target_modules is not None:
        for target in target_modules:
            named = [path for path in unadaptable if path == target or path.endswith(f".{target}")]
            if named:
                more = f" and {len(named) - 1} more" if len(named) > 1 else ""
                raise ConfigError(
                    f"lora.target_modules: {target} names Linear modules whose weight their module reads itself "
                    f"instead of calling them ({named[0]}{more}), so adapters there would never train; leave it out"
                )
    if target_modules == "all-linear" and unadaptable:
        log.info(
            "lora: all-linear leaves out %d Linear modules whose weight their module reads itself (e.g. %s): "
            "adapters there would never train",
            len(unadaptable),
            unadaptable[0],
        )
    lora_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        exclude_modules=unadaptable or None,
        task_type="CAUSAL_LM",
    )
    try:
        # PEFT keeps adapter weights in fp32 even on a bf16 base (autocast_adapter_dtype): they are
        # the only weights that change, so they get full-precision updates.
        with as_given:
            peft_model = peft.get_peft_model(model, lora_config)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules: {exc}") from exc
    if config.shared_expert_adapter:
        share_expert_adapters(peft_model)
    return peft_model


def share_expert_adapters(model: torch.nn.Module) -> None:
    """Make each routed-expert adapter one adapter shared by the layer's experts.

    PEFT's layout keeps a rank-r block per expert (lora_A: (r * experts, in), lora_B: (out, r *
    experts)). Every expert's block starts as a copy of the first; the fused experts compute with their
    mean (``shared_across_experts``), so each block gets the same gradient and stays equal to the others.
    The saved adapter is thus PEFT's own format, which loads and merges anywhere unchanged. A mixture of attention's
    expert adapters (``moe.ATTENTION_EXPERTS``: JetMoE's), which transformers' code computes per expert, stay per
    expert.
    """
    attention = {id(inner) for module in model.modules() if type(module).__name__ in ATTENTION_EXPERTS
                 for inner in module.modules()}  # fmt: skip
    for module in model.modules():
        if not (hasattr(module, "parameter_name") and hasattr(module, "lora_A")) or module.num_experts < 2:
            continue
        if id(module) in attention:
            continue
        experts = module.num_experts
        with torch.no_grad():
            for name in module.lora_A:
                rank = module.r[name]
                a = module.lora_A[name].weight.view(experts, rank, -1)
                a.copy_(a[:1].expand_as(a))
                b = module.lora_B[name].weight.view(-1, rank, experts)
                b.copy_(b[..., :1].expand_as(b))
        module.shared_across_experts = True


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total

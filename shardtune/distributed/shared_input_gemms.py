"""Narrow trainable linear layers that read the same input, computed as one GEMM in compiled layers.

LoRA's down-projections (``lora_A``, rank rows) of q, k and v read the same normed hidden states, as those of an
MLP's gate and up projections do. Each is a GEMM with a few output columns, whose time goes to reading the input:
PEFT runs three forward GEMMs, and in backward three input-gradient GEMMs summed by two adds and three weight
gradients, each reading the whole input again. One GEMM against the concatenated factors reads the input once in
each. On one H100 a compiled Qwen3-30B-A3B attention block's forward + backward takes 3.6% less device time and 13
kernels fewer, a Llama-3-8B layer 2.6-4.4% less, and a Llama-3-8B LoRA step on one H200 runs 1.6% faster
(``benchmarks/RESULTS.md``, twenty-first pass). The numbers are the separate GEMMs' up to summation order: each
output column is the same dot product, and the input gradient sums the three products in the GEMM's accumulator
instead of adding rounded outputs.

The rewrite runs on dynamo's graph of a decoder layer, before AOTAutograd derives the backward, so autograd
differentiates the fused form. torch's own pass of this kind (inductor's ``batch_linear_lhs``) takes 2-D inputs
only and no dtype cast between input and GEMM, which PEFT's adapters always have (their input is cast to the
adapter's fp32); this one looks through such casts.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx

_LINEAR = (torch.nn.functional.linear, torch._C._nn.linear)
# How dynamo writes a change of autocast or grad mode inside a graph (``with torch.autocast(...)`` in a model).
_MODE_SWITCHES = (
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
    torch._C._set_grad_enabled,
)

# A weight at most this fraction as wide (rows) as its input (columns): a GEMM whose time goes to reading its input.
# LoRA's down-projections (rank 8-256 rows against a hidden size in the thousands) are far below it; q/k/v
# projections of full width are not fused (trainable ones are, under full fine-tuning, where k and v are narrow).
_NARROW = 4


def fuse_shared_input_linears(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite each group of bias-free linear calls on one input (up to dtype casts of it) whose weights are
    trainable and narrow into one call on the concatenated weights, split after it, in ``graph_module`` and the
    graphs inside it (checkpointed regions' bodies). Returns how many groups were fused."""
    fused = 0
    for module in list(graph_module.modules()):
        if isinstance(module, torch.fx.GraphModule):
            count = _fuse_in(module.graph)
            if count:
                module.recompile()
                fused += count
    return fused


def _fuse_in(graph: torch.fx.Graph) -> int:
    order = {node: index for index, node in enumerate(graph.nodes)}
    casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}  # the first cast of each (input, dtype)
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    region = 0  # calls on either side of an autocast or grad-mode switch inside the graph never join a group
    for node in graph.nodes:
        cast = _dtype_cast(node)
        if cast is not None:
            casts.setdefault(cast, node)
        elif node.op == "call_function" and node.target in _MODE_SWITCHES:
            region += 1
        elif node.op == "call_function" and node.target in _LINEAR:
            key = _group_key(node, casts)
            if key is not None:
                groups[(*key, region)].append(node)
    fused = 0
    for (source, *_), members in groups.items():
        if len(members) < 2:
            continue
        first = members[0]
        if any(order[_weight(member)] > order[first] for member in members):
            continue  # a weight computed after the first call (not the case for parameters)
        _fuse(graph, source, members)
        fused += 1
    if fused:
        for node in reversed(list(graph.nodes)):  # the casts the fused calls no longer read
            if _dtype_cast(node) is not None and not node.users:
                graph.erase_node(node)
        graph.lint()
    return fused


def _dtype_cast(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    """(input, dtype) of ``input.to(dtype)`` (a cast and nothing else: no device, no copy), else None."""
    if node.op != "call_method" or node.target != "to" or not isinstance(node.args[0], torch.fx.Node):
        return None
    rest = list(node.args[1:]) + [value for name, value in node.kwargs.items() if name == "dtype"]
    if len(rest) != 1 or len(node.args) + len(node.kwargs) != 2 or not isinstance(rest[0], torch.dtype):
        return None
    return node.args[0], rest[0]


def _weight(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[1] if len(node.args) > 1 else node.kwargs["weight"]


def _group_key(node: torch.fx.Node, casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node]) -> tuple | None:
    """What a fusable linear call reads, (input, weight dtype), the input being the first cast of its source to
    that dtype where it is a cast; None where the call cannot join a group: a bias, a weight that is not a
    trainable narrow matrix, no traced value to check."""
    if len(node.args) > 2 and node.args[2] is not None or node.kwargs.get("bias") is not None:
        return None
    source, weight = node.args[0] if node.args else node.kwargs.get("input"), _weight(node)
    if not isinstance(source, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return None
    value = weight.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.requires_grad:
        return None
    if value.shape[0] * _NARROW > value.shape[1]:
        return None
    cast = _dtype_cast(source)
    if cast is not None:  # all casts of one input to one dtype are one value: group them under the first
        source = casts[cast]
    return (source, value.dtype)


def _fuse(graph: torch.fx.Graph, source: torch.fx.Node, members: list[torch.fx.Node]) -> None:
    weights = [_weight(member) for member in members]
    widths = [weight.meta["example_value"].shape[0] for weight in weights]
    with graph.inserting_before(members[0]):
        concatenated = graph.call_function(torch.cat, (weights,), {"dim": 0})
        product = graph.call_function(torch.nn.functional.linear, (source, concatenated))
        parts = graph.call_function(torch.split, (product, widths), {"dim": -1})
        split = [graph.call_function(operator.getitem, (parts, index)) for index in range(len(members))]
    # The fake values dynamo records on each node, which inductor's passes read. Made without autograd: a fake
    # product recorded for backward would pass through the saved-tensor hooks active while the layer compiles
    # (a checkpoint's, which then counts two tensors more than its recomputation saves). The product's is made
    # from the first call's value rather than computed: torch 2.11's linear on symbolic sizes (a graph compiled
    # again for a new shape) asks for a concrete numel.
    with torch.no_grad():
        concatenated.meta["example_value"] = torch.cat([weight.meta["example_value"] for weight in weights])
        first = members[0].meta["example_value"]
        product.meta["example_value"] = first.new_empty((*first.shape[:-1], sum(widths)))
        parts.meta["example_value"] = torch.split(product.meta["example_value"], widths, dim=-1)
    for part, member in zip(split, members, strict=True):
        part.meta.update(member.meta)
        member.replace_all_uses_with(part)
        graph.erase_node(member)

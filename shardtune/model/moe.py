"""Mixture-of-Experts models: where their routers and experts are, what the routers decided on each
forward pass, and the router load-balancing loss.

Blocks are found by structure, not by architecture name: a sparse MoE block is a module with an
``experts`` child (the expert weights, fused 3-D parameters in transformers 5) and a router child
(``gate`` or ``router``) whose weight has one row per expert. That covers Qwen3-MoE, Mixtral and
Glm4Moe (GLM-4.5/4.6/4.7), and the DeepSeek-style models built the same way.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

ROUTER_NAMES = ("gate", "router")
SHARED_EXPERT_NAMES = ("shared_experts", "shared_expert")


@dataclass(eq=False)
class MoeBlock:
    """One sparse MoE block, by module object (they stay valid when PEFT or checkpointing wraps them)."""

    layer: int  # index of its decoder layer
    path: str  # its module path relative to the decoder layer, e.g. "mlp"
    block: torch.nn.Module
    router: torch.nn.Module
    router_name: str
    experts: torch.nn.Module
    shared_name: str | None  # child name of its shared experts, if it has any
    num_experts: int
    top_k: int
    # Softmax routers (Qwen3-MoE, Mixtral) or sigmoid routers with a score-correction bias (GLM-4.5,
    # DeepSeek-V3): it decides how router logits become per-expert probabilities.
    scoring: str


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    """The module itself under PEFT's and activation checkpointing's wrappers."""
    while True:
        if hasattr(module, "base_layer") and isinstance(module.base_layer, torch.nn.Module):
            module = module.base_layer
        elif hasattr(module, "_checkpoint_wrapped_module"):
            module = module._checkpoint_wrapped_module
        else:
            return module


def _children(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: _inner(child) for name, child in _inner(module).named_children()}


def find_moe_blocks(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[MoeBlock]:
    """The sparse MoE blocks of ``model`` in layer order; ``layers`` are its decoder layers."""
    config = getattr(_inner(model), "config", None)
    blocks = []
    for index, layer in enumerate(layers):
        for path, module in _inner(layer).named_modules():
            children = _children(module)
            router_name = next((name for name in ROUTER_NAMES if name in children), None)
            if "experts" not in children or router_name is None:
                continue
            router = children[router_name]
            weight = getattr(router, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            shared_name = next((name for name in SHARED_EXPERT_NAMES if name in children), None)
            top_k = getattr(router, "top_k", None) or getattr(config, "num_experts_per_tok", None)
            if top_k is None:
                raise ValueError(f"cannot tell how many experts {type(router).__name__} picks per token (top_k)")
            blocks.append(
                MoeBlock(
                    layer=index,
                    path=_strip_wrappers(path),
                    block=module,
                    router=router,
                    router_name=router_name,
                    experts=children["experts"],
                    shared_name=shared_name,
                    num_experts=weight.shape[0],
                    top_k=int(top_k),
                    scoring="sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax",
                )
            )
    return blocks


def _strip_wrappers(path: str) -> str:
    return re.sub(r"(^|\.)(base_layer|_checkpoint_wrapped_module)(?=\.|$)", "", path).strip(".")


def routing_probabilities(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-token probability over experts, in fp32.

    Softmax routers: the softmax of the logits. Sigmoid routers score each expert independently; their
    scores normalized over the experts are the distribution (as Megatron-LM computes the balancing loss
    and entropy for them).
    """
    logits = logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return logits.softmax(dim=-1)


class RoutingRecord:
    """What one MoE block's router decided for the real tokens of one forward pass."""

    def __init__(self, block: MoeBlock, logits: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor | None):
        self.block = block
        self._logits = logits  # (tokens, experts), every token, in the autograd graph
        self._real = real
        self.chosen = chosen if real is None else chosen[real]  # (real tokens, top_k) expert indices

    @functools.cached_property
    def probabilities(self) -> torch.Tensor:
        """(real tokens, experts) router probabilities, in the autograd graph.

        Computed on first use, after the forward pass: ops run inside the hook would save tensors for
        backward that activation checkpointing's recomputation (where hooks record nothing) does not.
        """
        logits = self._logits if self._real is None else self._logits[self._real]
        return routing_probabilities(logits, self.block.scoring)


@dataclass
class RoutingRecorder:
    """While ``recording()``, each router's decision becomes a record.

    Blocks computed by transformers are seen through forward hooks on their routers. Blocks that route
    themselves (shardtune's fused block: a ``routing_log`` attribute) append (logits, chosen) to that
    list while it is a list, and the recorder turns those entries into records when recording ends.
    Forwards outside ``recording()`` (evaluation) and the recomputation that activation checkpointing
    runs inside backward record nothing, so every token is recorded exactly once per training forward.
    Recording runs no differentiable op, so a checkpointed layer saves the same tensors in its forward
    and in its recomputation.
    """

    blocks: list[MoeBlock]
    records: list[RoutingRecord] = field(default_factory=list)
    _mask: torch.Tensor | None = None
    _active: bool = False

    def __post_init__(self) -> None:
        for block in self.blocks:
            if not hasattr(block.block, "routing_log"):
                block.router.register_forward_hook(self._hook(block))
        # A compiled, checkpointed layer would otherwise replay the recording in backward (or, without
        # this option in older torch, break the layer's graph there): recording is forward-only.
        import torch._dynamo

        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

    def _self_recording(self) -> list[MoeBlock]:
        return [block for block in self.blocks if hasattr(block.block, "routing_log")]

    def _hook(self, block: MoeBlock):
        def record(module: torch.nn.Module, inputs: tuple, output: object) -> None:
            if not self._active or torch._C._current_graph_task_id() != -1:
                return  # not a training forward, or checkpointing's recomputation during backward
            logits = output[0] if isinstance(output, tuple) else output
            logits = logits.reshape(-1, block.num_experts)
            if isinstance(output, tuple) and len(output) >= 3:
                chosen = output[2]  # the router's own choice (group-limited and bias-corrected for GLM)
            else:
                with torch.no_grad():  # softmax and sigmoid keep the order of the logits
                    chosen = logits.topk(block.top_k, dim=-1).indices
            self.records.append(RoutingRecord(block, logits, chosen.reshape(-1, block.top_k), self._mask))

        return record

    @contextlib.contextmanager
    def recording(self, real_tokens: torch.Tensor | None) -> Iterator[list[RoutingRecord]]:
        """Record the routers of one forward; ``real_tokens`` (batch, seq) masks out padding. The
        records of self-recording blocks join ``records`` when the forward is over."""
        self.records = []
        self._mask = None if real_tokens is None else real_tokens.reshape(-1).bool()
        self._active = True
        for block in self._self_recording():
            block.block.routing_log = []
        try:
            yield self.records
        finally:
            self._active = False
            for block in self._self_recording():
                for logits, chosen in block.block.routing_log:
                    self.records.append(RoutingRecord(block, logits, chosen, self._mask))
                block.block.routing_log = None


def load_balancing_loss(records: list[RoutingRecord]) -> torch.Tensor:
    """The Switch Transformer load-balancing loss over all MoE layers, as transformers defines it for
    Qwen3-MoE and Mixtral: num_experts * sum_e f_e * P_e, where f_e is the share of (token, choice) pairs
    routed to expert e times top_k and P_e the mean router probability of e, both pooled over the layers
    and the real tokens. It is top_k when routing is uniform and grows as the load concentrates.

    Only P carries gradient (f counts discrete choices). Applied to sigmoid routers (GLM-4.5) with
    normalized scores as P.
    """
    num_experts = records[0].block.num_experts
    device = records[0].probabilities.device
    routed = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for record in records:
        ones = torch.ones(record.chosen.numel(), dtype=torch.float32, device=device)
        routed = routed.index_add(0, record.chosen.reshape(-1), ones)
        probability_sum = probability_sum + record.probabilities.sum(dim=0)
        rows += record.probabilities.shape[0]
    if rows == 0:
        return probability_sum.sum() * 0.0
    return num_experts * torch.sum((routed / rows) * (probability_sum / rows))

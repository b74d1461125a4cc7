"""Mixture-of-Experts models: where their routers and experts are, what the routers decided on each
forward pass, and the router load-balancing loss.

Blocks are found by structure, not by architecture name: a sparse MoE block is a module with an
``experts`` child (the expert weights, fused 3-D parameters in transformers 5) and a router child
(``gate`` or ``router``) whose weight has one row per expert. That covers Qwen3-MoE, Mixtral and
Glm4Moe (GLM-4.5/4.6/4.7), the Qwen2-MoE family (Qwen3-Next, Qwen3.5-MoE), and the DeepSeek-style models
built the same way (GLM-4.7-Flash, GLM-5, MiniMax-M2). A block may instead hold its routed experts as two modules of
its own (``EXPERT_PAIR_NAMES``: JetMoE's input_linear and output_linear), seen as one experts module (``ExpertPair``).

How each architecture's router decides is written out once, by block class, in ``ROUTING_RULES``: the fused
block computes it, and the routing statistics of every block take its scores.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

ROUTER_NAMES = ("gate", "router")
# Routers that hold their logits' Linear as a child instead of a weight of their own: Hunyuan-MoE's (wg), AFMoE's
# (gate), LongCat-Flash's (classifier), Gemma 4's (proj), JetMoE's and DBRX's (layer).
LOGITS_LINEAR_NAMES = ("wg", "gate", "classifier", "proj", "layer")
# Routers that return another float per token and expert (their scores) before the logits: Llama 4's.
SCORES_BEFORE_LOGITS = ("Llama4Router",)
# Routers whose last output is their logits and whose other outputs are no (tokens, top_k) choice: JetMoE's returns the
# (token, choice) pairs' expert order, their tokens, gates and per-expert counts (a list) first. The hooks take the
# top-k of the logits for the choice.
LOGITS_LAST = ("JetMoeTopKGating",)
# Blocks that hold their routed experts as two modules of their own, each an (E, out, in) 3-D ``weight``, where others
# have one ``experts`` module: JetMoE's JetMoeMoE, input_linear (E, 2I, H), [gate | up], and output_linear (E, H, I)
# (``ExpertPair``). Found by structure, gated ones only (2I rows in, I columns out).
EXPERT_PAIR_NAMES = ("input_linear", "output_linear")
# Mixtures of attention, whose query and output projections are routed experts (JetMoE's JetMoeMoA, the attention's
# ``experts``: its input_linear (E, heads_per_expert x head_dim, H) and output_linear, split by the attention between
# them). They keep transformers' map and reduce, in no MoE block (their router is not recorded nor balanced by
# shardtune; the fused path keeps their row counts on the device: ``fused_moe.use_grouped_attention_experts``);
# their expert weights are LoRA's attention group (``lora.moe_lora_targets``), and a token passes through top_k /
# num_experts of them (``metrics.flops``).
ATTENTION_EXPERTS = ("JetMoeMoA",)
# Routers that return their softmax probabilities where others return logits: Gemma 4's.
PROBABILITIES_FOR_LOGITS = ("Gemma4TextRouter",)
SHARED_EXPERT_NAMES = ("shared_experts", "shared_expert", "shared_mlp")  # the last: Hunyuan-MoE's

# How routers turn fp32 logits into scores (``Routing.scoring``): a softmax over the experts, or a score of each expert
# of its own, its sigmoid or the square root of its softplus (DeepSeek-V4's scoring_func "sqrtsoftplus"). Each keeps
# the order of the logits.
SCORING_FUNCTIONS = {
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt(),
}


@dataclass(frozen=True)
class Routing:
    """How one architecture's router turns logits into (weights, experts) per token.

    ``scoring``: the scores are a softmax over all experts, or a function of each (``SCORING_FUNCTIONS``), of the
    logits first capped at ``logit_softcap`` by ``tanh`` where it is positive (Laguna). The choice is the ``top_k``
    best scores plus the router's correction bias where it has one (``correction_bias``: GLM, DeepSeek-V3, ERNIE 4.5,
    LFM2), or the best logits plus it (``choose_on="logits"``: Kolibri-1; Llama 4, without a bias, as its router
    does: saturated sigmoid scores tie where their logits do not), among the ``topk_group`` best of ``groups``
    expert groups, a group scored by the sum of its two best (``group_score="top2"``: DeepSeek-V3, GLM) or its best
    (``"max"``: DeepSeek-V2); the experts of the other groups compete with ``masked_score`` (-inf: never chosen;
    A.X-K2's 0 beats an expert of a chosen group whose biased score is below it). With a ``choice_table``, the name
    of a (vocab, top_k) table the router holds, the choice is instead the table's row at the token's id (hash
    routing: DeepSeek-V4's frozen tid2eid), whatever the scores. The logits are the router's Linear's, its bias
    included unless ``logits_bias`` is False (LongCat-Flash's router leaves its classifier's out). The weights are the
    chosen plain scores, divided by their sum plus ``epsilon`` when ``normalize`` (by their ``norm_p``-norm where that
    is not 1: DBRX's moe_normalize_expert_weights), times ``scaling``, and times the
    router's (experts,) parameter ``expert_scale`` at the chosen expert where named (Gemma 4's per_expert_scale). They
    scale each chosen expert's output, or with ``weights_input`` its input (Llama 4: the experts are nonlinear, so the
    two differ). With an ``input_norm`` epsilon the router's input is first RMS-normalized (no weight of the norm's
    own), then multiplied by its (hidden,) parameter ``input_scale`` where named and by ``input_scaling`` (Gemma 4:
    ``scale`` and hidden_size**-0.5). Parameters are named as attributes of the block's router child
    (``MoeBlock.router_child``). With a ``sparsemixer`` tolerance (Phi-3.5-MoE's router_jitter_noise) the choice and the
    weights are instead SparseMixer's, two experts a token (``fused_moe.sparsemixer``: in training drawn at random,
    each weight that expert's softmax over the logits within the tolerance of the best); ``scoring`` is then the
    softmax the routing statistics take.
    """

    scoring: str
    top_k: int
    normalize: bool
    groups: int = 1
    topk_group: int = 1
    group_score: str = "top2"
    scaling: float = 1.0
    epsilon: float = 0.0
    weights_input: bool = False
    logit_softcap: float = 0.0
    choose_on: str = "scores"
    masked_score: float = float("-inf")
    choice_table: str | None = None
    logits_bias: bool = True
    input_norm: float | None = None
    input_scale: str | None = None
    input_scaling: float = 1.0
    expert_scale: str | None = None
    norm_p: float = 1.0
    sparsemixer: float | None = None


def _softmax_rule(router: torch.nn.Module, normalize: bool | None = None) -> Routing:
    return Routing("softmax", router.top_k, bool(router.norm_topk_prob) if normalize is None else normalize)


def _renormalized_softmax_rule(router: torch.nn.Module) -> Routing:
    return _softmax_rule(router, normalize=True)


def _plain_softmax_rule(router: torch.nn.Module) -> Routing:
    return _softmax_rule(router, normalize=False)


def _cohere2_rule(router: torch.nn.Module) -> Routing:
    """Cohere2-MoE: the top-k logits' softmax (``expert_selection_fn: softmax``, norm_topk_prob aside), which is the
    top-k probabilities renormalized, or their sigmoids (``sigmoid``), renormalized with norm_topk_prob; sigmoid
    keeps the logits' order, so choosing by the scores chooses by the logits."""
    if router.expert_selection_fn == "sigmoid":
        return Routing("sigmoid", router.top_k, bool(router.norm_topk_prob))
    return _renormalized_softmax_rule(router)


def _deepseek_v3_rule(router: torch.nn.Module) -> Routing:
    """Sigmoid scores chosen with a correction bias among the best groups by their two best, renormalized and
    scaled. A.X-K2-Light has no groups (``n_group`` None); Beam's router leaves the scaling to its block
    (``routing_rule``)."""
    return Routing(
        "sigmoid",
        router.top_k,
        bool(router.norm_topk_prob),
        groups=router.num_group or 1,
        topk_group=router.topk_group or 1,
        scaling=float(getattr(router, "routed_scaling_factor", 1.0)),
        epsilon=1e-20,
    )


def _axk2_rule(router: torch.nn.Module) -> Routing:
    """DeepSeek-V3's rule, the experts outside the chosen groups left with a score of 0 (as A.X-K2's reference)."""
    return replace(_deepseek_v3_rule(router), masked_score=0.0)


def _deepseek_v2_rule(router: torch.nn.Module) -> Routing:
    """Softmax scores, not renormalized; ``topk_method: group_limited_greedy`` keeps the best groups by their best
    expert (``greedy``: no groups)."""
    groups = router.num_group if router.topk_method == "group_limited_greedy" else 1
    return Routing(
        "softmax",
        router.top_k,
        normalize=False,
        groups=groups,
        topk_group=router.topk_group,
        group_score="max",
        scaling=float(router.routed_scaling_factor),
    )


def _deepseek_v4_rule(router: torch.nn.Module) -> Routing:
    """DeepSeek-V3's rule without groups, always renormalized (norm_topk_prob aside), on the scores of the router's
    ``score_fn`` (scoring_func: ``sqrtsoftplus`` or ``sigmoid``; transformers' ACT2FN has no ``softmax``, the config's
    third value). The hash layers' router (DeepseekV4HashRouter) takes the experts from its table ``tid2eid`` at the
    token ids instead, and has no correction bias."""
    scoring = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}[type(router.score_fn).__name__]
    return Routing(
        scoring,
        router.top_k,
        normalize=True,
        scaling=float(router.routed_scaling_factor),
        epsilon=1e-20,
        choice_table="tid2eid" if hasattr(router, "tid2eid") else None,
    )


def _gemma4_rule(layer: torch.nn.Module) -> Routing:
    """Gemma 4, whose decoder layer is the block (the routed experts run beside its dense MLP, on the same residual):
    its router (child ``router``, no top_k of its own: the rule gets the layer) RMS-normalizes its input, scales it by
    its ``scale`` and hidden_size**-0.5, takes the softmax of its Linear ``proj``'s logits, renormalizes the top-k
    (``top_k_experts``) probabilities and multiplies each by its expert's ``per_expert_scale``."""
    router = _children(layer)["router"]
    return Routing(
        "softmax",
        router.config.top_k_experts,
        normalize=True,
        input_norm=float(router.eps),
        input_scale="scale",
        input_scaling=float(router.scalar_root_size),
        expert_scale="per_expert_scale",
    )


def _dbrx_rule(block: torch.nn.Module) -> Routing:
    """DBRX: the top-k softmax probabilities divided by their p-norm, p the block's moe_normalize_expert_weights (1:
    their sum; None: not renormalized). Its router child holds no settings (the rule gets the block); in training it
    multiplies the block's input by uniform jitter (moe_jitter_eps), which the experts take too
    (FusedMoeBlock.router_jitter_noise)."""
    p = block.moe_normalize_expert_weights
    return Routing("softmax", block.top_k, normalize=p is not None, norm_p=1.0 if p is None else float(p))


def _phimoe_rule(router: torch.nn.Module) -> Routing:
    """Phi-3.5-MoE: SparseMixer (``Routing.sparsemixer``), whose tolerance is its router's router_jitter_noise (a
    tolerance, not a noise: the input noise is input_jitter_noise, which its block applies, FusedMoeBlock.forward). It
    picks two experts, whatever num_experts_per_tok says (transformers' sparsemixer ignores its top_k)."""
    return Routing("softmax", 2, normalize=False, sparsemixer=float(router.router_jitter_noise))


def _lfm2_rule(router: torch.nn.Module) -> Routing:
    return Routing(
        "sigmoid",
        router.top_k,
        bool(router.norm_topk_prob),
        scaling=float(router.routed_scaling_factor),
        epsilon=1e-6,
    )


# The transformers blocks whose router rule Routing writes out, by class name; each is held to transformers' own
# forward in tests/train/test_fused_moe.py. Blocks of one family share their rule: GLM's blocks after GLM-4.5
# (GLM-4.7-Flash's, GLM-5's), DeepSeek-V3.2's, dots.llm1's, Dots 3 Note's, EXAONE-MoE's, Kimi-Linear's, Solar-Open's,
# MiMo-V2-Flash's (no shared experts), Ling's hybrid's and HY-V4's (experts with a SwiGLU limit) are DeepSeek-V3's,
# Mellum's Qwen3-MoE's, FlexOlmo's OLMoE's and MiniMax-Text-01's Mixtral's; the Qwen2-MoE family's blocks (Qwen4-Exp's
# among them) add a shared expert scaled by a sigmoid gate of its own (FusedMoeBlock.forward).
ROUTING_RULES = {
    "Qwen3MoeSparseMoeBlock": _softmax_rule,
    "Qwen2MoeSparseMoeBlock": _softmax_rule,
    "Qwen3NextSparseMoeBlock": _softmax_rule,
    "Qwen3_5MoeSparseMoeBlock": _renormalized_softmax_rule,
    "Qwen4ExpTextSparseMoeBlock": _softmax_rule,
    "OlmoeSparseMoeBlock": _softmax_rule,
    "FlexOlmoSparseMoeBlock": _softmax_rule,
    "MellumSparseMoeBlock": _softmax_rule,
    "MixtralSparseMoeBlock": _renormalized_softmax_rule,
    "MiniMaxSparseMoeBlock": _renormalized_softmax_rule,
    # Jamba: the top-k softmax probabilities as they are.
    "JambaSparseMoeBlock": _plain_softmax_rule,
    # Granite-MoE: a softmax of the top-k logits, which is the top-k probabilities renormalized; its shared MLP
    # (Granite-MoE-Shared, Granite-4.0's hybrid and sliding-window models) sits beside the block, in the decoder layer.
    "GraniteMoeMoE": _renormalized_softmax_rule,
    "GraniteMoeSharedMoE": _renormalized_softmax_rule,
    "GraniteMoeHybridMoE": _renormalized_softmax_rule,
    "GraniteMoeSWAMoE": _renormalized_softmax_rule,
    # Cohere2-MoE: with shared_expert_combination_strategy "average", its shared experts' output is averaged with
    # the routed experts' (FusedMoeBlock.forward).
    "Cohere2MoeSparseMoeBlock": _cohere2_rule,
    # ERNIE 4.5: softmax scores chosen with a correction bias (its router's moe_statics), renormalized (the clamp
    # of the sum at moe_norm_min never acts on k softmax scores: their sum is at least k / experts).
    "Ernie4_5_MoeSparseMoeBlock": _renormalized_softmax_rule,
    "DeepseekV2Moe": _deepseek_v2_rule,
    "Glm4MoeMoE": _deepseek_v3_rule,
    "Glm4MoeLiteMoE": _deepseek_v3_rule,
    "GlmMoeDsaMoE": _deepseek_v3_rule,
    "DeepseekV3MoE": _deepseek_v3_rule,
    "Dots1MoE": _deepseek_v3_rule,
    "ExaoneMoeSparseMoEBlock": _deepseek_v3_rule,
    "SolarOpenMoE": _deepseek_v3_rule,
    "DeepseekV32MoE": _deepseek_v3_rule,
    "Dots3NoteTextMoE": _deepseek_v3_rule,
    "KimiLinearMoE": _deepseek_v3_rule,
    "HYV4MoE": _deepseek_v3_rule,
    "MiMoV2FlashMoE": _deepseek_v3_rule,
    "BailingHybridMoE": _deepseek_v3_rule,
    # DeepSeek-V4: square roots of softplus scores; hash routing in its first layers (mlp_layer_types "hash_moe"),
    # whose blocks take the input ids (FusedMoeBlock.forward); experts with a SwiGLU limit.
    "DeepseekV4SparseMoeBlock": _deepseek_v4_rule,
    # Nemotron-H: ungated ReLU² experts (fused_moe.expert_activation), between latent projections where the config
    # has a moe_latent_size (FusedMoeBlock.forward).
    "NemotronHMoE": _deepseek_v3_rule,
    # MiniMax-M2: sigmoid scores renormalized, no groups or scaling; its correction bias is the block's buffer.
    "MiniMaxM2SparseMoeBlock": lambda router: Routing("sigmoid", router.top_k, normalize=True),
    # Hy3: MiniMax-M2's block with the weights scaled (router_scaling_factor) and a shared expert.
    "HYV3MoE": lambda router: Routing(
        "sigmoid", router.top_k, normalize=True, scaling=float(router.router_scaling_factor), epsilon=1e-20
    ),
    # A.X-K1's block normalizes its output (FusedMoeBlock.forward); Beam's scales the routed experts' sum.
    "AXK1MoE": _deepseek_v3_rule,
    "BeamMoE": _deepseek_v3_rule,
    "AXK2MoE": _axk2_rule,
    # Flint: sigmoid scores without a correction bias, renormalized; its shared expert is added ungated.
    "FlintSparseMoeBlock": lambda router: Routing("sigmoid", router.top_k, bool(router.norm_topk_prob)),
    # LaraMini: Flint's block with Qwen3-Next's softmax router.
    "LaraMiniSparseMoeBlock": _softmax_rule,
    # Kolibri-1: sigmoid scores of the experts whose logits plus the correction bias are best, renormalized.
    "Kolibri1SparseMoeBlock": lambda router: Routing(
        "sigmoid", router.top_k, bool(router.norm_topk_prob), choose_on="logits"
    ),
    # Laguna: sigmoid scores of tanh-capped logits chosen with a correction bias, renormalized; its block scales the
    # routed experts' sum.
    "LagunaSparseMoeBlock": lambda router: Routing(
        "sigmoid", router.top_k, normalize=True, logit_softcap=float(router.router_logit_softcapping)
    ),
    # GPT-OSS: a softmax of the top-k logits (its router adds a bias to them), which is the top-k probabilities
    # renormalized; its experts are transposed, biased and clamped (fused_moe.expert_activation).
    "GptOssMLP": _renormalized_softmax_rule,
    # LFM2-MoE: sigmoid scores; with use_expert_bias, a correction bias that is its block's buffer expert_bias.
    "Lfm2MoeSparseMoeBlock": _lfm2_rule,
    # Llama 4: the sigmoid of each chosen logit scales the expert's input; its experts' weights are (E, in, out).
    "Llama4TextMoe": lambda router: Routing(
        "sigmoid", router.top_k, normalize=False, weights_input=True, choose_on="logits"
    ),
    # LongCat-Flash: softmax scores over its GEMM experts and its zero-computation (identity) ones, chosen with a
    # correction bias (top-k unsorted), not renormalized, scaled; its router's logits are its classifier's weight times
    # the tokens, the Linear's bias left out. Experts past the GEMM ones return the token (fused_moe.IDENTITY_EXPERTS).
    "LongcatFlashMoE": lambda router: Routing(
        "softmax", router.top_k, normalize=False, scaling=float(router.routed_scaling_factor), logits_bias=False
    ),
    # DBRX: the top-k softmax probabilities divided by their p-norm; its router's logits are its Linear layer's; its
    # experts hold 2-D slabs of every expert (fused_moe.SLAB_EXPERTS).
    "DbrxFFN": _dbrx_rule,
    # Hunyuan-MoE: the top-k softmax probabilities renormalized; its router's logits are its Linear wg's.
    "HunYuanMoEV1Moe": _renormalized_softmax_rule,
    # AFMoE: sigmoid scores chosen with its block's expert_bias, renormalized and scaled (route_scale); its router
    # holds the logits' Linear as gate.
    "AfmoeSparseMoeBlock": lambda router: Routing(
        "sigmoid", router.top_k, normalize=True, scaling=float(router.route_scale), epsilon=1e-20
    ),
    # JetMoE: a softmax of the top-k logits (fp32), which is the top-k probabilities renormalized; its router holds the
    # logits' Linear as layer; its experts are a pair of modules (ExpertPair), SiLU-gated; the block adds a bias of its
    # own (fused_moe.OUTPUT_BIAS).
    "JetMoeMoE": _renormalized_softmax_rule,
    # Gemma 4 (26B-A4B): the MoE block is the decoder layer itself, which keeps its forward when fused (its router
    # child routes, its experts run fused: fused_moe.FusedRouter); the router normalizes and scales its input, and
    # scales each chosen weight by its expert's per_expert_scale; GELU-tanh-gated experts.
    "Gemma4TextDecoderLayer": _gemma4_rule,
    # Phi-3.5-MoE: SparseMixer's two experts a token, drawn at random in training, each weighted by its masked softmax;
    # its block and its router each multiply the tokens by noise first in training (input_jitter_noise), the experts
    # taking the twice-jittered tokens too (FusedMoeBlock.forward).
    "PhimoeSparseMoeBlock": _phimoe_rule,
}


def routing_rule(block: torch.nn.Module, router: torch.nn.Module) -> Routing | None:
    """How ``block`` routes (a fused block: the rule it computes); None for a block ROUTING_RULES lacks. ``router``
    is its router child, which holds the rule's settings (top_k; AFMoE's route_scale, not the Linear it holds). A
    block's own ``routed_scaling_factor`` (Beam, Laguna: it scales the routed experts' sum, which is scaling each
    weight) joins its router's scaling. A rule reads its settings from the block where the router is a bare Linear
    that has none (Jamba's in transformers 5.17). A fused block's rule is its own, or, for a block that is its decoder
    layer, its fused router's."""
    for holder in (block, router):
        if isinstance(rule := getattr(holder, "routing", None), Routing):
            return rule
    make = ROUTING_RULES.get(type(block).__name__)
    if make is None:
        return None
    rule = make(router if hasattr(router, "top_k") else block)
    block_scaling = getattr(block, "routed_scaling_factor", None)
    return rule if block_scaling is None else replace(rule, scaling=rule.scaling * float(block_scaling))


def logits_linear_name(router: torch.nn.Module) -> str | None:
    """Where a block's router child (under no wrapper) keeps the weight of its logits: "" for a weight of its own,
    the name of its Linear child (``LOGITS_LINEAR_NAMES``), or None for neither."""
    if getattr(router, "weight", None) is not None:
        return ""
    return next(
        (name for name in LOGITS_LINEAR_NAMES if isinstance(_inner(getattr(router, name, None)), torch.nn.Linear)), None
    )


class ExpertPair(torch.nn.Module):
    """The routed experts of a block that holds them as two modules of its own (``EXPERT_PAIR_NAMES``: JetMoE's
    input_linear and output_linear), seen as transformers' experts module: ``gate_up_proj`` is the first's (E, 2I, H)
    weight ([gate | up]), ``down_proj`` the second's (E, H, I), ``act_fn`` the block's ``activation``. Not part of the
    model's module tree: the weights keep their names under the block. Its children are the two modules under PEFT's
    wrappers (parameters() are the weights); ``adapted`` gives each as the block holds it now, PEFT's wrappers
    included, where their adapters are (``fused_moe.parameter_adapters``)."""

    # The experts module's names of the weights, and the modules of the block that hold them as ``weight``.
    PROJECTIONS: ClassVar[dict[str, str]] = dict(zip(("gate_up_proj", "down_proj"), EXPERT_PAIR_NAMES, strict=True))

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.__dict__["block"] = block  # not a child: the block holds this (a fused one), not the other way
        for name in EXPERT_PAIR_NAMES:
            self.add_module(name, _inner(getattr(block, name)))
        self.__dict__["act_fn"] = getattr(block, "activation", None)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.get_submodule(self.PROJECTIONS["gate_up_proj"]).weight

    @property
    def down_proj(self) -> torch.Tensor:
        return self.get_submodule(self.PROJECTIONS["down_proj"]).weight

    def adapted(self) -> dict[str, torch.nn.Module]:
        """``gate_up_proj`` and ``down_proj``'s modules as the block holds them now (under PEFT's wrappers)."""
        return {name: getattr(self.block, child) for name, child in self.PROJECTIONS.items()}


def expert_pair(module: torch.nn.Module) -> ExpertPair | None:
    """``module``'s routed experts if it holds them as a pair of gated (E, out, in) weights (``EXPERT_PAIR_NAMES``):
    the pair a fused block made (which its routed_experts settings are on), or a new one; else None. A pair whose
    first projection is not twice as wide as the second's input (JetMoE's mixture of attention) is no MLP's."""
    module = _inner(module)
    if isinstance(made := module.__dict__.get("experts"), ExpertPair):
        return made
    children = _children(module)
    weights = [getattr(children.get(name), "weight", None) for name in EXPERT_PAIR_NAMES]
    if not all(isinstance(weight, torch.Tensor) and weight.dim() == 3 for weight in weights):
        return None
    first, second = weights
    if first.shape[0] != second.shape[0] or first.shape[1] != 2 * second.shape[2] or first.shape[2] != second.shape[1]:
        return None
    return ExpertPair(module)


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
    # Softmax routers (Qwen3-MoE, Mixtral), sigmoid ones (GLM-4.5, DeepSeek-V3) or others (SCORING_FUNCTIONS): it
    # decides how router logits become per-expert probabilities.
    scoring: str

    @property
    def router_child(self) -> torch.nn.Module:
        """The block's router child under no wrapper: ``router`` itself, or the module that holds it as its logits'
        Linear (``logits_linear_name``), which holds the rule's settings and returns the router's choice."""
        return _children(self.block)[self.router_name]

    @property
    def routing(self) -> Routing | None:
        """How the block routes (``routing_rule``)."""
        return routing_rule(self.block, self.router_child)

    @property
    def choice_table(self) -> torch.Tensor | None:
        """The frozen table of each token id's experts that a hash layer chooses by (DeepSeek-V4's tid2eid), or None:
        also for a block without a routing rule (transformers' experts run it)."""
        routing = self.routing
        name = routing.choice_table if routing is not None else None
        return getattr(self.router_child, name) if name is not None else None

    @property
    def expert_weights(self) -> dict[str, torch.Tensor]:
        """The routed experts' own parameters by path under the block (under no wrapper): ``experts.<name>``, or an
        ``ExpertPair``'s ``input_linear.weight`` and ``output_linear.weight`` (JetMoE's)."""
        if isinstance(self.experts, ExpertPair):
            return {f"{name}.weight": getattr(self.experts, name).weight for name in EXPERT_PAIR_NAMES}
        return {f"experts.{name}": param for name, param in self.experts.named_parameters(recurse=False)}

    @property
    def adapted_experts(self) -> torch.nn.Module:
        """The routed experts under PEFT's wrappers, where their adapters are (``fused_moe.parameter_adapters``): the
        block's ``experts`` child as it holds it, or its ``ExpertPair``."""
        if isinstance(self.experts, ExpertPair):
            return self.experts
        return _inner(self.block).experts

    @property
    def reporter(self) -> torch.nn.Module | None:
        """The module that reports the block's routing itself (``reports_routing``): shardtune's fused block, or the
        fused router child of a block that is its decoder layer (Gemma 4's); None for a block the hooks record."""
        modules = (self.block, self.router_child)
        return next((module for module in modules if getattr(module, "reports_routing", False)), None)


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
            if _inner(module) is not module:
                continue  # a wrapper (a checkpointed MoE block's): the block itself comes next
            children = _children(module)
            router_name = next((name for name in ROUTER_NAMES if name in children), None)
            if router_name is None:
                continue
            experts = children["experts"] if "experts" in children else expert_pair(module)
            if experts is None:
                continue
            gate = children[router_name]
            linear_name = logits_linear_name(gate)
            router = _inner(getattr(gate, linear_name)) if linear_name else gate
            weight = getattr(router, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            shared_name = next((name for name in SHARED_EXPERT_NAMES if name in children), None)
            rule = routing_rule(module, gate)
            # The rule's (Gemma 4's router has no top_k: its rule reads the config's top_k_experts).
            top_k = rule.top_k if rule is not None else getattr(gate, "top_k", None)
            top_k = top_k or getattr(config, "num_experts_per_tok", None)
            if top_k is None:
                raise ValueError(f"cannot tell how many experts {type(router).__name__} picks per token (top_k)")
            blocks.append(
                MoeBlock(
                    layer=index,
                    path=_strip_wrappers(path),
                    block=module,
                    router=router,
                    router_name=router_name,
                    experts=experts,
                    shared_name=shared_name,
                    num_experts=weight.shape[0],
                    top_k=int(top_k),
                    scoring=_scoring(module, gate),
                )
            )
    return blocks


def _scoring(block: torch.nn.Module, router: torch.nn.Module) -> str:
    """The scoring (``SCORING_FUNCTIONS``): the rule's, or for a block without one, sigmoid where a correction bias
    marks the router (``block``'s router child) as DeepSeek-V3's (the rules' own blocks aside, such routers are all
    sigmoid ones), else softmax."""
    rule = routing_rule(block, router)
    if rule is not None:
        return rule.scoring
    return "sigmoid" if correction_bias(router, block) is not None else "softmax"


def correction_bias(router: torch.nn.Module, block: torch.nn.Module | None = None) -> torch.Tensor | None:
    """The bias a router adds to its scores for the choice only, as an (experts,) view, or None: the router's
    ``e_score_correction_bias`` (GLM, DeepSeek-V3), its ``moe_statics``' (ERNIE 4.5, a (1, experts) parameter),
    its block's (MiniMax-M2, Hy3), its block's ``expert_bias`` (LFM2, with use_expert_bias; AFMoE), or, for a
    ``router`` that is the logits' Linear of the block's router child, that child's (LongCat-Flash)."""
    holders = ((router, "e_score_correction_bias"), (getattr(router, "moe_statics", None), "e_score_correction_bias"),
               (block, "e_score_correction_bias"), (block, "expert_bias"),
               *((_inner(getattr(block, name, None)), "e_score_correction_bias") for name in ROUTER_NAMES))  # fmt: skip
    for holder, name in holders:
        bias = getattr(holder, name, None)
        if isinstance(bias, torch.Tensor):
            return bias.view(-1)
    return None


def _strip_wrappers(path: str) -> str:
    return re.sub(r"(^|\.)(base_layer|_checkpoint_wrapped_module)(?=\.|$)", "", path).strip(".")


def routing_probabilities(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-token probability over experts, in fp32.

    Softmax routers: the softmax of the logits. Routers that score each expert independently (sigmoid,
    DeepSeek-V4's sqrtsoftplus): their scores normalized over the experts are the distribution (as Megatron-LM
    computes the balancing loss and entropy for sigmoid routers).
    """
    scores = SCORING_FUNCTIONS[scoring](logits.float())
    if scoring == "softmax":
        return scores
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def token_statistics(probabilities: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per token, what a RoutingRecord sums over the real tokens, from (tokens, experts) router
    probabilities and (tokens, top_k) chosen experts: [1 for each chosen expert (experts) | probabilities
    (experts) | entropy in nats (1) | 1 (1)], (tokens, 2 x experts + 2) fp32, outside the autograd graph."""
    probabilities = probabilities.detach().float()
    choices = torch.zeros_like(probabilities).scatter_(1, chosen, 1.0)  # a token's top_k experts are distinct
    entropy = -(probabilities * probabilities.clamp_min(1e-30).log()).sum(dim=-1, keepdim=True)
    return torch.cat([choices, probabilities, entropy, torch.ones_like(entropy)], dim=-1)


def sum_real(values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """(tokens, n) values summed over the real tokens (``real``: (tokens,), bool or 0/1 in the values' dtype;
    None: every token) by a mask product: no host sync, unlike selecting the real rows."""
    return values.sum(dim=0) if real is None else (values * real.unsqueeze(-1)).sum(dim=0)


@dataclass(eq=False)
class RoutingRecord:
    """What one MoE block's router decided for the real tokens of one forward pass, summed over them."""

    block: MoeBlock
    counts: torch.Tensor  # (experts,) (token, choice) pairs routed to each expert
    probability_sum: torch.Tensor  # (experts,) router probabilities, summed; see RoutingRecorder for its gradient
    entropy_sum: torch.Tensor  # () the entropies of the tokens' router distributions, in nats
    tokens: torch.Tensor  # ()

    @classmethod
    def of(cls, block: MoeBlock, sums: torch.Tensor, probability_sum: torch.Tensor | None = None) -> RoutingRecord:
        """A record from the real-token sum of ``token_statistics``; ``probability_sum`` in the autograd graph
        replaces the statistics' own (detached) one."""
        experts = block.num_experts
        probabilities = sums[experts : 2 * experts] if probability_sum is None else probability_sum
        return cls(block, sums[:experts], probabilities, sums[2 * experts], sums[2 * experts + 1])


@dataclass
class RoutingRecorder:
    """While ``recording()``, each router's decision becomes a record.

    Blocks computed by transformers are seen through forward hooks on their routers; their records are
    made when the forward is over (ops run inside a hook would save tensors for backward that activation
    checkpointing's recomputation, where hooks record nothing, does not), with the probability sums in
    the autograd graph: the load-balancing loss's gradient reaches the routers through them.

    Blocks that route themselves (shardtune's fused block: ``reports_routing``) hand their per-token
    ``token_statistics`` to ``report`` from inside the forward, compiled or not (see
    ``shardtune.model.fused_moe``), without their probabilities' autograd graph: nothing leaves a
    compiled graph but what the report needs. With ``trains_balance`` the loss's gradient enters each such
    block's backward instead (``balance_objective`` sets it, ``balance_gradient`` hands it to the block).

    Forwards outside ``recording()`` (evaluation) and the recomputation that activation checkpointing
    runs inside backward record nothing, so every token is recorded exactly once per training forward.
    """

    blocks: list[MoeBlock]
    trains_balance: bool = False
    records: list[RoutingRecord] = field(default_factory=list)
    _real: torch.Tensor | None = None
    _active: bool = False
    _routed: list[tuple[MoeBlock, torch.Tensor, torch.Tensor, str]] = field(default_factory=list)
    _reported: int = 0
    _balance_gradient: torch.Tensor | None = None
    # Layers replayed as CUDA graphs (``fix_addresses``): the real-token mask and the balance gradient at fixed
    # addresses, and the sums reported while a layer is captured.
    _real_buffer: torch.Tensor | None = None
    _balance_buffer: torch.Tensor | None = None
    _captured: list[torch.Tensor] | None = None

    # The recorder of the latest recording: self-routing blocks report to it. One recording at a time.
    current: ClassVar[RoutingRecorder | None] = None

    def __post_init__(self) -> None:
        self._reporting = [block for block in self.blocks if block.reporter is not None]
        for block in self._reporting:
            block.reporter.trains_balance = self.trains_balance
        for block in self.blocks:
            if block not in self._reporting:
                # The router child itself, which returns its choice where a Linear it holds (Hunyuan-MoE's, AFMoE's)
                # returns only the logits: AFMoE's choice takes its correction bias.
                block.router_child.register_forward_hook(self._hook(block))
        # A compiled, checkpointed layer would otherwise replay the hooks' recording in backward (or,
        # without this option in older torch, break the layer's graph there): recording is forward-only.
        import torch._dynamo

        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

    def _hook(self, block: MoeBlock):
        def record(module: torch.nn.Module, inputs: tuple, output: object) -> None:
            if not self._active or torch._C._current_graph_task_id() != -1:
                return  # not a training forward, or checkpointing's recomputation during backward
            # Routers return their logits, and most their choice, in an order of their own (Granite-MoE's in
            # transformers 5.17: choice, weights, logits): the logits are the floats with one column per expert.
            parts = output if isinstance(output, tuple) else (output,)
            kinds = {kind.__name__ for kind in type(module).__mro__}  # also parametrized by PEFT
            if kinds & set(SCORES_BEFORE_LOGITS):
                parts = parts[::-1]
            if kinds & set(LOGITS_LAST):
                parts = parts[-1:]
            logits = next(
                (part for part in parts if part.is_floating_point() and part.shape[-1] == block.num_experts), None
            )
            scoring = "probabilities" if kinds & set(PROBABILITIES_FOR_LOGITS) else block.scoring
            # The router's own choice: DeepSeek-V4's hash routers return their table's.
            chosen = next((part for part in parts if not part.is_floating_point()), None)
            if logits is None and chosen is not None:
                # A router that returns its choice alone (LongCat-Flash's in transformers 5.17), whose logits are its
                # input times its Linear's weight, which it reads itself: made when the forward is over, as the
                # records are (an op run here would save tensors that checkpointing's recomputation does not).
                logits = (inputs[0], block.router.weight)
            else:
                logits = logits.reshape(-1, block.num_experts)
            if chosen is None:
                with torch.no_grad():  # every scoring keeps the order of the logits
                    chosen = logits.topk(block.top_k, dim=-1).indices
            self._routed.append((block, logits, chosen.reshape(-1, block.top_k), scoring))

        return record

    @contextlib.contextmanager
    def recording(self, real_tokens: torch.Tensor | None) -> Iterator[list[RoutingRecord]]:
        """Record the routers of one forward; ``real_tokens`` (batch, seq) masks out padding. The records
        of hooked routers join ``records`` when the forward is over."""
        self.records = []
        self._real = None if real_tokens is None else real_tokens.reshape(-1).bool()
        self._reported = 0
        self._balance_gradient = self._balance_buffer  # None, or the buffer a replayed graph reads
        self._fill_real_buffer()
        self._active = True
        RoutingRecorder.current = self
        try:
            yield self.records
        finally:
            self._active = False
            for block, logits, chosen, scoring in self._routed:
                if isinstance(logits, tuple):
                    hidden, weight = logits
                    logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.float())
                # "probabilities": what the router returned are its probabilities already (Gemma 4's).
                probabilities = logits.float() if scoring == "probabilities" else routing_probabilities(logits, scoring)
                sums = sum_real(token_statistics(probabilities, chosen), self._real)
                self.records.append(RoutingRecord.of(block, sums, sum_real(probabilities, self._real)))
            self._routed = []

    def fix_addresses(self, tokens: int) -> None:
        """For decoder layers about to be captured as CUDA graphs (``shardtune.distributed.layer_graphs``), during
        a recording of ``tokens`` tokens: from now on the real-token mask of a forward of that many tokens and
        the balance gradient are kept in buffers of their own, rewritten in place, so that a replayed graph reads
        this forward's. A replayed layer hands over the sums its capture reported (``capturing``), which each
        replay rewrites."""
        device = self.blocks[0].router.weight.device
        self._real_buffer = torch.ones(tokens, device=device)  # float32, as the routing weights it is cast to
        self._fill_real_buffer()
        if self._reporting and self.trains_balance:
            self._balance_buffer = self._balance_gradient = torch.zeros(self.blocks[0].num_experts, device=device)

    def _fill_real_buffer(self) -> None:
        buffer = self._real_buffer
        if buffer is None:
            return
        if self._real is None:
            buffer.fill_(1.0)
        elif self._real.shape == buffer.shape:
            buffer.copy_(self._real)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards run now are not recorded (a CUDA graph's warm-up)."""
        active, self._active = self._active, False
        try:
            yield
        finally:
            self._active = active

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """While a layer's forward is captured: what its blocks report is collected in the list yielded, not
        recorded."""
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None

    def records_now(self) -> bool:
        """Whether a forward running now is recorded: not outside ``recording()`` (evaluation), nor
        checkpointing's recomputation during backward."""
        return self._active and torch._C._current_graph_task_id() == -1

    def report(self, sums: torch.Tensor) -> None:
        """A self-routing block's ``token_statistics`` of a forward, summed over the real tokens
        (``real_tokens``). Blocks report in the order they run, which is the order of the layers."""
        if not self.records_now():
            return
        if self._captured is not None:
            self._captured.append(sums)
            return
        block = self._reporting[self._reported % len(self._reporting)]
        self._reported += 1
        self.records.append(RoutingRecord.of(block, sums))

    def real_tokens(self, like: torch.Tensor) -> torch.Tensor:
        """Which tokens of the forward recorded are real, as 0/1 in the dtype of ``like``, a (tokens, ...)
        tensor of it."""
        tokens = like.shape[0]
        if self._real_buffer is not None and self._real_buffer.shape[0] == tokens:
            return self._real_buffer.to(like.dtype)
        real = like.new_ones(tokens) if self._real is None else self._real.to(like.dtype)
        if real.shape[0] != tokens:
            raise ValueError(f"{tokens} tokens in a forward or backward of a recording of {real.shape[0]}")
        return real

    def balance_objective(self, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the load-balancing loss of the forward just recorded, weight x it as a term of the objective).

        Add the term to the objective and run backward through the model's output as usual: for hooked
        routers the term carries the gradient; self-routing blocks get weight x the loss's gradient with
        respect to their probability sums in their own backward (the term's value is the same)."""
        loss = load_balancing_loss(self.records)
        if self._reporting:
            if not self.trains_balance:
                raise ValueError("RoutingRecorder(trains_balance=False) has no balance gradient to give")
            self._balance_gradient = weight * load_balancing_gradient(self.records)
            if self._balance_buffer is not None:
                self._balance_gradient = self._balance_buffer.copy_(self._balance_gradient)
        return loss, weight * loss

    def balance_gradient(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For a self-routing block's backward, ``like`` a (tokens, ...) tensor of it: (which tokens are
        real, as 0/1, and the gradient of the objective with respect to its probability sum), in
        ``like``'s dtype; zeros before ``balance_objective`` (with fixed addresses: the buffer, as last set).
        Only the backward of the forward just recorded asks (its tokens are those of ``recording``)."""
        tokens, experts = like.shape[0], self.blocks[0].num_experts
        if self._balance_gradient is None:
            return like.new_zeros(tokens), like.new_zeros(experts)
        return self.real_tokens(like), self._balance_gradient.to(like.dtype)


def load_balancing_loss(records: list[RoutingRecord]) -> torch.Tensor:
    """The Switch Transformer load-balancing loss over all MoE layers, as transformers defines it for
    Qwen3-MoE and Mixtral: num_experts * sum_e f_e * P_e, where f_e is the share of (token, choice) pairs
    routed to expert e times top_k and P_e the mean router probability of e, both pooled over the layers
    and the real tokens. It is top_k when routing is uniform and grows as the load concentrates.

    Only P carries gradient (f counts discrete choices). Applied to sigmoid routers (GLM-4.5) with
    normalized scores as P.
    """
    num_experts = records[0].block.num_experts
    routed, probability_sum, rows = _pooled(records)
    return num_experts * torch.sum((routed / rows) * (probability_sum / rows))


def load_balancing_gradient(records: list[RoutingRecord]) -> torch.Tensor:
    """The gradient of ``load_balancing_loss(records)`` with respect to each record's probability sum: the
    same (num_experts,) vector for every layer, since the loss pools the layers: num_experts * routed / rows²."""
    num_experts = records[0].block.num_experts
    routed, _, rows = _pooled(records)
    return (num_experts * routed / rows**2).detach()


def _pooled(records: list[RoutingRecord]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routed pairs per expert, probability sums per expert, rows: at least 1) over the records."""
    routed = sum(record.counts for record in records)
    probability_sum = sum(record.probability_sum for record in records)
    rows = sum(record.tokens for record in records).clamp_min(1.0)  # no real token: a loss of 0
    return routed, probability_sum, rows

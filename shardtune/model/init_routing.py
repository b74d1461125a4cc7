"""A realistic expert load for random-weight MoE models (``model.init_routing``, ``shardtune bench --routing``).

Randomly drawn MoE models route unrealistically. Their attention is close to uniform, so each layer adds
the average of every earlier token's values to the residual stream: after a few layers every token of a
sequence carries the same large component (two to three times the rest), and every router sends the
tokens of a sequence to the same few experts. On the Qwen3-30B-A3B shape the busiest expert of a layer
gets 11 to 16 times the mean load, where trained models stay around 1.5 to 3; expert kernels then run a
few huge groups and many empty ones, which is neither the work nor the speed of a real fine-tuning run.

``balanced`` and ``skewed`` change two kinds of weights after the model is drawn, the same way in every
process (seeded, drawn on the CPU):

- the output projections of the token mixers (attention's ``o_proj``, DeepSeek-V4's ``o_b_proj``, the
  output experts of JetMoE's mixture of attention, its ``output_linear``; the ``out_proj`` of LFM2's attention
  and short convolutions, of linear attention and of Mamba mixers) are scaled by 1 / (8 x layers), so the
  residual stream keeps each token's own embedding and a router sees the token rather than its sequence's
  average (the shared component grows by a factor of about 1 + c x scale per layer);
- each MoE layer's router gets orthonormal rows (a seeded QR). Router inputs are RMS-normalized, so every
  expert's logit is about a standard normal over tokens, independent of the others'. ``balanced`` keeps
  them so: no expert is favoured, and the max/mean load is near 1 (sampling noise). ``skewed`` scales
  expert e's row by exp(s z_e), z_e evenly spaced normal quantiles in a seeded order per layer: experts
  with larger rows win more often, a long-tailed popularity like a trained router's. s is set by
  bisection on simulated standard normal logits (8,192 tokens, seeded) so that the busiest expert gets
  ``skewed_max_mean`` = 1 + (E/k - 1) / 10 times the mean load, for E experts of which k per token: a
  tenth of the way from an even load to one where the same experts take every token. That is 2.5 for
  128 experts of which 8 (Qwen3-30B-A3B, GLM-4.5-Air), 2.9 for GLM-4.7's 160, and 1.3 for Mixtral's 8 of
  which 2 (about what Mixtral's routing analysis shows). A hash layer's table of each token id's experts
  (DeepSeek-V4's, all 0 as drawn: every token's choices expert 0) gets distinct experts per id, drawn in
  proportion to the same popularity (exp(s z_e) for ``skewed``, even for ``balanced``).

``random`` leaves the model as drawn. The weights depend only on the seed, the model's config and the
device type the model was drawn on, so shardtune's run and the HF baseline of ``shardtune bench`` train
the same model with the same routers (``router_weights_digest`` shows it).
"""

from __future__ import annotations

import functools
import hashlib
import logging

import torch

from shardtune.distributed.parallelize import decoder_layers
from shardtune.errors import ConfigError
from shardtune.model.fused_moe import parameter_adapters
from shardtune.model.lora import mixes_tokens
from shardtune.model.moe import MoeBlock

log = logging.getLogger(__name__)

# A token mixer's output projection: most attention's o_proj, DeepSeek-V4's o_b_proj (after its grouped o_a_proj),
# JetMoE's mixture of attention's output experts (output_linear, (E, H, width)), the out_proj of LFM2's attention
# and short convolutions, of linear attention and of Mamba mixers.
OUTPUT_PROJECTION_NAMES = ("o_proj", "o_b_proj", "output_linear", "out_proj")
_SIMULATED_TOKENS = 8192
_BISECTION_STEPS = 24


def skewed_max_mean(num_experts: int, top_k: int) -> float:
    """The max/mean expert load ``skewed`` aims at: a tenth of the way from even (1) to num_experts / top_k."""
    return 1 + (num_experts / top_k - 1) / 10


def _quantiles(num_experts: int) -> torch.Tensor:
    return torch.special.ndtri((torch.arange(num_experts, dtype=torch.float64) + 0.5) / num_experts)


@functools.cache
def _standard_logits(num_experts: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(_SIMULATED_TOKENS, num_experts, generator=generator, dtype=torch.float64)


def simulated_max_mean(num_experts: int, top_k: int, spread: float) -> float:
    """max/mean load of top_k routing over standard normal logits scaled by exp(spread x quantile)."""
    logits = _standard_logits(num_experts)
    chosen = (logits * torch.exp(spread * _quantiles(num_experts))).topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=num_experts).double()
    return float(counts.max() / counts.mean())


@functools.cache
def skew_spread(num_experts: int, top_k: int) -> float:
    """The s of ``skewed`` for E experts of which k per token (bisection on simulated logits)."""
    target = skewed_max_mean(num_experts, top_k)
    low, high = 0.0, 1.0
    while simulated_max_mean(num_experts, top_k, high) < target and high < 64:
        low, high = high, 2 * high
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated_max_mean(num_experts, top_k, middle) < target else (low, middle)
    return high


def set_init_routing(
    model: torch.nn.Module, blocks: list[MoeBlock], routing: str, seed: int, materialized: bool = True
) -> None:
    """``model.init_routing``: set a freshly drawn model up for a ``balanced`` or ``skewed`` expert load.
    Every rank calls it, so all stop alike on a model it does not fit; only ``materialized`` weights (those
    a replica will receive) change."""
    if routing == "random":
        return
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    if not blocks:
        raise ConfigError(f"model.init_routing: {routing} needs MoE layers; {name} has none")
    projections = [
        parameter_adapters(module)[0]  # under PEFT's parameter wrappers where adapted (JetMoE's output experts)
        for layer in decoder_layers(model)
        for child_name, child in layer.named_children()
        if mixes_tokens(child_name, child)
        for path, module in child.named_modules()
        if path.rsplit(".", 1)[-1] in OUTPUT_PROJECTION_NAMES
    ]
    if not projections:
        raise ConfigError(f"model.init_routing: no token mixer's output projection (o_proj, out_proj) in {name}")
    if not materialized:
        return
    layers = model.config.get_text_config().num_hidden_layers
    with torch.no_grad():
        for projection in projections:
            projection.weight.mul_(1 / (8 * layers))
        for block in blocks:
            weight = block.router.weight
            generator = torch.Generator().manual_seed(seed * 100_003 + block.layer)
            hidden = weight.shape[1]
            gaussian = torch.randn(hidden, block.num_experts, generator=generator, dtype=torch.float64)
            # Orthonormal rows: independent standard normal logits. Only toy shapes have more experts
            # than dimensions; their unit rows are as independent as rows get.
            orthonormal = block.num_experts <= hidden
            rows = torch.linalg.qr(gaussian).Q.T if orthonormal else (gaussian / gaussian.norm(dim=0)).T
            popularity = torch.ones(block.num_experts, dtype=torch.float64)
            if routing == "skewed":
                order = torch.randperm(block.num_experts, generator=generator)
                popularity = torch.exp(
                    skew_spread(block.num_experts, block.top_k) * _quantiles(block.num_experts)[order]
                )
                rows = rows * popularity[:, None]
            weight.copy_(rows.to(weight.device))
            if (table := block.choice_table) is not None:
                # Hash layers (DeepSeek-V4's) take each token's experts from a table by token id, which a drawn model
                # leaves at 0 (every token's choices all expert 0): each id gets distinct experts, drawn in
                # proportion to the same popularity as the router's rows.
                choices = torch.multinomial(
                    popularity.expand(table.shape[0], -1), table.shape[1], replacement=False, generator=generator
                )
                table.copy_(choices.to(table.device, table.dtype))
    target = 1.0 if routing == "balanced" else skewed_max_mean(blocks[0].num_experts, blocks[0].top_k)
    log.info(
        "moe: router weights for a %s expert load (max/mean about %.2f); token mixers' outputs scaled by 1/%d",
        routing,
        target,
        8 * layers,
    )


def router_weights_digest(blocks: list[MoeBlock]) -> str:
    """A SHA-256 of every router weight (as fp32, in layer order) and hash layers' tables: two models with equal
    digests route alike."""
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block.router.weight.detach().float().cpu().contiguous().numpy().tobytes())
        if (table := block.choice_table) is not None:
            digest.update(table.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()

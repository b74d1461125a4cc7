"""Peak device memory of a training step, per GPU, from the model's shape and the config: the one estimate
``shardtune plan`` and ``shardtune doctor`` make. ``benchmarks/RESULTS.md`` ("Planner against measured peak
memory") sets it beside every measured peak, and ``tests/test_plan.py`` recomputes that table.

A step's memory is its state, which lives across steps, plus what one micro-batch needs on top:

- state: the weights (frozen in ``model.dtype``, trainable in fp32), Adam's two fp32 moments and the fp32
  gradients, each as the strategy places it (``choose_parallelism``: whole on every GPU, or a 1/world
  shard under FSDP; nothing with ``cpu_offload``). Gradients are freed after every optimizer step
  (``zero_grad(set_to_none=True)``) and grow again during backward, except under DDP, whose all-reduce
  buckets hold them for the whole run (measured: a 2-GPU DDP step peaks 0.156 GiB, Mistral-7B's LoRA
  gradients, above one GPU's);
- FSDP's gathered parameters: the root unit (embeddings, LM head) stays whole from the start of forward to
  the end of backward, and a decoder layer's units (an MoE layer's routed experts are a unit of their own:
  1/EP of them under expert parallelism) are whole while they run, the next one prefetched;
- activations: what each decoder layer keeps for backward, per token (below), for the micro-batch's
  ``per_device_train_batch_size x data.max_length`` tokens (the longest a batch can be); a checkpointed
  layer keeps less: only its input when the whole layer is recomputed (in host memory with
  ``activation_offloading``), the inputs of what it recomputes when only its attention, its MLP or both
  are (``Checkpointing``). What each layer recomputes is decided here too (``choose_checkpointing``):
  training applies the same choice;
- the loss: the logits it holds at its peak, for every token, or for one chunk of ``loss_chunk_tokens`` (fewer
  bytes a logit when its softmax is compiled; with the gradients it keeps from forward: of the head's input,
  and of its weights when they train), or for one block of liger-kernel's fused linear cross-entropy;
- one layer's backward: its activations again where they are recomputed (checkpointing), plus the
  gradients its backward produces on the way (``BACKWARD_WORKSPACE`` of its activations).

The peak is the larger of two moments: the loss (every layer's activations kept, the logits at their
largest) and a layer's backward (the logits gone; its recomputation and workspace on top of what is still
kept, or the gradients grown by then, whichever is more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardtune.config import Config
from shardtune.distributed.strategy import ParallelPlan
from shardtune.errors import ConfigError
from shardtune.plan.shape import LayerShape, ModelShape

# Of a GPU's memory, the share a run's own tensors may take: the rest is the CUDA context, NCCL's buffers
# and the allocator's cache. ``plan`` calls a run above it one that does not fit; the doctor calls it tight.
USABLE_SHARE = 0.9

# Bytes per logit (tokens x vocabulary) at the standard loss's peak: the bf16 logits, their fp32 copy for
# the softmax, its fp32 log-probabilities and the bf16 gradient (2 + 4 + 4 + 2). Measured: llama3-8b and
# mistral-7b have the same decoder layers and differ in the vocabulary (128,256 against 32,000 tokens; 0.8B
# more embedding weights): at 8,192 tokens a step peaks 10.28 GiB higher, 1.47 GiB of it weights, the rest
# 12.0 bytes per extra logit.
LOGIT_BYTES = 12
# Bytes per logit more where the model caps its logits itself (Gemma's cap * tanh(logits / cap), the standard loss):
# tanh's output in the compute dtype, which its backward reads (measured with saved_tensors_hooks on tiny Gemma 4: one
# bf16 logits tensor more than without the cap). The chunked loss caps each chunk itself, in fp32, keeping nothing more.
SOFTCAP_LOGIT_BYTES = 2
# Bytes per logit of one chunk of the chunked loss (``train.loss.LinearCrossEntropy``), its softmax eager: the
# bf16 logits, and log_softmax's fp32 copy of them and its fp32 output. Measured (``benchmarks/loss_kernels.py``,
# one H200): 1.45 GiB above the inputs for chunks of 1,024 x 151,936 logits, 10.0 bytes per logit.
CHUNK_LOGIT_BYTES = 10
# The same, its softmax compiled (``train.loss.compiled_softmax_gradient``, under ``parallel.compile``): only
# the bf16 logits, which the kernel overwrites with their gradient (measured: 0.29 GiB, 2.0 bytes per logit).
COMPILED_CHUNK_LOGIT_BYTES = 2
# A decoder layer's backward makes gradients of what it kept as it goes (input gradients of every
# projection, attention's fp32 accumulators), freeing the activations behind it: at its peak about this
# share of the layer's activations on top of them. Calibrated on the two measured runs whose peak is a
# layer's backward: Mistral-7B at 262,144 tokens (checkpointed, MLPs tiled, 57.05 GiB) and Mixtral-8x7B
# (checkpointed, 92.26 GiB); 1.0 overestimates the first by 11%.
BACKWARD_WORKSPACE = 0.75
FP32_BYTES = 4
# Per token and routed expert, what an MoE block's routing keeps: the router's fp32 logits and its fp32 probabilities
# (softmax or sigmoid of them). Per token and chosen expert: the chosen indices (int64), the sort of the (token, choice)
# pairs by expert and its inverse (int64 each) and the fp32 routing weights before and after their normalization.
# Measured with saved_tensors_hooks on tiny compiled Qwen3-MoE, DeepSeek-V2, LFM2-MoE and Phi-3.5-MoE layers (the
# exact set varies a little with the routing rule: a mask, a group score); Qwen3-30B-A3B (E = 128, k = 8): 1.3 kB a
# token and layer. Held to a compiled tiny block's saved bytes by test_a_frozen_compiled_block_keeps_what_is_counted.
ROUTER_EXPERT_BYTES = 2 * FP32_BYTES
ROUTED_CHOICE_BYTES = 3 * 8 + 2 * FP32_BYTES
DROPOUT_MASK_BYTES = 1  # a bool per element


@dataclass(frozen=True)
class LayerActivations:
    """What a decoder layer keeps for backward, in bytes per token, by where it is kept (``layer_token_bytes``)."""

    attention: int  # the layer's input, its normalized copy and the attention sublayer's activations
    mlp: int  # the residual after attention, its normalized copy and the MLP's (or MoE block's) activations
    norms: int  # eager layers: the RMSNorms' fp32 copies of their inputs (outside either sublayer)
    hidden: int  # one hidden state
    sublayer_input: int  # what a recomputed sublayer keeps of its input, the normalized hidden state
    slice: int  # per token of a tiled MLP's slice (0 when the MLP is not tiled)
    # Not per token: bytes the MoE block keeps once a micro-batch, whatever its tokens (the routed experts' LoRA
    # factors laid out for the grouped GEMMs), kept with the MLP's activations and recomputed with them
    factors: int = 0

    def kept(self, part: str | None, offloaded: bool = False) -> int:
        """Bytes per token kept from forward to backward when the layer recomputes ``part`` (``PARTS``, or
        None). A recomputed sublayer keeps its input; the hidden state its RMSNorm normalizes stays too. A
        recomputed layer keeps its own input (nothing on the device with ``activation_offloading``)."""
        if part == "layer":
            return 0 if offloaded else self.hidden
        recomputed = {"attention": ("attention",), "mlp": ("mlp",), "sublayers": ("attention", "mlp")}.get(part, ())
        return self.norms + sum(
            self.hidden + self.sublayer_input if name in recomputed else getattr(self, name)
            for name in ("attention", "mlp")
        )

    @property
    def total(self) -> int:
        return self.kept(None)

    def kept_bytes(self, part: str | None, tokens: int, offloaded: bool = False) -> int:
        """Bytes kept from forward to backward for a micro-batch of ``tokens`` when the layer recomputes ``part``:
        ``kept`` per token, and the ``factors`` unless the MLP is recomputed."""
        return self.kept(part, offloaded) * tokens + (self.factors if part in (None, "attention") else 0)

    def total_bytes(self, tokens: int) -> int:
        """Bytes of all the layer's activations for a micro-batch of ``tokens``."""
        return self.total * tokens + self.factors


def layer_token_bytes(shape: ModelShape, layer: LayerShape, config: Config, compiled: bool) -> LayerActivations:
    """Bytes a decoder layer keeps for backward per token, by part, and per token of a tiled MLP's slice.

    In elements of the compute dtype, for h the hidden size, q and kv the layer's own query and key/value widths
    (``LayerShape.attention_width``: the model's, but Gemma 4's full-attention layers have wider heads and fewer
    key/value ones than its sliding-window layers), I the MLP width; counted from what autograd saves (a frozen
    projection keeps no input for a weight gradient, a trainable one or its LoRA adapter does) with compiled layers:

    - attention 2h + 3q + 2kv: the layer input and its normalized copy, q, k, v after rotary, the attention
      output and the output projection's contiguous input; q + kv more where queries and keys are normalized
      (qk-norm: their RMSNorm keeps its input; measured on Qwen3-30B-A3B's compiled layer,
      ``benchmarks/layer_recompute.py``: recomputing the attention frees 44.5 kB a token, 9.7 kB more than
      counted without this term);
      under sdpa (``shape.sdpa_key_values``) also the key and value heads repeated to the query heads where
      transformers repeats them (2(q - kv) more: a mask, or heads wider than 256) and, in a layer whose sliding window
      is shorter than the sequence, the additive mask sdpa makes of its materialized mask (batch x S x S: S a token,
      S the sequence length ``data.max_length``); measured on a tiny Gemma 4 layer compiled on CPU, each kept per
      layer; Gemma 4 26B-A4B at 2 x 4,096 tokens: 4.2 GiB over its 30 layers; with a mask or heads wider than 256
      (``LayerShape.token_major_output``) sdpa's kernel writes its output token by token, as the output projection
      takes it, so that output is its input, not a copy: q less (on CPU always, and on one H200 for Gemma 4's layers:
      the same bytes to 16 a layer);
      kv more where the values are normalized and have a projection of their own (``LayerShape.value_norm``: Gemma
      4's v_norm, an RMSNorm without weight, keeps its input; where the keys are the values, attention_k_eq_v, that
      input is the key projection's output, counted with qk-norm);
      under eager attention (``LayerShape.attention_scores``: an architecture without sdpa on a CPU, or without
      FlexAttention either, or asked for) the key and value heads repeated to the query heads and each sequence's
      scores, heads x S a token, twice: compiled, two tensors in the compute dtype; uncompiled, the fp32 softmax and its
      copy in the compute dtype (GPT-OSS's softmax, with its sinks, is in the compute dtype: over by the fp32 one); its
      output, a product of the scores, not (q less); measured on tiny Qwen3-MoE and GPT-OSS layers on CPU, compiled to
      the byte (GPT-OSS: 1.5% under, its sinks' column), uncompiled 1.1% over; gpt-oss-20b at 2 x 4,096 tokens: 192 GiB
      over its 24 layers;
      with a mixture of attention experts (JetMoE's, on transformers' code) also 2k(h + w) for its k query
      and output experts (w their width): each one's gathered input rows and its output rows;
    - a token mixer other than plain attention (``LayerShape.token_mixer``: DeepSeek's multi-head latent attention,
      LFM2's short convolutions; ``shape.token_mixer_elements``) 2h and what it keeps in place of 3q + 2kv; a query/key
      RMSNorm named q_layernorm/k_layernorm (LFM2's) counts as qk-norm;
    - dense MLP 2h + 3I: the residual, its normalized copy, gate, up and their product (SiLU recomputed); compiled, a
      frozen one (no weight or adapter of it trains: an MoE model's dense layers and shared experts with LoRA on
      attention or the routed experts) h + 2I: the residual, gate and up (its frozen projections read neither the
      normalized input nor the product; measured on tiny DeepSeek-V2 layers compiled on CPU); frozen shared experts
      likewise 2s;
    - MoE block 2h + km' + 3s (+ jh): per chosen expert (k of them, m wide) its first projection's output, m' wide
      (gated experts' gate/up, 2m; ungated ones' up, m: Nemotron-H's) (the routing weight multiplies the
      hidden activation, so the down projection's output rows are not kept, and frozen experts need no GEMM
      input), the shared experts (s wide) as a dense MLP; and the router's fp32 logits over the
      experts; with LoRA (rank r) on the routed experts also 2kr': the low-rank products, the rank padded to
      r' (a multiple of 8). lora_A's inputs are built again in backward (on gate/up gathered from the
      block's input, on down computed from the gate/up output), except under expert parallelism, where the
      routed rows came from other ranks and are kept (kh more). Measured on one H200 at 8,192 tokens: -5.4%
      to +1.1% for Qwen3-30B-A3B (LoRA on attention, and on the routed experts too), GLM-4.5-Air (20 layers)
      and Mixtral-8x7B; the low end is the routed-expert run without checkpointing, where dropping the
      rows saved 10.5 GiB measured against 12.0 counted; and, once a layer rather than per token
      (``LayerActivations.factors``), the adapters' factors as the block multiplies by them: each forward copies
      every expert's A and B into the compute dtype laid out for the grouped GEMMs (``fused_moe.expert_lora_factors``:
      E x r' x (in + out) for each adapted projection; an adapter shared by the experts, r x (in + out)), and the
      GEMMs keep the copies for backward (``shape.expert_adapter_factors``), made again where the MLP is recomputed.
      Measured with saved_tensors_hooks on tiny Qwen3-MoE, Phi-3.5-MoE, DeepSeek-V2 and LFM2-MoE blocks in bf16:
      beside the two low-rank products these copies are all that LoRA on the routed experts adds in an eager block
      (and 4 bytes a routed row); Qwen3-30B-A3B's r=16 adapters, 25 MiB a layer, 1.17 GiB over its 48 layers
      (its routed-expert runs without checkpointing: -1.9% -> -0.7%). Compiled, the block also keeps its normalized
      input (h), which the low-rank products' rows are built again from: counted in the 2h above, but with LoRA on
      attention alone nothing in a compiled MoE block reads it in backward (the router is frozen) and it is not kept
      (measured on a tiny Qwen3-MoE layer compiled on CPU): counted only where something of the block trains
      (``LayerShape.block_trains``); the routing's own tensors, ``ROUTER_EXPERT_BYTES`` per expert and
      ``ROUTED_CHOICE_BYTES`` per chosen one;
      with jittered tokens also jh for its j multiplicative noise tensors (``shape.jitter_noises``: Phi-3.5-MoE's
      block and router each draw one, Mixtral's block with router_jitter_noise, DBRX's router with moe_jitter_eps):
      uniform noise shaped as the tokens, which the product's backward needs for the tokens' gradient and which
      cannot be drawn again (measured on a tiny Phi-3.5-MoE layer, compiled on CPU: 2h more kept than with its
      input_jitter_noise 0, with and without LoRA on the routed experts; Phi-3.5-MoE's 16 layers at 8,192 tokens:
      2.0 GiB);
    - a norm of what the feed-forward computes, applied before it joins the residual, keeps its input: ph for p of
      them (``LayerShape.post_norms``: Gemma 4's MoE layers normalize the dense MLP's output, the routed experts' and
      their sum, 3h); its post_attention_layernorm, which normalizes the attention's output, keeps that output in place
      of the residual between the sublayers (recomputed from it and the layer input): the h counted as the residual.
      Its router's input, normalized in fp32, is recomputed in backward from the residual and its fp32 statistics
      (kept: one a row, not counted), and its layer_scalar multiplies by a buffer: nothing. Measured on tiny Gemma 4
      layers compiled on CPU, both kinds, hidden 256 under heads of 256 and 512 and hidden 64 under heads of 16 and
      320: to the byte, but for LoRA's A products, the norms' fp32 statistics and sdpa's log-sum-exp, which no term
      counts (``test_gemma4_layers_keep_what_is_counted``); Gemma 4 26B-A4B at 2 x 4,096 tokens: 2.5 GiB more than
      before these terms and its layers' own widths (-8.5% -> -6.2%);
    - eager (uncompiled) layers also keep each RMSNorm's fp32 copy of its input and the SiLU output.

    Measured against Mistral-7B with LoRA on every projection, compiled, 512 to 16,384 tokens a micro-batch:
    148.5 kB per token and layer, against 147.5 kB counted. LoRA dropout keeps a mask per adapted input (and,
    eager, the dropped copy itself), counted with the attention: kept unless the attention is recomputed.
    """
    h, q, kv, e = shape.hidden, layer.attention_width, layer.kv_width, shape.compute_bytes
    tiled = config.training.mlp_chunk_tokens > 0 and not layer.num_experts
    if layer.token_mixer:
        attention = (2 * h + layer.token_mixer) * e
    else:
        norm_inputs = (q + kv if layer.qk_norm else 0) + (kv if layer.value_norm else 0)
        attention = (2 * h + 3 * q + 2 * kv + norm_inputs + layer.attention_expert_rows) * e
        attention += (layer.repeated_kv + (config.data.max_length if layer.sliding_mask else 0)) * e
        attention -= q * e if layer.token_major_output else 0
        # Eager attention's scores: compiled, two heads x S x S tensors in the compute dtype; uncompiled, the fp32
        # softmax and its copy in the compute dtype. Its output, a product of the scores, is not kept (q less).
        if layer.attention_scores:
            attention += layer.attention_scores * (2 * e if compiled else FP32_BYTES + e) - q * e
    # Compiled, a frozen MLP (or frozen shared experts) keeps gate and up but not their product, which only a trained
    # down projection reads; a part with nothing trainable keeps no normalized input, only the residual its RMSNorm
    # reads
    frozen_mlp = compiled and not layer.mlp_trains
    if layer.num_experts:
        normalized = h if layer.block_trains or not compiled else 0
        elements = h + normalized + layer.top_k * layer.expert_row_width
        elements += (2 if frozen_mlp else 3) * layer.shared_width + layer.jitter_noises * h
        if layer.expert_adapter_rank:
            padded_rank = layer.expert_adapter_rank + -layer.expert_adapter_rank % 8
            elements += layer.top_k * 2 * padded_rank
            if config.parallel.expert_parallel_size > 1:
                elements += layer.top_k * h  # rows from other ranks: kept, not gathered again
        mlp = elements * e + layer.num_experts * ROUTER_EXPERT_BYTES + layer.top_k * ROUTED_CHOICE_BYTES
    elif frozen_mlp and not tiled:
        mlp = (h + 2 * layer.mlp_width) * e
    else:
        mlp = (2 * h if tiled else 2 * h + 3 * layer.mlp_width) * e
    mlp += layer.post_norms * h * e
    slice_token = 3 * layer.mlp_width * e if tiled else 0
    norms = 0
    if not compiled:
        if e < FP32_BYTES:
            norms = 2 * h * FP32_BYTES  # the two RMSNorms' fp32 copies
        if tiled:
            slice_token += layer.mlp_width * e  # the SiLU output
        else:
            mlp += (layer.mlp_width + layer.shared_width) * e  # (mlp_width is 0 in an MoE layer)
    if config.lora.enabled and config.lora.lora_dropout > 0:
        attention += layer.adapter_inputs * (DROPOUT_MASK_BYTES + (0 if compiled else e))
    # A compiled layer recomputes a recomputed sublayer's normalized input from the hidden state (measured on
    # one H100, Qwen3-30B-A3B's layer at 8,192 tokens: 8,200 bytes a token kept with both sublayers
    # recomputed, the layer's input and the residual); an eager one keeps it.
    factors = layer.expert_adapter_factors * e
    return LayerActivations(attention, mlp, norms, h * e, 0 if compiled else h * e, slice_token, factors)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per GPU of a training step, by what holds them (see the module docstring)."""

    checkpointed: Checkpointing  # what each decoder layer recomputes in backward
    weights: int
    gradients: int
    optimizer: int
    fsdp_gathered: int
    activations: int  # kept across the layers for backward
    loss: int
    layer_backward: int  # one layer's recomputation and backward workspace
    peak: int
    moment: str  # "loss" or "backward": where the peak is
    offloaded: int  # host memory per GPU (cpu_offload): its shard of weights, gradients and optimizer state

    def parts(self) -> list[tuple[str, int]]:
        """The terms of the two moments the peak is the larger of, by name (FSDP's where it applies)."""
        state = [("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer)]
        gathered = [("FSDP gathered", self.fsdp_gathered)] if self.fsdp_gathered else []
        return [*state, *gathered, ("activations", self.activations), ("loss", self.loss),
                ("layer backward", self.layer_backward)]  # fmt: skip


def micro_batch_tokens(config: Config) -> int:
    """The most tokens one micro-batch can hold: every sequence at ``data.max_length``."""
    return config.training.per_device_train_batch_size * config.data.max_length


def loss_bytes(config: Config, shape: ModelShape, tokens: int, compiled: bool) -> int:
    """What the loss holds at its peak for a micro-batch of ``tokens`` (every token taken as a target), its
    chunks' softmax ``compiled`` or not."""
    from shardtune.train.loss import chunk_tokens_for  # train.loss imports parallelize, which imports this

    if config.model.liger_kernel:
        # liger-kernel's fused linear cross-entropy: blocks of tokens / ceil(vocab / hidden), rounded up to a
        # power of two (its chunk size), logits and gradients computed block by block in forward.
        block = math.ceil(tokens / math.ceil(shape.vocab / shape.hidden))
        return LOGIT_BYTES * min(tokens, 2 ** math.ceil(math.log2(block))) * shape.vocab
    chunk = chunk_tokens_for(config.training.loss_chunk_tokens, shape.loss_head_vocab, tokens)
    if not chunk:
        return (LOGIT_BYTES + (SOFTCAP_LOGIT_BYTES if shape.softcapped_logits else 0)) * tokens * shape.vocab
    # One chunk's logits, and the gradients kept from forward to backward: of the head's input, and of its
    # weights (fp32) where they train (full fine-tuning).
    head_gradient = 0 if config.lora.enabled else shape.vocab * shape.hidden * FP32_BYTES
    return (
        (COMPILED_CHUNK_LOGIT_BYTES if compiled else CHUNK_LOGIT_BYTES) * min(tokens, chunk) * shape.vocab
        + tokens * shape.hidden * shape.compute_bytes
        + head_gradient
    )


def estimate_memory(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, gpu_memory: int | None
) -> MemoryEstimate:
    """The peak device memory per GPU of a step of ``config`` on ``shape`` under ``plan``, with the
    checkpointing ``choose_checkpointing`` chooses for a GPU of ``gpu_memory`` bytes (None: a CPU run);
    ``compiled``: whether the decoder layers run compiled (``parallel.compile`` on the run's device)."""
    checkpointing = choose_checkpointing(config, shape, plan, compiled, gpu_memory)
    return _estimate(config, shape, plan, compiled, checkpointing)


def usable_memory(config: Config, gpu_memory: int) -> int:
    """Bytes of a GPU of ``gpu_memory`` bytes that a step's estimated peak may take: ``USABLE_SHARE`` of it,
    or ``training.memory_budget_gib`` where set (a GPU shared with another process, or a run held to another
    run's memory), at most all of it."""
    budget = config.training.memory_budget_gib
    return int(USABLE_SHARE * gpu_memory) if budget is None else min(int(budget * 2**30), gpu_memory)


def usable_share(config: Config) -> str:
    """Where ``usable_memory`` comes from, in words: ``90%`` or ``training.memory_budget_gib`` (of the GPU's)."""
    return f"{USABLE_SHARE:.0%}" if config.training.memory_budget_gib is None else "training.memory_budget_gib"


# What a checkpointed decoder layer can recompute in backward: its attention, its MLP (or MoE block), both
# (each from its own input), or all of it.
PARTS = ("attention", "mlp", "sublayers", "layer")
# The order ``auto`` takes them in, cheapest per byte freed first. Measured on one H100
# (``benchmarks/layer_recompute.py``: Qwen3-30B-A3B's layer, LoRA on attention and routed experts, 8,192 tokens,
# compiled): recomputing the attention frees 44 kB a token for 1.2 ms more backward; the MoE block too, 30 kB
# more for 1.7 ms more (its router, sort, gather and routed gate/up GEMMs); the whole layer, 4 kB more for
# 1.3 ms more (the norms, the output projections and the routed down GEMM, whose outputs backward does not need).
AUTO_PARTS = ("attention", "sublayers", "layer")


@dataclass(frozen=True)
class Checkpointing:
    """What each decoder layer recomputes in backward, by index: None (nothing) or one of ``PARTS``."""

    parts: tuple[str | None, ...]

    @classmethod
    def uniform(cls, count: int, part: str | None, chosen: frozenset[int] | None = None) -> Checkpointing:
        """``part`` on the ``chosen`` layers of ``count`` (default: all), nothing on the others."""
        return cls(tuple(part if chosen is None or index in chosen else None for index in range(count)))

    @property
    def count(self) -> int:
        """How many layers recompute something."""
        return sum(part is not None for part in self.parts)

    def layers(self, part: str) -> list[int]:
        """The indices of the layers that recompute ``part``."""
        return [index for index, recomputed in enumerate(self.parts) if recomputed == part]

    def counts(self) -> dict[str, int]:
        """Layers per part of ``PARTS``, for logs and results."""
        return {part: len(self.layers(part)) for part in PARTS}


def checkpoint_parts(config: Config, shape: ModelShape) -> tuple[str, ...]:
    """The parts ``training.gradient_checkpointing_granularity`` lets a layer recompute, cheapest first.

    ``auto``: ``AUTO_PARTS``, except where only whole layers can be: a decoder layer without its attention
    and its MLP as modules of their own (OPT's MLP is two linear layers of the layer itself), and
    ``activation_offloading`` (it moves a whole checkpointed layer's input to host memory); with tiled MLPs
    (``mlp_chunk_tokens`` recomputes them slice by slice already) the attention, then whole layers."""
    training = config.training
    granularity = training.gradient_checkpointing_granularity
    whole = [layer for layer in shape.layers if not layer.sublayers]
    if granularity in ("attention", "mlp", "sublayers") and whole:
        raise ConfigError(
            f"training.gradient_checkpointing_granularity: {granularity} needs each decoder layer's attention and "
            f"MLP as modules of their own, which {len(whole)} of this model's {len(shape.layers)} layers do not "
            "have; set it to layer (or auto)"
        )
    if granularity != "auto":
        return (granularity,)
    if whole or training.activation_offloading:
        return ("layer",)
    return ("attention", "layer") if training.mlp_chunk_tokens else AUTO_PARTS


def choose_checkpointing(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, gpu_memory: int | None
) -> Checkpointing:
    """What each decoder layer recomputes in backward.

    ``gradient_checkpointing: true``: every ``gradient_checkpointing_every``-th layer, the whole layer (or the
    part ``gradient_checkpointing_granularity`` names); ``false``: nothing. ``auto``: the least recomputation
    that brings the estimated peak within ``usable_memory`` of the GPU's, nothing when the step fits without
    (recomputing a whole layer costs about a third of its time: 19,740 against 13,830 tokens/s for
    Qwen3-30B-A3B LoRA at 8,192 tokens on one H200), everything when nothing less fits. Layers are taken
    evenly spread over the model, one part at a time in the order of ``checkpoint_parts``, cheapest per byte
    first: the attention of more and more layers, then their MLP too, then whole layers. On CPU
    (``gpu_memory`` None) nothing: host memory is not what a CPU run runs out of.
    """
    training = config.training
    count = len(shape.layers)
    parts = checkpoint_parts(config, shape)
    if training.gradient_checkpointing is True:
        every = frozenset(range(0, count, training.gradient_checkpointing_every))
        return Checkpointing.uniform(count, parts[-1], every)
    if training.gradient_checkpointing is False or gpu_memory is None:
        return Checkpointing.uniform(count, None)
    budget = usable_memory(config, gpu_memory)
    for step in range(len(parts) * count):
        level, upgraded = divmod(step, count)
        chosen = spread_layers(count, upgraded)
        below = parts[level - 1] if level else None
        checkpointing = Checkpointing(tuple(parts[level] if index in chosen else below for index in range(count)))
        if _estimate(config, shape, plan, compiled, checkpointing).peak <= budget:
            return checkpointing
    return Checkpointing.uniform(count, parts[-1])


def describe_checkpointing(config: Config, checkpointing: Checkpointing) -> str:
    """``checkpointing`` in words, for plan, doctor and the training log."""
    count, layers = checkpointing.count, len(checkpointing.parts)
    what = "off" if not count else "on every layer" if count == layers else f"on {count} of {layers} layers"
    notes = ["auto"] if config.training.gradient_checkpointing == "auto" else []
    recomputed = {part: number for part, number in checkpointing.counts().items() if number}
    if set(recomputed) - {"layer"}:
        words = {"attention": "their attention", "mlp": "their MLP", "sublayers": "their attention and MLP",
                 "layer": "all of it"}  # fmt: skip
        notes.append(", ".join(f"{number} recompute {words[part]}" for part, number in recomputed.items()))
    return f"gradient checkpointing {what}" + (f" ({'; '.join(notes)})" if notes else "")


def spread_layers(count: int, chosen: int) -> frozenset[int]:
    """``chosen`` of ``count`` layer indices, evenly spread (0 first)."""
    return frozenset(index * count // chosen for index in range(chosen))


def _estimate(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, checkpointing: Checkpointing
) -> MemoryEstimate:
    training, parallel = config.training, config.parallel
    tokens = micro_batch_tokens(config)
    offload = plan.strategy == "fsdp" and parallel.cpu_offload
    weights, gradients, optimizer = (0, 0, 0) if offload else (plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes)
    gathered = 0
    if plan.strategy == "fsdp":
        # Under expert parallelism an MoE layer's experts unit holds (and gathers) only this rank's experts.
        ep = parallel.expert_parallel_size
        units = [size for layer in shape.layers for size in (layer.params, layer.expert_params // ep) if size]
        # Whole from forward to backward: the root unit always, every layer unit without resharding.
        held = shape.root_params + (0 if parallel.reshard_after_forward else sum(units))
        gathered = (held + 2 * max(units, default=0)) * shape.compute_bytes

    kept = 0
    layer_backward = 0
    for layer, part in zip(shape.layers, checkpointing.parts, strict=True):
        per_token = layer_token_bytes(shape, layer, config, compiled)
        activations = per_token.total_bytes(tokens)
        tile = per_token.slice * min(tokens, training.mlp_chunk_tokens) * (1 + BACKWARD_WORKSPACE)
        layer_kept = per_token.kept_bytes(part, tokens, training.activation_offloading)
        kept += layer_kept
        # In its backward a layer holds all its activations again: what it kept, and what it recomputed.
        backward = activations - layer_kept + activations * BACKWARD_WORKSPACE + tile
        layer_backward = max(layer_backward, round(backward))
    loss = loss_bytes(config, shape, tokens, compiled)

    state = weights + optimizer + (gradients if plan.strategy == "ddp" else 0) + gathered
    at_loss = state + kept + loss
    grown = 0 if plan.strategy == "ddp" else gradients
    in_backward = state + max(kept, grown) + layer_backward
    return MemoryEstimate(
        checkpointed=checkpointing,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        fsdp_gathered=gathered,
        activations=kept,
        loss=loss,
        layer_backward=layer_backward,
        peak=max(at_loss, in_backward),
        moment="loss" if at_loss >= in_backward else "backward",
        offloaded=(plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes) if offload else 0,
    )

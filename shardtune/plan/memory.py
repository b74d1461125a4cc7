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
  layer keeps only its input (in host memory with ``activation_offloading``). Which layers are checkpointed
  is decided here too (``checkpointed_layers``): training applies the same choice;
- the loss: the logits it holds at its peak, for every token, or for one chunk of ``loss_chunk_tokens`` (with
  the gradients it keeps from forward: of the head's input, and of its weights when they train), or for
  one block of liger-kernel's fused linear cross-entropy;
- one layer's backward: its activations again when they are recomputed (checkpointing), plus the
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
# Bytes per logit of one chunk of the chunked loss (``train.loss.LinearCrossEntropy``): the bf16 logits, and
# log_softmax's fp32 copy of them and its fp32 output. Measured (``benchmarks/loss_kernels.py``, one H100):
# 1.74 GiB above the inputs for chunks of 1,024 x 151,936 logits, 12.0 bytes per logit.
CHUNK_LOGIT_BYTES = 12
# A decoder layer's backward makes gradients of what it kept as it goes (input gradients of every
# projection, attention's fp32 accumulators), freeing the activations behind it: at its peak about this
# share of the layer's activations on top of them. Calibrated on the two measured runs whose peak is a
# layer's backward: Mistral-7B at 262,144 tokens (checkpointed, MLPs tiled, 57.05 GiB) and Mixtral-8x7B
# (checkpointed, 92.26 GiB); 1.0 overestimates the first by 11%.
BACKWARD_WORKSPACE = 0.75
FP32_BYTES = 4
DROPOUT_MASK_BYTES = 1  # a bool per element


def layer_token_bytes(shape: ModelShape, layer: LayerShape, config: Config, compiled: bool) -> tuple[int, int]:
    """Bytes a decoder layer keeps for backward per token, and per token of a tiled MLP's slice (0 when its
    MLP is not tiled).

    In elements of the compute dtype, for h the hidden size, q and kv the query and key/value widths, I the
    MLP width; counted from what autograd saves (a frozen projection keeps no input for a weight gradient,
    a trainable one or its LoRA adapter does) with compiled layers:

    - attention 2h + 3q + 2kv: the layer input and its normalized copy, q, k, v after rotary, the attention
      output and the output projection's contiguous input;
    - dense MLP 2h + 3I: the residual, its normalized copy, gate, up and their product (SiLU recomputed);
    - MoE block 2h + 2km + 3s: per chosen expert (k of them, m wide) its gate/up output (the routing weight
      multiplies the hidden activation, so the down projection's output rows are not kept, and frozen experts
      need no GEMM input), the shared experts (s wide) as a dense MLP; and the router's fp32 logits over the
      experts; with LoRA (rank r) on the routed experts also 2kr': the low-rank products, the rank padded to
      r' (a multiple of 8). lora_A's inputs are built again in backward (on gate/up gathered from the
      block's input, on down computed from the gate/up output), except under expert parallelism, where the
      routed rows came from other ranks and are kept (kh more). Measured on one H200 at 8,192 tokens: -5.4%
      to +1.1% for Qwen3-30B-A3B (LoRA on attention, and on the routed experts too), GLM-4.5-Air (20 layers)
      and Mixtral-8x7B; the low end is the routed-expert run without checkpointing, where dropping the
      rows saved 10.5 GiB measured against 12.0 counted;
    - eager (uncompiled) layers also keep each RMSNorm's fp32 copy of its input and the SiLU output.

    Measured against Mistral-7B with LoRA on every projection, compiled, 512 to 16,384 tokens a micro-batch:
    148.5 kB per token and layer, against 147.5 kB counted. LoRA dropout keeps a mask per adapted input (and,
    eager, the dropped copy itself).
    """
    h, q, kv, e = shape.hidden, shape.attention_width, shape.kv_width, shape.compute_bytes
    tiled = config.training.mlp_chunk_tokens > 0 and not layer.num_experts
    elements = 2 * h + 3 * q + 2 * kv
    if layer.num_experts:
        elements += 2 * h + 2 * layer.top_k * layer.expert_width + 3 * layer.shared_width
        if layer.expert_adapter_rank:
            padded_rank = layer.expert_adapter_rank + -layer.expert_adapter_rank % 8
            elements += layer.top_k * 2 * padded_rank
            if config.parallel.expert_parallel_size > 1:
                elements += layer.top_k * h  # rows from other ranks: kept, not gathered again
    else:
        elements += 2 * h if tiled else 2 * h + 3 * layer.mlp_width
    per_token = elements * e + layer.num_experts * FP32_BYTES  # the router's logits
    slice_token = 3 * layer.mlp_width * e if tiled else 0
    if not compiled:
        if e < FP32_BYTES:
            per_token += 2 * h * FP32_BYTES  # the two RMSNorms' fp32 copies
        if tiled:
            slice_token += layer.mlp_width * e  # the SiLU output
        else:
            per_token += (layer.mlp_width + layer.shared_width) * e  # (mlp_width is 0 in an MoE layer)
    if config.lora.enabled and config.lora.lora_dropout > 0:
        per_token += layer.adapter_inputs * (DROPOUT_MASK_BYTES + (0 if compiled else e))
    return per_token, slice_token


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per GPU of a training step, by what holds them (see the module docstring)."""

    checkpointed: frozenset[int]  # the decoder layers (by index) whose activations are recomputed
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


def loss_bytes(config: Config, shape: ModelShape, tokens: int) -> int:
    """What the loss holds at its peak for a micro-batch of ``tokens`` (every token taken as a target)."""
    from shardtune.train.loss import chunk_tokens_for  # train.loss imports parallelize, which imports this

    if config.model.liger_kernel:
        # liger-kernel's fused linear cross-entropy: blocks of tokens / ceil(vocab / hidden), rounded up to a
        # power of two (its chunk size), logits and gradients computed block by block in forward.
        block = math.ceil(tokens / math.ceil(shape.vocab / shape.hidden))
        return LOGIT_BYTES * min(tokens, 2 ** math.ceil(math.log2(block))) * shape.vocab
    chunk = chunk_tokens_for(config.training.loss_chunk_tokens, shape.loss_head_vocab, tokens)
    if not chunk:
        return LOGIT_BYTES * tokens * shape.vocab
    # One chunk's logits, and the gradients kept from forward to backward: of the head's input, and of its
    # weights (fp32) where they train (full fine-tuning).
    head_gradient = 0 if config.lora.enabled else shape.vocab * shape.hidden * FP32_BYTES
    return (
        CHUNK_LOGIT_BYTES * min(tokens, chunk) * shape.vocab
        + tokens * shape.hidden * shape.compute_bytes
        + head_gradient
    )


def estimate_memory(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, gpu_memory: int | None
) -> MemoryEstimate:
    """The peak device memory per GPU of a step of ``config`` on ``shape`` under ``plan``, with the decoder
    layers ``checkpointed_layers`` chooses for a GPU of ``gpu_memory`` bytes (None: a CPU run); ``compiled``:
    whether the decoder layers run compiled (``parallel.compile`` on the run's device)."""
    checkpointed = checkpointed_layers(config, shape, plan, compiled, gpu_memory)
    return _estimate(config, shape, plan, compiled, checkpointed)


def usable_memory(config: Config, gpu_memory: int) -> int:
    """Bytes of a GPU of ``gpu_memory`` bytes that a step's estimated peak may take: ``USABLE_SHARE`` of it,
    or ``training.memory_budget_gib`` where set (a GPU shared with another process, or a run held to another
    run's memory), at most all of it."""
    budget = config.training.memory_budget_gib
    return int(USABLE_SHARE * gpu_memory) if budget is None else min(int(budget * 2**30), gpu_memory)


def usable_share(config: Config) -> str:
    """Where ``usable_memory`` comes from, in words: ``90%`` or ``training.memory_budget_gib`` (of the GPU's)."""
    return f"{USABLE_SHARE:.0%}" if config.training.memory_budget_gib is None else "training.memory_budget_gib"


def checkpointed_layers(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, gpu_memory: int | None
) -> frozenset[int]:
    """The decoder layers whose activations are recomputed in backward, by index.

    ``gradient_checkpointing: true``: every ``gradient_checkpointing_every``-th layer; ``false``: none.
    ``auto``: the fewest layers that bring the estimated peak within ``usable_memory`` of the GPU's,
    spread evenly over the model: none when the step fits without (recomputing costs about a third of a
    layer's time: 19,740 against 13,830 tokens/s for Qwen3-30B-A3B LoRA at 8,192 tokens on one H200), all when
    nothing less fits. On CPU (``gpu_memory`` None) none: host memory is not what a CPU run runs out of.
    """
    training = config.training
    count = len(shape.layers)
    if training.gradient_checkpointing is True:
        return frozenset(range(0, count, training.gradient_checkpointing_every))
    if training.gradient_checkpointing is False or gpu_memory is None:
        return frozenset()
    budget = usable_memory(config, gpu_memory)
    for checkpoints in range(count):
        chosen = spread_layers(count, checkpoints)
        if _estimate(config, shape, plan, compiled, chosen).peak <= budget:
            return chosen
    return frozenset(range(count))


def describe_checkpointing(config: Config, checkpointed: frozenset[int], layers: int) -> str:
    """``checkpointed`` (of ``layers`` decoder layers) in words, for plan, doctor and the training log."""
    count = len(checkpointed)
    what = "off" if not count else "on every layer" if count == layers else f"on {count} of {layers} layers"
    return f"gradient checkpointing {what}{' (auto)' if config.training.gradient_checkpointing == 'auto' else ''}"


def spread_layers(count: int, chosen: int) -> frozenset[int]:
    """``chosen`` of ``count`` layer indices, evenly spread (0 first)."""
    return frozenset(index * count // chosen for index in range(chosen))


def _estimate(
    config: Config, shape: ModelShape, plan: ParallelPlan, compiled: bool, checkpointed: frozenset[int]
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
    for index, layer in enumerate(shape.layers):
        per_token, slice_token = layer_token_bytes(shape, layer, config, compiled)
        activations = per_token * tokens
        tile = slice_token * min(tokens, training.mlp_chunk_tokens) * (1 + BACKWARD_WORKSPACE)
        if index in checkpointed:
            kept += 0 if training.activation_offloading else tokens * shape.hidden * shape.compute_bytes
            backward = activations * (1 + BACKWARD_WORKSPACE) + tile
        else:
            kept += activations
            backward = activations * BACKWARD_WORKSPACE + tile
        layer_backward = max(layer_backward, round(backward))
    loss = loss_bytes(config, shape, tokens)

    state = weights + optimizer + (gradients if plan.strategy == "ddp" else 0) + gathered
    at_loss = state + kept + loss
    grown = 0 if plan.strategy == "ddp" else gradients
    in_backward = state + max(kept, grown) + layer_backward
    return MemoryEstimate(
        checkpointed=checkpointed,
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

"""Estimates from the model's config alone (built on the meta device, no weights read): memory per
device for the configured strategy, and the disk the checkpoints will take.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.config import Config
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.parallelize import ParallelPlan
from shardtune.doctor.report import FAIL, OK, WARN, Check, plural, size

# Above this share of the memory an estimate this rough is a warning: allocator caches, the CUDA
# context and communication buffers take the rest.
MEMORY_WARN_SHARE = 0.9
FIX_MEMORY = (
    "lower training.per_device_train_batch_size or data.max_length, set training.gradient_checkpointing=true, "
    "use parallel.strategy=fsdp over more ranks, or LoRA (lora.enabled=true)"
)


def available_host_memory() -> int:
    """Bytes of RAM available to new allocations (MemAvailable: free plus reclaimable page cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need to know about the model, from its config alone (built on the meta device)."""

    trainable: int
    total: int
    stored_bytes: int  # every parameter as training stores it: frozen in model.dtype, trainable fp32
    compute_bytes: int  # per element, in the compute dtype (activations; final/ of a full fine-tune)
    plan: ParallelPlan  # per-device parameter, gradient and optimizer bytes for this run's strategy
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    flops_per_token: float  # training's FLOP count (for MFU) at data.max_length


# Where configs of different families keep the MLP width (Llama, GPT-2, OPT, Falcon); 4 x hidden otherwise.
MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")


def model_shape(config: Config, env: DistributedEnv) -> ModelShape:
    """The model exactly as training builds it (``build_model``, with LoRA), on the meta device: no weights
    are read. Its sizes come from its modules and transformers' names for the config's keys, and its FLOP
    count is training's own: a model that training could not build or count fails here."""
    from shardtune.distributed.parallelize import decoder_layers, plan_parallelism
    from shardtune.metrics.flops import routed_expert_trainable, run_token_flops
    from shardtune.model.load import Precision, build_model
    from shardtune.model.moe import find_moe_blocks

    precision = Precision.resolve(config, env.device)
    model = build_model(config, env.device, training=True, materialize=False)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    text = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    hidden = getattr(text, "hidden_size", None) or embedding.embedding_dim
    intermediate = next((getattr(text, key) for key in MLP_WIDTH_KEYS if getattr(text, key, None)), 4 * hidden)
    routed = routed_expert_trainable(find_moe_blocks(model, decoder_layers(model)))
    flops = run_token_flops(model, config.data.max_length, config.lora.enabled, trainable, routed)
    return ModelShape(
        trainable=trainable,
        total=total,
        stored_bytes=sum(p.numel() * p.element_size() for p in params),
        compute_bytes=(precision.autocast or precision.compute).itemsize,
        plan=plan_parallelism(model, config, env),
        hidden=hidden,
        intermediate=intermediate,
        layers=len(decoder_layers(model)),
        vocab=embedding.num_embeddings,
        flops_per_token=flops.per_token,
    )


def activation_bytes(config: Config, shape: ModelShape) -> int:
    """A rough upper bound of the activations one micro-batch keeps for backward.

    Per token, a decoder layer keeps about 6 hidden-sized tensors (norm inputs and outputs, q/k/v,
    attention output) and 4 intermediate-sized ones (MLP gate, up, activation, product) in the compute
    dtype; the logits add the vocabulary in the compute dtype plus an fp32 copy and its gradient for the
    loss. A checkpointed layer keeps only its input, and one layer at a time is recomputed in backward.
    """
    training = config.training
    tokens = training.per_device_train_batch_size * config.data.max_length
    element = shape.compute_bytes
    layer = (6 * shape.hidden + 4 * shape.intermediate) * element
    kept = shape.layers * layer
    if training.gradient_checkpointing:
        checkpointed = math.ceil(shape.layers / training.gradient_checkpointing_every)
        kept = (shape.layers - checkpointed) * layer + checkpointed * shape.hidden * element + layer
    logits = shape.vocab * (element + 8)
    return tokens * (kept + logits)


def _fit(name: str, need: int, capacity: int, what: str, breakdown: str) -> Check:
    share = need / capacity if capacity else math.inf
    detail = f"~{size(need)} of {size(capacity)} {what} ({share:.0%}): {breakdown}"
    if share > 1:
        return Check(name, FAIL, f"does not fit: {detail}", fix=FIX_MEMORY)
    if share > MEMORY_WARN_SHARE:
        return Check(name, WARN, f"tight: {detail}", fix=FIX_MEMORY)
    return Check(name, OK, detail)


def memory_checks(config: Config, env: DistributedEnv, shape: ModelShape) -> list[Check]:
    """Per device: parameters, gradients and optimizer state (as the strategy places them) plus activations;
    on the host: what the CPU holds (everything on a CPU run; offloaded state; rank 0's loaded weights)."""
    plan = shape.plan
    state = plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes
    activations = activation_bytes(config, shape)
    breakdown = (
        f"{plan.strategy} on {plural(env.world_size, 'rank')}, per rank: parameters {size(plan.param_bytes)}, "
        f"gradients {size(plan.grad_bytes)}, optimizer {size(plan.optimizer_bytes)}, activations ~{size(activations)}; "
        f"{shape.flops_per_token / 1e9:.4g} GFLOP per trained token"
    )
    local = env.local_world_size
    if env.device.type != "cuda":
        what = f"host RAM available to {plural(local, 'rank')} here"
        return [_fit("memory", (state + activations) * local, available_host_memory(), what, breakdown)]
    offload = config.parallel.cpu_offload
    capacity = torch.cuda.get_device_properties(env.device).total_memory
    rows = [_fit("memory per GPU", activations + (0 if offload else state), capacity, "GPU memory", breakdown)]
    # Global rank 0 reads the whole model into host memory before it goes to the devices.
    host = (state * local if offload else 0) + (shape.stored_bytes if env.rank == 0 else 0)
    if host:
        parts = ([f"offloaded state of {plural(local, 'rank')}"] if offload else []) + (
            ["the weights rank 0 loads"] if env.rank == 0 else []
        )
        rows.append(_fit("host memory", host, available_host_memory(), "host RAM available", " + ".join(parts)))
    return rows


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_check(config: Config, shape: ModelShape) -> list[Check]:
    """Free space where the checkpoints go, against what the run keeps there at its peak."""
    training = config.training
    adam = 8 if training.checkpoint_mode == "full" else 0
    per_checkpoint = shape.trainable * (4 + adam)  # fp32 trainable weights (+ two fp32 Adam moments)
    final = shape.trainable * 4 if config.lora.enabled else shape.total * shape.compute_bytes
    kept: int | None = None  # unknown: the number of steps depends on the dataset
    if training.save_steps is None:
        kept = 0
    else:
        if training.max_steps > 0:
            kept = math.ceil(training.max_steps / training.save_steps)
        if training.save_total_limit:
            # A new checkpoint is committed before the oldest is removed: one more than the limit, briefly.
            kept = min(kept or math.inf, training.save_total_limit + 1)
    where = existing_ancestor(Path(training.output_dir))
    free = shutil.disk_usage(where).free
    need = (kept if kept is not None else 1) * per_checkpoint + final
    detail = f"{size(free)} free at {where}; "
    if kept is None:
        detail += f"a checkpoint every {training.save_steps} steps, {size(per_checkpoint)} each, with no limit"
    else:
        detail += f"needs ~{size(need)} ({plural(kept, 'checkpoint')} of {size(per_checkpoint)}, final/ {size(final)})"
    fix = "free disk space, set training.save_total_limit, or point training.output_dir at a larger disk"
    if need > free:
        return [Check("disk", FAIL, f"too little: {detail}", fix=fix)]
    if kept is None:
        return [Check("disk", WARN, detail, fix="set training.save_total_limit to bound the checkpoints kept")]
    return [Check("disk", OK, detail)]

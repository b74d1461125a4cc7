"""``shardtune plan CONFIG``: size a run before it exists, offline: no weights, no network, no GPU.

The model comes from its ``config.json`` (a local directory, or the hub's copy in this machine's Hugging Face
cache) or from bench's shape of the hub model; it is built as training builds it on the meta device. The
strategy is training's own rule (``choose_parallelism``), the memory the estimate the doctor makes
(``shardtune.plan.memory``). Exit status: 0 when the run fits, 1 when it does not (with what to change), 2
for bad input.
"""

from __future__ import annotations

import argparse

from shardtune.config import Config, add_config_arguments, load_config
from shardtune.doctor.report import plural, size
from shardtune.errors import InputError, positive_number_problem
from shardtune.plan.memory import describe_checkpointing, micro_batch_tokens, usable_share
from shardtune.plan.run import (
    DEFAULT_GPU_MEMORY_GIB,
    GIB,
    GPU_MEMORY_GIB,
    Change,
    Cluster,
    RunPlan,
    changes_that_fit,
    check_expert_parallel,
    plan_run,
)
from shardtune.plan.shape import ModelShape, planned_model_shape

MOMENTS = {"loss": "at the loss", "backward": "in a layer's backward"}


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``shardtune`` sub-command parsers."""
    parser = commands.add_parser(
        "plan",
        help="size a run offline: strategy, memory per GPU, steps; what to change when it does not fit",
        description="Sizes a run from the model's config alone (no weights, network or GPU): the strategy "
        "training would choose, memory per GPU (weights, gradients, optimizer state, activations, loss), tokens "
        "per step and, for local data, steps per epoch. Exits 0 when the run fits, 1 when it does not, with one "
        "line per change that would make it fit.",
    )
    add_config_arguments(parser)
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the run (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=DEFAULT_GPU_MEMORY_GIB,
        help=f"GiB of one GPU as torch reports it (default {DEFAULT_GPU_MEMORY_GIB}; "
        f"{', '.join(f'{name}: {gib}' for name, gib in GPU_MEMORY_GIB.items())})",
    )
    parser.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    for option in ("nodes", "gpus_per_node", "gpu_memory_gib"):
        if problem := positive_number_problem(f"--{option.replace('_', '-')}", getattr(args, option)):
            raise InputError(problem)
    # The data need not be on this machine: the run is sized without it (steps per epoch then unknown).
    config = load_config(args.config, args.overrides, check_paths=False)
    from shardtune.cli import setup_logging

    setup_logging(is_main=False)  # transformers' and PEFT's advice would interleave with the plan
    cluster = Cluster(args.nodes, args.gpus_per_node, int(args.gpu_memory_gib * GIB))
    shape, source = planned_model_shape(config)
    check_expert_parallel(config, shape, cluster)
    run = plan_run(config, shape, cluster)
    print("\n".join(describe(run, source)))
    memory = run.memory
    usable = f"{size(run.usable)} a run may use ({usable_share(config)} of {size(cluster.gpu_memory)})"
    if run.fits:
        print(f"fits: ~{size(memory.peak)} per GPU of the {usable}")
        return 0
    print(f"does not fit: ~{size(memory.peak)} per GPU, more than the {usable}")
    single, combined = changes_that_fit(run, lambda changed: planned_model_shape(changed)[0])
    if single:
        print("any one of these fits:")
        print("\n".join(_change_line(change) for change in single))
    elif combined:
        print("no one change fits; together these do:")
        print(_change_line(combined))
    else:
        print("nothing plan tries makes it fit (more GPUs, checkpointing, a chunked loss, LoRA, offloading, context)")
    return 1


def _change_line(change: Change) -> str:
    return f"  {change.what}: ~{size(change.run.memory.peak)} per GPU"


def _count(number: float) -> str:
    """``106.9B``, ``41.9M``, ``147,968``."""
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if number >= scale:
            return f"{number / scale:.1f}{unit}"
    return f"{number:,.0f}"


def _model_line(config: Config, shape: ModelShape, source: str) -> str:
    parts = [f"{len(shape.layers)} layers", f"{_count(shape.total)} parameters"]
    moe = shape.moe_layers
    if moe:
        idle = sum(layer.expert_params * (1 - layer.top_k / layer.num_experts) for layer in moe)
        parts.append(
            f"{_count(shape.total - idle)} active a token ({moe[0].num_experts} routed experts in {len(moe)} "
            f"layers, {moe[0].top_k} a token)"
        )
    lora = config.lora
    parts.append(f"{_count(shape.trainable)} trainable ({f'LoRA r={lora.r}' if lora.enabled else 'full fine-tuning'})")
    return f"{config.model.name_or_path} ({source}): {', '.join(parts)}"


def describe(run: RunPlan, source: str) -> list[str]:
    """The plan's lines: model, cluster, strategy, batch, memory per GPU, peak, data."""
    config, cluster, memory = run.config, run.cluster, run.memory
    training, data = config.training, config.data
    global_batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * cluster.world_size
    layers = [
        describe_checkpointing(config, memory.checkpointed),
        f"layers {'compiled' if config.parallel.compiles_on('cuda') else 'eager'}",
    ]
    parts = ", ".join(f"{name} {size(value)}" for name, value in memory.parts())
    share = memory.peak / cluster.gpu_memory
    lines = [
        f"model     {_model_line(config, run.shape, source)}",
        f"cluster   {plural(cluster.nodes, 'node')} x {plural(cluster.gpus_per_node, 'GPU')} = "
        f"{plural(cluster.world_size, 'GPU')} of {size(cluster.gpu_memory)}",
        f"strategy  {run.parallel.strategy} ({run.parallel.reason})",
        f"batch     micro-batch {training.per_device_train_batch_size} x {data.max_length:,} = "
        f"{micro_batch_tokens(config):,} tokens, {plural(training.gradient_accumulation_steps, 'accumulation step')}: "
        f"{plural(global_batch, 'sequence')}, {global_batch * data.max_length:,} tokens a step; {', '.join(layers)}",
        f"memory    per GPU: {parts}",
        f"peak      ~{size(memory.peak)} per GPU, {MOMENTS[memory.moment]} ({share:.0%} of {size(cluster.gpu_memory)})",
    ]
    # Global rank 0 reads the whole model into host memory before the weights go to the GPUs.
    host = f"host      rank 0 reads the whole model into host memory first: {size(run.shape.stored_bytes)}"
    if memory.offloaded:
        offloaded = size(memory.offloaded * cluster.gpus_per_node)
        host += f"; offloaded weights, gradients and Adam state: {offloaded} a node"
    lines.append(host)
    lines.append(f"data      {_data_line(config, cluster.world_size)}")
    return lines


def _data_line(config: Config, world_size: int) -> str:
    from shardtune.plan.steps import epoch_steps, why_not_counted

    reason = why_not_counted(config)
    if reason:
        return f"steps per epoch unknown: {reason}"
    steps = epoch_steps(config, world_size)
    total = (
        f"training.max_steps {steps.total_steps:,}"
        if config.training.max_steps > 0
        else f"{steps.total_steps:,} steps in {config.training.num_train_epochs:g} epochs"
    )
    approximately = "" if steps.exact else "≤ "
    return (
        f"{approximately}{steps.sequences:,} sequences ({steps.how}): {approximately}{steps.steps_per_epoch:,} "
        f"steps an epoch; {approximately if config.training.max_steps <= 0 else ''}{total}"
    )

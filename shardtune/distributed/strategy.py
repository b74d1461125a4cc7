"""The data-parallel strategy of a run and what it places on each device: the one rule that training
(``parallelize.plan_parallelism``, on the built model), ``shardtune doctor`` and ``shardtune plan`` (on
counts from the model's config, before any weight exists) share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardtune.config import Config

if TYPE_CHECKING:
    from shardtune.plan.shape import ModelShape

GRADIENT_BYTES = 4  # fp32 gradients of the trainable (fp32 master) parameters
ADAM_STATE_BYTES = 8  # two fp32 moments per trainable parameter
# DDP keeps everything replicated; choose it only when that leaves most of the device for activations.
DDP_MEMORY_SHARE = 0.5
# ... or, where at least this share of the parameters is frozen (LoRA), wherever the memory estimate of a DDP step
# fits the GPU, recomputing what it must: FSDP gathers the frozen weights for every forward, recomputation and
# backward, where DDP reduces only the trained gradients. Measured on 2 H200s (Qwen3-30B-A3B, LoRA on attention
# and the routed experts, 2% of the weights trained, seq 4096): DDP 12,531 tokens/s per GPU recomputing every
# layer, 17,497 recomputing none; FSDP about 10,600 recomputing none (benchmarks/RESULTS.md).
FROZEN_SHARE_FOR_DDP = 0.9


@dataclass(frozen=True)
class ParallelPlan:
    strategy: str  # "single", "ddp" or "fsdp"
    reason: str
    param_bytes: int  # per device
    grad_bytes: int
    optimizer_bytes: int

    def describe(self, world_size: int) -> str:
        gib = 2**30
        return (
            f"parallelism: {self.strategy} over {world_size} rank(s) ({self.reason}); per device: "
            f"parameters {self.param_bytes / gib:.2f} GiB, gradients {self.grad_bytes / gib:.2f} GiB, "
            f"optimizer state {self.optimizer_bytes / gib:.2f} GiB"
        )


def settled_strategy(config: Config, world_size: int) -> tuple[str, str] | None:
    """The strategy and why, where the config and the world size settle it before the model is built: one rank,
    expert parallelism, or a strategy named; None where ``auto`` on several ranks weighs the model against the
    device (``choose_parallelism``)."""
    strategy = config.parallel.strategy
    if world_size == 1:
        if strategy == "fsdp" and config.parallel.cpu_offload:
            return "fsdp", "parallel.strategy with cpu_offload"
        return "single", "one rank"
    if config.parallel.expert_parallel_size > 1:
        return "fsdp", "parallel.expert_parallel_size"
    return None if strategy == "auto" else (strategy, "parallel.strategy")


def choose_parallelism(
    shape: ModelShape, config: Config, world_size: int, device_memory: int | None, compiled: bool
) -> ParallelPlan:
    """The strategy, from the config or (``auto``) from the model's size and the device's memory.

    ``shape``: the model as the run trains it; ``device_memory``: bytes of one GPU, None on CPU; ``compiled``:
    whether the decoder layers run compiled. ``auto``: DDP when replicated parameters, fp32 gradients and Adam
    state of the trainable parameters take at most half of one device's memory (the rest is for activations);
    also, where ``FROZEN_SHARE_FOR_DDP`` of the parameters are frozen, when the memory estimate of a DDP step
    (``estimate_memory``, with the checkpointing it needs) fits the memory a run may use; FSDP otherwise. On CPU,
    where there is no device memory to run out of, DDP.
    Expert parallelism (``parallel.expert_parallel_size`` > 1) always runs FSDP: the dense weights over all
    ranks, each rank's experts over the ranks holding the same ones, so each GPU still stores 1/world of every
    weight; what EP changes is what an MoE layer gathers to run (``plan/memory.py``).
    """
    param_bytes, trainable = shape.stored_bytes, shape.trainable
    grad_bytes, optimizer_bytes = trainable * GRADIENT_BYTES, trainable * ADAM_STATE_BYTES
    replicated = param_bytes + grad_bytes + optimizer_bytes
    settled = settled_strategy(config, world_size)
    if settled is not None:
        strategy, reason = settled
    elif device_memory is None:
        strategy, reason = "ddp", "auto: CPU"
    else:
        share = replicated / device_memory
        strategy = "ddp" if share <= DDP_MEMORY_SHARE else "fsdp"
        reason = f"auto: replicated state is {share:.0%} of device memory"
        frozen = 1 - trainable / max(shape.total, 1)
        if strategy == "fsdp" and frozen >= FROZEN_SHARE_FOR_DDP:
            # plan.memory imports this module: imported here, where the estimate is needed.
            from shardtune.plan.memory import estimate_memory, usable_memory

            ddp = ParallelPlan("ddp", reason, param_bytes, grad_bytes, optimizer_bytes)
            peak = estimate_memory(config, shape, ddp, compiled, device_memory).peak
            usable = usable_memory(config, device_memory)
            gib = 2**30
            if peak <= usable:
                strategy = "ddp"
                reason += (
                    f", {frozen:.0%} of the weights frozen, and a DDP step's estimated peak "
                    f"({peak / gib:.1f} GiB) fits the {usable / gib:.1f} GiB a run may use"
                )
            else:
                reason += (
                    f", and a DDP step's estimated peak ({peak / gib:.1f} GiB) is over the {usable / gib:.1f} GiB "
                    "a run may use"
                )
    if strategy == "fsdp":
        shards = world_size
        return ParallelPlan(strategy, reason, param_bytes // shards, grad_bytes // shards, optimizer_bytes // shards)
    return ParallelPlan(strategy, reason, param_bytes, grad_bytes, optimizer_bytes)

"""The doctor's estimates for this machine: memory per device for the configured strategy (the estimate
``shardtune plan`` makes, ``shardtune.plan.memory``) and the disk the checkpoints will take.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch

from shardtune.config import Config
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.strategy import choose_parallelism
from shardtune.doctor.report import FAIL, OK, WARN, Check, plural, size
from shardtune.plan.memory import USABLE_SHARE, describe_checkpointing, estimate_memory, usable_memory, usable_share
from shardtune.plan.shape import ModelShape

FIX_MEMORY = (
    "lower training.per_device_train_batch_size or data.max_length, set training.gradient_checkpointing=true, "
    "use parallel.strategy=fsdp over more ranks, or LoRA (lora.enabled=true); shardtune plan CONFIG says which fit"
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


def _fit(
    name: str, need: int, capacity: int, what: str, breakdown: str, usable: tuple[int, str] | None = None
) -> Check:
    """``need`` bytes against ``capacity``: tight above ``usable`` (bytes, and where that comes from; by default
    ``USABLE_SHARE`` of the capacity)."""
    share = need / capacity if capacity else math.inf
    detail = f"~{size(need)} of {size(capacity)} {what} ({share:.0%}): {breakdown}"
    if share > 1:
        return Check(name, FAIL, f"does not fit: {detail}", fix=FIX_MEMORY)
    limit, source = usable or (USABLE_SHARE * capacity, f"{USABLE_SHARE:.0%}")
    if need > limit:
        return Check(name, WARN, f"tight: over the {size(limit)} a run may use ({source}): {detail}", fix=FIX_MEMORY)
    return Check(name, OK, detail)


def memory_checks(config: Config, env: DistributedEnv, shape: ModelShape) -> list[Check]:
    """Per device: the peak of a training step as the strategy places it (``estimate_memory``); on the host:
    what the CPU holds (everything on a CPU run; offloaded state; rank 0's loaded weights)."""
    cuda = env.device.type == "cuda"
    capacity = torch.cuda.get_device_properties(env.device).total_memory if cuda else None
    compiled = config.parallel.compiles_on(env.device.type)
    plan = choose_parallelism(shape, config, env.world_size, capacity, compiled)
    estimate = estimate_memory(config, shape, plan, compiled, capacity)
    parts = ", ".join(f"{name} {size(value)}" for name, value in estimate.parts())
    checkpointing = describe_checkpointing(config, estimate.checkpointed)
    breakdown = (
        f"{plan.strategy} on {plural(env.world_size, 'rank')}, {checkpointing}, per rank: {parts}; "
        f"{shape.flops_per_token / 1e9:.4g} GFLOP per trained token"
    )
    local = env.local_world_size
    if not cuda:
        what = f"host RAM available to {plural(local, 'rank')} here"
        return [_fit("memory", estimate.peak * local, available_host_memory(), what, breakdown)]
    usable = (usable_memory(config, capacity), usable_share(config))
    rows = [_fit("memory per GPU", estimate.peak, capacity, "GPU memory", breakdown, usable)]
    # Global rank 0 reads the whole model into host memory before it goes to the devices.
    host = estimate.offloaded * local + (shape.stored_bytes if env.rank == 0 else 0)
    if host:
        parts = ([f"offloaded state of {plural(local, 'rank')}"] if estimate.offloaded else []) + (
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

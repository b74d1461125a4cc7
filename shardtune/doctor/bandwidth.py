"""All-reduce bandwidth across every rank, measured the way nccl-tests measures it.

Tensors live on the worker's device, so on GPUs the numbers are NCCL's over NVLink, PCIe or the
network, and on CPUs gloo's. For a message of S bytes taking t seconds per all-reduce (the slowest
rank's average), the algorithm bandwidth is S / t and the bus bandwidth is S / t * 2(n-1)/n: the
data each rank actually sends and receives in a ring all-reduce, comparable across world sizes and
with the hardware's link speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.distributed.env import DistributedEnv
from shardtune.doctor.report import FAIL, OK, Check, plural

MIB = 2**20
GPU_SIZES = (1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
# gloo on a CPU moves a few GB/s at best: smaller messages give stable numbers in a fraction of a second.
CPU_SIZES = (1 * MIB, 4 * MIB, 16 * MIB)
WARMUP = {"cuda": 5, "cpu": 2}
ITERATIONS = {"cuda": 20, "cpu": 5}


@dataclass(frozen=True)
class AllReduceTiming:
    size_bytes: int
    seconds: float  # per all-reduce, the slowest rank's mean
    world_size: int
    correct: bool  # the checked reduction summed right on every rank

    @property
    def algbw(self) -> float:
        """GB/s (10**9 bytes, as nccl-tests)."""
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.world_size - 1) / self.world_size


def _synchronize(device: torch.device) -> None:
    # NCCL calls return once queued: the clock must wait for the GPU to finish them.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(env: DistributedEnv, size_bytes: int, warmup: int, iterations: int) -> AllReduceTiming:
    """Sum a float32 tensor of ``size_bytes`` over all ranks, ``iterations`` times after ``warmup``."""
    tensor = torch.ones(size_bytes // 4, dtype=torch.float32, device=env.device)
    dist.all_reduce(tensor)
    correct = torch.tensor([float(bool((tensor == env.world_size).all()))], device=env.device)
    # Zeros for the timed runs: repeated sums of ones would grow without bound.
    tensor.zero_()
    for _ in range(warmup):
        dist.all_reduce(tensor)
    _synchronize(env.device)
    env.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    _synchronize(env.device)
    seconds = torch.tensor([(time.perf_counter() - started) / iterations], dtype=torch.float64, device=env.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(correct, op=dist.ReduceOp.MIN)
    return AllReduceTiming(size_bytes, float(seconds.item()), env.world_size, bool(correct.item()))


def bandwidth_checks(env: DistributedEnv) -> list[Check]:
    """One row per message size; a wrong sum is a FAIL (every rank gets the same rows)."""
    kind = "cuda" if env.device.type == "cuda" else "cpu"
    backend = "nccl" if kind == "cuda" else "gloo"
    sizes = GPU_SIZES if kind == "cuda" else CPU_SIZES
    note = "" if env.world_size > 1 else "; one rank: nothing crosses a link"
    rows = []
    for size in sizes:
        timing = time_all_reduce(env, size, WARMUP[kind], ITERATIONS[kind])
        name = f"all-reduce {size // MIB} MiB"
        if not timing.correct:
            rows.append(
                Check(
                    name,
                    FAIL,
                    f"wrong sums over {env.world_size} ranks ({backend})",
                    fix="rerun with network.nccl_debug=INFO and check the GPUs and links it reports",
                )
            )
            continue
        detail = (
            f"busbw {timing.busbw:.2f} GB/s, algbw {timing.algbw:.2f} GB/s, {timing.seconds * 1e3:.3f} ms "
            f"({plural(env.world_size, 'rank')}, {backend} on {kind}{note})"
        )
        rows.append(Check(name, OK, detail))
    return rows

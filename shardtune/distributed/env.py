"""The one place that knows about ranks, devices and the process group.

Every run, including a single CPU process, gets a real process group: world size 1 is simply the
smallest mesh, so the training loop's collectives (token counts, eval sums) run the same code at
every scale and are exercised by every test.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.distributed.mesh import ParallelDims
from shardtune.errors import ConfigError


@dataclass
class DistributedEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    timeout_s: float
    mesh: ParallelDims  # data- and expert-parallel dimensions: ask it which ranks share what

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that writes shared files."""
        return self.rank == 0

    @classmethod
    def from_environment(cls, timeout_s: float = 1800.0, expert_parallel_size: int = 1) -> DistributedEnv:
        """Join (or, alone, create) the process group described by torchrun-style variables. Parallel sizes
        that do not fit the world size are a ConfigError raised before the process group exists."""
        env = os.environ
        if "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1:
            # One task of a multi-task srun: Slurm names the ranks; the rendezvous address comes
            # from the job script (MASTER_ADDR / MASTER_PORT).
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise ConfigError("running as a task of srun: set MASTER_ADDR and MASTER_PORT in the job script")
            env = {
                **env,
                "RANK": env["SLURM_PROCID"],
                "WORLD_SIZE": env["SLURM_NTASKS"],
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
            }
            os.environ.update({key: env[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")})
        rank = int(env.get("RANK", 0))
        world_size = int(env.get("WORLD_SIZE", 1))
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        if "SHARDTUNE_NODE_RANK" in env and "LOCAL_RANK" in env:
            # A worker of `shardtune launch`: torch's c10d rendezvous numbers the nodes in an order of
            # its own. Renumber by --node-rank (every node runs the same number of workers), so that
            # global rank 0, which writes the run directory, is on node 0 as the user expects.
            rank = int(env["SHARDTUNE_NODE_RANK"]) * local_world_size + local_rank
            os.environ["RANK"] = str(rank)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = ParallelDims(world_size, rank, local_world_size, device_type, expert_parallel_size)
        if device_type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            # gloo next to nccl: CPU tensors (e.g. object gathers) still have a backend.
            backend = "cpu:gloo,cuda:nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            if world_size == 1 and "MASTER_ADDR" not in os.environ:
                # A lone process needs no rendezvous: an in-memory store avoids opening a port.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return cls(rank, local_rank, world_size, local_world_size, device, timeout_s, mesh)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place and return it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_floats(self, value: float) -> list[float]:
        """One float from every rank, in rank order (for per-rank throughput)."""
        local = torch.tensor([value], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return [float(t.item()) for t in gathered]

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor from every rank, stacked in rank order (world size x length) on the CPU."""
        gathered = [torch.zeros_like(row) for _ in range(self.world_size)]
        dist.all_gather(gathered, row)
        return torch.stack(gathered).cpu()

    def all_gather_objects(self, value: object) -> list:
        """A picklable value from every rank, in rank order: the one place that gathers objects.

        Alone, the value itself: no pickling round trip, and no collective for a caller that runs
        before (or without) a process group, such as a check at world size 1."""
        if self.world_size == 1:
            return [value]
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def hostnames(self) -> list[str]:
        return [str(name) for name in self.all_gather_objects(socket.gethostname())]

    def store(self) -> dist.Store:
        """The process group's key-value store (the rendezvous store): for waits without a collective."""
        return dist.distributed_c10d._get_default_store()

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

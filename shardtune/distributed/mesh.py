"""The parallel dimensions of a run and its device meshes: the one object that answers, by name, which
ranks share what (torchtitan's ``ParallelDims`` is the model).

Every rank is data-parallel: each reads its own slice of every global batch, and the dense weights are
replicated (DDP) or sharded (FSDP2) over all ranks, whose gradients are averaged over all ranks. Expert
parallelism (EP) borrows from that dimension, as in torchtitan: the ranks of one EP group hold different
routed experts (``num_experts / ep_size`` each) and exchange their tokens with all-to-all inside the MoE
block; the ranks that hold the same experts (one per EP group: the expert-data-parallel dimension,
``world / ep_size`` ranks) shard those experts with FSDP2 and reduce their gradients among themselves.

The world is laid out as ``(expert_dp, ep)`` with ``ep`` innermost: an EP group is a run of consecutive
ranks, so with at most one node's worth of GPUs it sits inside a node (NVLink), and the expert-data-parallel
groups cross nodes. World size 1 is the smallest case (EP 1, one data-parallel rank), not a path of its own.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.errors import ConfigError

log = logging.getLogger("shardtune")

EP_KEY = "parallel.expert_parallel_size"


def rank_run(count: int, rank: int, size: int) -> range:
    """The run of ``count`` experts (or their rows) that EP rank ``rank`` of ``size`` holds: its consecutive
    ``count // size``."""
    per_rank = count // size
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes and this rank's coordinates; the device meshes are built on first use (a collective: every
    rank asks for the same mesh in the same order, as parallelizing a model does)."""

    world_size: int
    rank: int
    local_world_size: int
    device_type: str = "cpu"
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        ep = self.expert_parallel_size
        if ep < 1:
            raise ConfigError(f"{EP_KEY}: must be at least 1 (got {ep})")
        if self.world_size % ep:
            raise ConfigError(
                f"{EP_KEY}: {ep} does not divide the world size {self.world_size}; choose a divisor of "
                f"{self.world_size} (the number of processes) or change --nproc/--nodes"
            )

    # -- data parallel: every rank ------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that read different data and average the dense weights' gradients: all of them."""
        return self.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's slice of every global batch and of the evaluation set."""
        return self.rank

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that writes shared files."""
        return self.rank == 0

    @property
    def node_index(self) -> int:
        """Which node this rank runs on (nodes hold consecutive ranks, the same number each)."""
        return self.rank // self.local_world_size

    @property
    def node_ranks(self) -> range:
        """The global ranks of this rank's node."""
        first = self.node_index * self.local_world_size
        return range(first, first + self.local_world_size)

    # -- expert parallel ------------------------------------------------------------------------------
    @property
    def ep_size(self) -> int:
        return self.expert_parallel_size

    @property
    def ep_enabled(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def ep_rank(self) -> int:
        """This rank's position in its EP group: it holds the ``ep_rank``-th run of ``num_experts / ep_size``."""
        return self.rank % self.expert_parallel_size

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts (one per EP group): FSDP shards the experts over them."""
        return self.world_size // self.expert_parallel_size

    def local_experts(self, num_experts: int) -> range:
        """The (global) expert ids this rank holds."""
        return rank_run(num_experts, self.ep_rank, self.expert_parallel_size)

    def check_model(self, expert_counts: list[tuple[int, int]], model_name: str) -> None:
        """EP needs an MoE model, each of whose MoE layers' routed experts (``expert_counts``: each layer's routed
        experts and how many of them are identities) split evenly over the EP group: checked by training on the built
        model, by expert parallelism as it shards the experts and by ``plan`` on the model's shape."""
        if not self.ep_enabled:
            return
        if not expert_counts:
            raise ConfigError(
                f"{EP_KEY}: {self.ep_size} needs an MoE model; {model_name} has no MoE layers; set it to 1"
            )
        for num_experts, identities in expert_counts:
            self.check_experts(num_experts, model_name, identities)

    def check_experts(self, num_experts: int, model_name: str, identities: int = 0) -> int:
        """EP needs every MoE layer's routed experts to split evenly over the EP group: its GEMM experts, and its
        ``identities`` (LongCat-Flash's zero-computation experts, whose gate_up_proj rows split as the GEMM experts'
        do) apart. Returns the number of GEMM experts."""
        gemm_experts = num_experts - identities
        size = self.expert_parallel_size
        if gemm_experts % size or identities % size:
            experts = (
                f"{gemm_experts} GEMM experts and {identities} identity experts"
                if identities
                else (f"{num_experts} routed experts")
            )
            raise ConfigError(
                f"{EP_KEY}: {size} does not divide the {experts} of {model_name}; "
                f"choose a divisor of {math.gcd(gemm_experts, identities)}"
            )
        return gemm_experts

    # -- meshes ---------------------------------------------------------------------------------------
    @functools.cached_property
    def dense_mesh(self) -> DeviceMesh:
        """All ranks (1-D, ``dp``): the mesh of every FSDP2 unit but the routed experts."""
        return init_device_mesh(self.device_type, (self.world_size,), mesh_dim_names=("dp",))

    @functools.cached_property
    def _world_mesh(self) -> DeviceMesh:
        """(expert_dp, ep), ``ep`` innermost: EP groups are runs of consecutive ranks."""
        ep = self.expert_parallel_size
        return init_device_mesh(self.device_type, (self.world_size // ep, ep), mesh_dim_names=("expert_dp", "ep"))

    @functools.cached_property
    def expert_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts as this one (1-D, ``expert_dp``): the routed experts' FSDP2 mesh."""
        return self._world_mesh["expert_dp"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """This rank's EP group: the ranks that exchange tokens in every MoE layer."""
        return self._world_mesh.get_group("ep")

    @functools.cached_property
    def expert_state_mesh(self) -> DeviceMesh:
        """The whole world as (ep, expert_dp): how a checkpoint sees an expert tensor's shards. An expert
        tensor is split over the EP group first (each EP rank's run of experts), and each run over the
        expert-data-parallel ranks (FSDP2's shards); DTensor splits over mesh dimensions in their order,
        so ``ep`` comes first here, though it is the inner dimension of the rank layout."""
        ep = self.expert_parallel_size
        layout = torch.arange(self.world_size).view(self.world_size // ep, ep).T.contiguous()
        return DeviceMesh(self.device_type, layout, mesh_dim_names=("ep", "expert_dp"))

    def describe(self) -> str:
        if not self.ep_enabled:
            return f"data parallel over {self.world_size} rank(s)"
        return (
            f"data parallel over {self.world_size} rank(s); expert parallel in groups of {self.ep_size} "
            f"consecutive ranks, experts sharded over {self.expert_dp_size} rank(s) each"
        )

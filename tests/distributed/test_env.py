"""``DistributedEnv.all_gather_objects``: the one object gather every caller uses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.mesh import ParallelDims


def test_alone_a_gather_is_the_value_itself_without_a_process_group():
    # Checks that run before (or without) a process group at world size 1 gather too.
    assert not dist.is_initialized()
    alone = DistributedEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                           timeout_s=60, mesh=ParallelDims(world_size=1, rank=0, local_world_size=1))  # fmt: skip
    value = {"host": "h", "files": [("model/a.distcp", 12)]}
    assert alone.all_gather_objects(value) == [value]
    assert alone.all_gather_objects(value)[0] is value  # no pickling round trip


def test_in_a_group_every_rank_gets_every_value_in_rank_order(world):
    assert world.all_gather_objects(("rank", world.rank)) == [("rank", 0)]

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


def test_a_worker_leaves_its_process_group_to_its_exit_and_a_lone_command_destroys_it(monkeypatch):
    """A worker ends with ``os._exit`` and its process group with it: destroying the group first let a DDP
    reducer hold its last reference, whose release in the main thread deadlocked with a gloo thread waiting
    for the GIL (a rank that ran out of memory never exited). A command that goes on in its process (tests,
    a lone ``shardtune train``) still destroys it."""
    from shardtune.launch.local import close_unless_worker

    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    env = DistributedEnv.from_environment(timeout_s=60)
    monkeypatch.setenv("RANK", "0")
    close_unless_worker(env)
    assert dist.is_initialized()
    monkeypatch.delenv("RANK")
    close_unless_worker(env)
    assert not dist.is_initialized()

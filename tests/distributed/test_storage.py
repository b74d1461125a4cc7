"""One token-store builder per storage domain, decided by real processes in a real process group."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, local_world_size: int, port: int, dirs: list[str], out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
    )
    from shardtune.distributed.env import DistributedEnv
    from shardtune.distributed.storage import is_builder

    env = DistributedEnv.from_environment(timeout_s=60)
    try:
        builder = is_builder(env, Path(dirs[rank]), timeout_s=30)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"builder": builder}))
    finally:
        env.close()


def _run(tmp_path: Path, local_world_size: int, shared: bool) -> list[bool]:
    dirs = [str(tmp_path / "cache")] * 2 if shared else [str(tmp_path / f"node{rank}") for rank in range(2)]
    mp.spawn(_worker, args=(2, local_world_size, _free_port(), dirs, str(tmp_path)), nprocs=2, join=True)
    assert not list(Path(dirs[0]).glob(".domain-*")), "the marker is removed"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text())["builder"] for rank in range(2)]


@pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo groups are exercised on Linux")
@pytest.mark.parametrize(
    ("local_world_size", "shared", "expected"),
    [
        (1, True, [True, False]),  # two nodes, one shared filesystem: global rank 0 builds
        (1, False, [True, True]),  # two nodes, node-local disks: each node's local rank 0 builds
        (2, True, [True, False]),  # one node, two workers: local rank 0 (= global rank 0) builds
    ],
)
def test_one_builder_per_storage_domain(tmp_path, local_world_size, shared, expected):
    assert _run(tmp_path, local_world_size, shared) == expected

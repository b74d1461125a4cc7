"""Which process builds a shared artifact (the token store): one per storage domain.

When the cache directory is one filesystem seen by every node, global rank 0 alone builds and all
others wait for it. When each node has its own (node-local disk), each node's local rank 0 builds a
copy. Which case holds is detected, not configured: rank 0 drops a marker file with a fresh token,
and each node's local rank 0 looks for it. The exchange goes through the rendezvous key-value store,
not a collective, so no process sits in a barrier while another tokenizes for an hour.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
from pathlib import Path

import torch.distributed as dist

from shardtune.distributed.env import DistributedEnv
from shardtune.errors import DataError

_TOKEN_KEY = "shardtune/storage-domain/token"
_CHECKED_KEY = "shardtune/storage-domain/checked"


def is_shared_with_rank0(env: DistributedEnv, directory: Path, timeout_s: float) -> bool:
    """Whether this process sees the same ``directory`` as global rank 0 (always true at world size 1)."""
    if env.world_size == 1:
        return True
    # The default group's store is the rendezvous store every rank already reached.
    store = dist.distributed_c10d._get_default_store()
    directory.mkdir(parents=True, exist_ok=True)
    nodes = max(1, env.world_size // env.local_world_size)
    if env.rank == 0:
        token = secrets.token_hex(8)
        marker = directory / f".domain-{token}"
        marker.write_text(f"{os.uname().nodename} {os.getpid()}\n")
        store.set(_TOKEN_KEY, token)
        shared = True
        # Remove the marker once every node's local rank 0 has looked (bounded wait, then leave it).
        store.add(_CHECKED_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(_CHECKED_KEY, 0) < nodes and time.monotonic() < deadline:
            time.sleep(0.05)
        marker.unlink(missing_ok=True)
        return shared
    try:
        store.wait([_TOKEN_KEY], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises its own timeout types depending on the backend
        raise DataError(
            f"rank {env.rank}: waited {timeout_s:.0f} s for global rank 0 to publish the storage-domain token "
            f"for {directory}; is rank 0 running?"
        ) from exc
    token = store.get(_TOKEN_KEY).decode()
    shared = (directory / f".domain-{token}").exists()
    if env.local_rank == 0:
        store.add(_CHECKED_KEY, 1)
    return shared


def is_builder(env: DistributedEnv, directory: Path, timeout_s: float) -> bool:
    """True for exactly one process per storage domain of ``directory``."""
    shared = is_shared_with_rank0(env, directory, timeout_s)
    return env.rank == 0 if shared else env.local_rank == 0

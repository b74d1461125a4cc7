"""Storage domains: which processes see the same directory.

When a directory (the token cache, the output directory) is one filesystem seen by every node, one
process writes shared files for all. When each node has its own (node-local disk), each node needs
its own writer: the token store is built once per node, and each node commits its own part of a
checkpoint. Which case holds is detected, not configured: rank 0 drops a marker file with a fresh
token, and every process looks for it. The exchange goes through the rendezvous key-value store, not
a collective, so no process sits in a barrier while another tokenizes for an hour.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from shardtune.distributed.env import DistributedEnv
from shardtune.errors import DataError


def is_shared_with_rank0(env: DistributedEnv, directory: Path, timeout_s: float, purpose: str) -> bool:
    """Whether this process sees the same ``directory`` as global rank 0 (always true at world size 1).

    ``purpose`` keeps the store keys of different checks (cache, output directory) apart.
    """
    if env.world_size == 1:
        return True
    # The default group's store is the rendezvous store every rank already reached.
    store = env.store()
    token_key = f"shardtune/storage-domain/{purpose}/token"
    checked_key = f"shardtune/storage-domain/{purpose}/checked"
    directory.mkdir(parents=True, exist_ok=True)
    if env.rank == 0:
        token = secrets.token_hex(8)
        marker = directory / f".domain-{token}"
        marker.write_text(f"{os.uname().nodename} {os.getpid()}\n")
        store.set(token_key, token)
        shared = True
        # Remove the marker once every process has looked (bounded wait, then leave it).
        store.add(checked_key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(checked_key, 0) < env.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        marker.unlink(missing_ok=True)
        return shared
    try:
        store.wait([token_key], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises its own timeout types depending on the backend
        raise DataError(
            f"rank {env.rank}: waited {timeout_s:.0f} s for global rank 0 to publish the storage-domain token "
            f"for {directory}; is rank 0 running?"
        ) from exc
    token = store.get(token_key).decode()
    shared = (directory / f".domain-{token}").exists()
    store.add(checked_key, 1)
    return shared


def is_builder(env: DistributedEnv, directory: Path, timeout_s: float) -> bool:
    """True for exactly one process per storage domain of ``directory``."""
    shared = is_shared_with_rank0(env, directory, timeout_s, purpose="cache")
    return env.rank == 0 if shared else env.local_rank == 0


@dataclass(frozen=True)
class StorageDomains:
    """Every rank's storage domain of one directory, as seen by this rank (a collective to build)."""

    of_rank: tuple[int, ...]  # domain index per global rank; domain 0 is global rank 0's
    rank: int

    @property
    def count(self) -> int:
        return max(self.of_rank) + 1

    @property
    def mine(self) -> int:
        return self.of_rank[self.rank]

    def ranks(self, domain: int) -> list[int]:
        return [rank for rank, of in enumerate(self.of_rank) if of == domain]

    @property
    def is_leader(self) -> bool:
        """The lowest rank of its domain: the one that writes the domain's shared files."""
        return self.ranks(self.mine)[0] == self.rank


def storage_domains(env: DistributedEnv, directory: Path, timeout_s: float, purpose: str) -> StorageDomains:
    """Group the ranks by the filesystem they see at ``directory``: everyone who shares rank 0's is in
    domain 0; a node with its own disk is a domain of its own (nodes hold contiguous ranks)."""
    shared = is_shared_with_rank0(env, directory, timeout_s, purpose)
    key = -1 if shared else env.mesh.node_index
    keys = env.all_gather_objects(key)
    numbering = {key: index for index, key in enumerate(dict.fromkeys(keys))}
    return StorageDomains(tuple(numbering[key] for key in keys), env.rank)

"""The run manifest in ``run_args.json``: what is needed to tell two runs apart or to redo one — the
config's hash, the training code's git commit, the world (ranks, hosts, devices) and library versions."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import torch

import shardtune
from shardtune.config import Config, dump_config
from shardtune.distributed.env import DistributedEnv


def config_hash(config: Config) -> str:
    """sha256 of the resolved config as written to ``config.yaml`` (the run's and each checkpoint's):
    equal hashes, equal configs."""
    return hashlib.sha256(dump_config(config).encode("utf-8")).hexdigest()


def code_version() -> dict[str, Any]:
    """The git commit of the shardtune code this process runs, and whether its tracked files differ from
    it; both null when that code is not a git checkout (an installed wheel) or git is missing."""
    root = Path(shardtune.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        # An installed copy inside some other repository (a virtualenv in a project) is not a checkout.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return {"git_commit": None, "git_dirty": None}
        return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def device_versions() -> dict[str, str | None]:
    """CUDA and NCCL as torch was built with them (null on CPU-only builds)."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        version = torch.cuda.nccl.version()
        nccl = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
    return {"cuda": torch.version.cuda, "nccl": nccl}


def describe_world(env: DistributedEnv, hostnames: list[str]) -> dict[str, Any]:
    """Ranks, hosts and devices (a collective: every rank calls it)."""
    devices = [str(name) for name in env.all_gather_objects(env.device_name())]
    return {
        "world_size": env.world_size,
        "nodes": len(dict.fromkeys(hostnames)),
        "hostnames": hostnames,
        "devices": devices,
    }

"""Runs of ``shardtune`` on the quickstart config with faults injected through ``SHARDTUNE_FAULT`` (real
signals, real write errors, real hangs), and readers for what such a run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import REPO

BASE = [
    "training.logging_steps=1", "training.per_device_train_batch_size=2", "training.eval_on_start=false",
    "training.eval_steps=null", "lora.lora_dropout=0", "training.checkpoint_mode=full",
]  # fmt: skip


@dataclass
class Run:
    returncode: int
    log: str  # stdout and stderr of the launcher and its workers
    seconds: float


def worker_env(fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDTUNE_FAULT", None)
    if fault:
        env["SHARDTUNE_FAULT"] = fault
    return env


def command(tmp_path: Path, out: Path, nproc: int, *overrides: str, max_restarts: int | None = None) -> list[str]:
    """``shardtune train`` (or, with ``max_restarts``, ``shardtune launch`` on one node, which restarts)."""
    settings = [f"training.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", *BASE, *overrides]
    shardtune = [sys.executable, "-m", "shardtune"]
    if max_restarts is None:
        return [*shardtune, "train", "examples/quickstart.yaml", "--nproc", str(nproc), *settings]
    return [
        *shardtune, "launch", "examples/quickstart.yaml", "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), *settings,
    ]  # fmt: skip


def run(
    tmp_path: Path,
    out: Path,
    nproc: int,
    *overrides: str,
    fault: str | None = None,
    max_restarts: int | None = None,
    timeout: float = 300,
) -> Run:
    started = time.monotonic()
    result = subprocess.run(
        command(tmp_path, out, nproc, *overrides, max_restarts=max_restarts),
        cwd=REPO, env=worker_env(fault), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )  # fmt: skip
    return Run(result.returncode, result.stdout, time.monotonic() - started)


def train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs/train_log.jsonl").read_text().splitlines()]


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trainable weights a checkpoint holds, read from its DCP shards without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "model.pt"
        dcp_to_torch_save(checkpoint / "model", target)
        return torch.load(target, weights_only=True)


def final_adapter(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "adapter_model.safetensors")


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def assert_intact(checkpoint: Path) -> None:
    """Committed and whole: a manifest, and every file it lists present at the size it lists."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for entries in manifest["files"].values():
        for entry in entries:
            assert (checkpoint / entry["path"]).stat().st_size == entry["bytes"], entry

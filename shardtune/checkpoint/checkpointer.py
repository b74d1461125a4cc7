"""Sharded checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own shard, in
parallel, with no gather to rank 0; a checkpoint gets its final name only once it is complete.

Layout of ``checkpoint-<step>/``:
- ``model/``: DCP shards of the trainable parameters (LoRA adapters, or every weight), keyed by
  parameter name, so any world size and strategy can load them (DCP reshards on load).
- ``optimizer/`` (``full`` mode): DCP shards of the optimizer state, keyed the same way.
- ``rng/rank-<r>.pt`` (``full`` mode): each rank's random generator states.
- ``trainer.json``: step, sampler cursor, scheduler state.
- ``manifest.json``: step, mode, world size, strategy, config hash, hosts, and every file with its size
  and the rank (and host) that wrote it; written last, just before the rename that commits.
- ``config.yaml`` and the tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardtune.config import Config, dump_config
from shardtune.distributed.env import DistributedEnv
from shardtune.errors import ConfigError

log = logging.getLogger("shardtune")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading sets only the trainable parameters; the frozen ones come from the base model. Every
# trainable key is still required: dcp.load fails on any key the checkpoint lacks.
SET_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def config_hash(config: Config) -> str:
    return hashlib.sha256(dump_config(config).encode()).hexdigest()[:16]


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first (only a committed one has the name and a manifest)."""
    found = []
    for entry in output_dir.glob("checkpoint-*"):
        match = CHECKPOINT_PATTERN.match(entry.name)
        if match and (entry / "manifest.json").is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def resolve_resume(config: Config) -> Path | None:
    """``resume_from_checkpoint``: ``auto`` (newest complete in output_dir, if any), a path, or none."""
    setting = config.training.resume_from_checkpoint
    if setting is None:
        return None
    output_dir = Path(config.training.output_dir)
    if setting == "auto":
        found = complete_checkpoints(output_dir) if output_dir.is_dir() else []
        if not found:
            log.info("resume_from_checkpoint: auto found no complete checkpoint in %s; starting fresh", output_dir)
            return None
        return found[-1]
    path = Path(setting)
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"training.resume_from_checkpoint: {path} is not a complete checkpoint (no manifest.json)")
    return path


class Checkpointer:
    """Saves and loads every stateful piece of a run; built once with all of them."""

    def __init__(
        self,
        config: Config,
        env: DistributedEnv,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        sampler: Any,
        tokenizer: Any,
        strategy: str,
    ):
        self.config, self.env = config, env
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.tokenizer, self.strategy = tokenizer, strategy
        self.output_dir = Path(config.training.output_dir)
        self.mode = config.training.checkpoint_mode

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        started = time.perf_counter()
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f".checkpoint-{step}.tmp"
        if self.env.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.env.barrier()
        # Each rank writes the shards it owns; DCP exchanges only the (small) save plan.
        dcp.save(get_model_state_dict(self.model, options=TRAINABLE_ONLY), checkpoint_id=staging / "model")
        if self.mode == "full":
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=TRAINABLE_ONLY)
            dcp.save(optimizer_state, checkpoint_id=staging / "optimizer")
            (staging / "rng").mkdir(exist_ok=True)
            torch.save(_rng_state(), staging / "rng" / f"rank-{self.env.rank}.pt")
        # Each rank lists its files only after writing them, so once rank 0 holds every list, every
        # rank's shards are on disk and the checkpoint may be committed: the gather is the barrier.
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, self._files_written(staging))
        if self.env.is_main:
            self._write_trainer_state(staging, step)
            self.tokenizer.save_pretrained(staging)
            (staging / "config.yaml").write_text(dump_config(self.config))
            manifest = {
                "step": step,
                "mode": self.mode,
                "world_size": self.env.world_size,
                "strategy": self.strategy,
                "config_hash": config_hash(self.config),
                "files": {str(rank): entries for rank, entries in enumerate(gathered)},
            }
            _write_synced(staging / "manifest.json", json.dumps(manifest, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)  # the commit
            self._rotate()
        self.env.barrier()
        log.info("saved %s checkpoint %s in %.2f s", self.mode, final, time.perf_counter() - started)
        return final

    def _files_written(self, staging: Path) -> list[dict[str, Any]]:
        """The files under ``staging`` this rank wrote (DCP names shard files by rank)."""
        host = socket.gethostname()
        rank = self.env.rank
        entries = []
        for path in sorted(staging.rglob("*")):
            name = path.name
            mine = f"__{rank}_" in name or name == f"rank-{rank}.pt" or (rank == 0 and name == ".metadata")
            if path.is_file() and mine:
                entries.append({"path": str(path.relative_to(staging)), "bytes": path.stat().st_size, "host": host})
        return entries

    def _write_trainer_state(self, staging: Path, step: int) -> None:
        state = {"step": step, "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict()}
        _write_synced(staging / "trainer.json", json.dumps(state, indent=2) + "\n")

    def _rotate(self) -> None:
        limit = self.config.training.save_total_limit
        if not limit:
            return
        checkpoints = complete_checkpoints(self.output_dir)
        # The newest complete checkpoint is always kept: only older ones beyond the limit go.
        for old in checkpoints[: max(0, len(checkpoints) - limit)]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed %s (save_total_limit=%d)", old, limit)

    def remove_partial(self) -> None:
        """Checkpoints a crash left half-written are never loaded; clear them at start."""
        if self.env.is_main and self.output_dir.is_dir():
            for partial in self.output_dir.glob(".checkpoint-*.tmp"):
                shutil.rmtree(partial, ignore_errors=True)
                log.info("removed %s, left by an interrupted save", partial)

    # -- loading -----------------------------------------------------------------------------------
    def load(self, path: Path) -> int:
        """Restore what ``path`` holds; returns the step to continue after."""
        manifest = json.loads((path / "manifest.json").read_text())
        self._check_files(path, manifest)
        model_state = get_model_state_dict(self.model, options=TRAINABLE_ONLY)
        dcp.load(model_state, checkpoint_id=path / "model")
        set_model_state_dict(self.model, model_state, options=SET_TRAINABLE)
        trainer = json.loads((path / "trainer.json").read_text())
        self.sampler.load_state_dict(trainer["sampler"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        if manifest["mode"] == "full":
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=TRAINABLE_ONLY)
            dcp.load(optimizer_state, checkpoint_id=path / "optimizer")
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=TRAINABLE_ONLY)
            rng_file = path / "rng" / f"rank-{self.env.rank}.pt"
            if manifest["world_size"] == self.env.world_size and rng_file.is_file():
                _set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.warning("resuming from lite checkpoint %s: weights only, the optimizer state starts fresh", path)
        log.info(
            "resumed from %s (step %d, saved by %d rank(s) with %s, now %d rank(s))",
            path, manifest["step"], manifest["world_size"], manifest["strategy"], self.env.world_size,
        )  # fmt: skip
        return int(manifest["step"])

    def _check_files(self, path: Path, manifest: dict[str, Any]) -> None:
        missing = [
            f"{entry['path']} (written by rank {rank} on {entry['host']})"
            for rank, entries in manifest["files"].items()
            for entry in entries
            if not (path / entry["path"]).is_file()
        ]
        if missing:
            raise ConfigError(
                f"training.resume_from_checkpoint: {path} lacks {len(missing)} file(s) here: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

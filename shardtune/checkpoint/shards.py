"""Reading and writing a checkpoint's DCP shards on shared or node-local storage.

On storage every rank sees, ``model/`` (and ``optimizer/``) is one DCP checkpoint. On node-local
storage each node can only hold what its own ranks wrote, so each node saves its own DCP checkpoint,
coordinated among its ranks only, under ``model/node-<k>/``: its ranks' shards of sharded tensors, and
a full copy of every replicated tensor (so a node can reload its own ranks without the others). The
reader merges whichever ``node-*`` parts are present, so the same code loads a checkpoint from its
nodes, or from one directory where every node's copy was gathered; and before anything is read, each
rank checks that the shards it needs are here, and names the ones that are not and where they were
written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from collections import ChainMap
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan
from torch.distributed.tensor import DTensor

from shardtune.checkpoint.layout import checkpoint_step, complete_checkpoints
from shardtune.errors import first_line

METADATA_FILE = ".metadata"
# What a damaged checkpoint leaves a training run to do (``export`` and ``eval``: ``UseEarlier``).
RESUME_EARLIER = "resume from an earlier checkpoint"
# How many of a run's earlier checkpoints ``UseEarlier`` names.
EARLIER_NAMED = 3


class NodeSavePlanner(DefaultSavePlanner):
    """The default planner, for a save coordinated among one node's ranks.

    Its global plan covers only that node's shards of a sharded tensor, by design; DCP's check that
    the chunks of every tensor cover it whole would reject that, so it is left out here. Whether a
    resume has every chunk it needs is checked at load time (``missing_shards``).
    """

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            mappings = dict(ChainMap(*[plan.planner_data for plan in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=mappings)
        return global_plan, metadata


class ShardsReader(FileSystemReader):
    """Reads one DCP checkpoint, or the merge of the per-node checkpoints present under ``path``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root = Path(self.path)
        if (root / METADATA_FILE).is_file():
            return super().read_metadata(*args, **kwargs)
        parts = sorted(part for part in root.glob("node-*") if (part / METADATA_FILE).is_file())
        if not parts:
            raise FileNotFoundError(f"{root}: no {METADATA_FILE}, and no node-*/{METADATA_FILE} of a node-local save")
        merged: Metadata | None = None
        for part in parts:
            with open(part / METADATA_FILE, "rb") as handle:
                metadata: Metadata = pickle.load(handle)
            storage = {
                index: dataclasses.replace(info, relative_path=f"{part.name}/{info.relative_path}")
                for index, info in metadata.storage_data.items()
            }
            metadata = dataclasses.replace(metadata, storage_data=storage)
            merged = metadata if merged is None else _merge(merged, metadata)
        assert merged is not None
        return merged


def _merge(into: Metadata, other: Metadata) -> Metadata:
    """Union of two nodes' metadata; a replicated tensor's copy is taken from the first node."""
    tensors = dict(into.state_dict_metadata)
    for fqn, entry in other.state_dict_metadata.items():
        known = tensors.get(fqn)
        if known is None:
            tensors[fqn] = entry
        elif isinstance(known, TensorStorageMetadata) and isinstance(entry, TensorStorageMetadata):
            seen = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in known.chunks}
            extra = [chunk for chunk in entry.chunks if (tuple(chunk.offsets), tuple(chunk.sizes)) not in seen]
            tensors[fqn] = dataclasses.replace(known, chunks=[*known.chunks, *extra])
    storage = {**other.storage_data, **into.storage_data}
    planner_data = {**(other.planner_data or {}), **(into.planner_data or {})}
    return dataclasses.replace(into, state_dict_metadata=tensors, storage_data=storage, planner_data=planner_data)


class ShardMismatch(ValueError):
    """The checkpoint's tensors cannot be this run's: another shape, names it does not hold, or metadata
    that does not read."""


class UseEarlier:
    """What a damaged checkpoint leaves ``export`` and ``eval`` to do: use an earlier checkpoint of its run, named
    (newest first) where it is a run's ``checkpoint-<step>`` among earlier ones that read whole. An error line's
    ``instead``, worded only when the line is: that reads the run's other checkpoints."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        step = checkpoint_step(self.checkpoint)
        if step is None:  # renamed or copied out of its run: which checkpoints the run holds is not known here
            return "use an earlier checkpoint of its run"
        run = self.checkpoint.parent
        earlier = [path for path in reversed(complete_checkpoints(run)) if checkpoint_step(path) < step]
        # Only whether each reads whole: its own advice is never said.
        whole = [path for path in earlier if not checkpoint_damage(path, instead="")]
        if not whole:
            return f"use an earlier checkpoint of its run ({run} holds none that reads whole)"
        more = f" (and {len(whole) - EARLIER_NAMED} older)" if len(whole) > EARLIER_NAMED else ""
        return f"use an earlier checkpoint of its run: {', '.join(map(str, whole[:EARLIER_NAMED]))}{more}"


def checkpoint_damage(checkpoint: Path, instead: str | UseEarlier) -> list[str]:
    """Why a complete checkpoint's weights do not read whole, found from its files before any model is built:
    ``model/``'s files whose size differs from the manifest's (cut short), or its DCP metadata missing or not
    reading; empty when neither. ``instead``: what else the user may do."""
    problems = resized_files(checkpoint, json.loads((checkpoint / "manifest.json").read_text()), instead, "model")
    if not problems:  # a .metadata cut short is named above, with the host that wrote it
        try:
            read_shard_metadata(ShardsReader(checkpoint / "model"), instead)
        except ShardMismatch as damage:
            problems.append(str(damage))
    return problems


def read_shard_metadata(reader: ShardsReader, instead: str | UseEarlier = RESUME_EARLIER) -> Metadata:
    """The DCP metadata ``reader`` plans with; ``ShardMismatch`` naming the directory where it is missing or does not
    read (the checkpoint is incomplete or damaged), saying ``instead``: what the user may do."""
    try:
        return reader.read_metadata()
    except FileNotFoundError as error:
        raise ShardMismatch(f"{error}: the checkpoint is incomplete; {instead}") from None
    except Exception as error:  # a damaged .metadata: pickle's errors are of many kinds
        raise ShardMismatch(
            f"{reader.path}: its DCP metadata does not read ({first_line(error)}): the checkpoint is damaged; {instead}"
        ) from None


def missing_shards(
    state_dict: dict[str, Any], reader: ShardsReader, instead: str | UseEarlier = RESUME_EARLIER
) -> tuple[list[str], list[str]]:
    """What this rank cannot load from here: (tensors with chunks no present shard holds, shard files
    the metadata names that do not exist), both empty when the load can go ahead. Raises ``ShardMismatch``
    when the checkpoint holds other tensors than ``state_dict`` (a run with another model or adapter), or its
    metadata is missing or does not read (``instead``: what the user may do then)."""
    metadata = read_shard_metadata(reader, instead)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator=False)
    _check_shapes(planner.state_dict, metadata)
    try:
        plan = planner.create_local_plan()
    except (RuntimeError, ValueError) as error:  # DCP's planner: a key the checkpoint lacks, or another size
        raise ShardMismatch(f"{first_line(error)}{ANOTHER_CONFIG}") from None
    read: dict[str, int] = {}
    needed_files: set[str] = set()
    for item in plan.items:
        volume = math.prod(item.lengths) if item.type != LoadItemType.BYTE_IO else 0
        read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + volume
        needed_files.add(metadata.storage_data[item.storage_index].relative_path)
    uncovered = []
    for fqn, value in planner.state_dict.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            if read.get(fqn, 0) < local.numel():
                uncovered.append(fqn)
    absent = sorted(name for name in needed_files if not (Path(reader.path) / name).is_file())
    return uncovered, absent


ANOTHER_CONFIG = (
    ": the checkpoint was saved by a run with another model or adapter config (e.g. lora.r, lora.target_modules); "
    "resume with the config it was saved with (its config.yaml), or start a new run in another training.output_dir"
)


def _check_shapes(state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Every tensor this run would load has the shape the checkpoint saved it with."""
    differing = []
    for fqn, value in state_dict.items():
        saved = metadata.state_dict_metadata.get(fqn)
        tensors = isinstance(value, torch.Tensor) and isinstance(saved, TensorStorageMetadata)
        if tensors and tuple(saved.size) != tuple(value.shape):
            differing.append(f"{fqn} saved as {list(saved.size)}, here {list(value.shape)}")
    if differing:
        more = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
        raise ShardMismatch(f"{len(differing)} tensor(s) differ in shape: {differing[0]}{more}{ANOTHER_CONFIG}")


def resized_files(
    checkpoint: Path, manifest: dict[str, Any], instead: str | UseEarlier = RESUME_EARLIER, kind: str | None = None
) -> list[str]:
    """The files the manifest lists whose size here differs from the size recorded when they were written
    (a truncated copy, a disk that lost its tail): each named with the rank and host that wrote it. Read
    before anything is loaded; a file absent here is ``missing_shards``' concern. ``instead``: what else the
    user may do, after copying the file again; ``kind``: only the files of that part (``model``: what ``export``
    and ``eval`` read, whose use a damaged optimizer state does not stop)."""
    problems = []
    for rank, entries in manifest["files"].items():
        for entry in entries:
            if kind is not None and not entry["path"].startswith(f"{kind}/"):
                continue
            file = checkpoint / entry["path"]
            if file.is_file() and (size := file.stat().st_size) != entry["bytes"]:
                problems.append(
                    f"{file} is {size:,} bytes, but the manifest records {entry['bytes']:,} as written by rank {rank} "
                    f"on {entry['host']}: it was truncated or changed after the save; copy it again from "
                    f"{entry['host']}, or {instead}"
                )
    return problems


def unreadable_shards(
    checkpoint: Path, kind: str, error: BaseException, instead: str | UseEarlier = RESUME_EARLIER
) -> str:
    """One line for a DCP load that failed on some rank (a shard whose content is damaged); ``instead``: what the
    user may do."""
    # The causes' own words are about unpickling and tensor formats; the kind of error and where suffice.
    failures = getattr(error, "failures", None) or {0: (error, None)}
    ranks: dict[str, list[str]] = {}
    for rank, (failure, _) in sorted(failures.items()):
        ranks.setdefault(type(failure).__name__, []).append(str(rank))
    cause = ", ".join(f"{name} on rank {', '.join(found)}" for name, found in ranks.items())
    return f"{checkpoint / kind}: the shards do not read back ({cause}): the checkpoint is damaged; {instead}"


def merge_rank_problems(problems: list[list[str]]) -> list[str]:
    """Each rank's problems (index = rank) as one list: a problem every rank found once, plain; one found by
    some ranks, prefixed by them."""
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(problems):
        for problem in found:
            ranks.setdefault(problem, []).append(rank)
    return [
        problem
        if len(found) == len(problems)
        else f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}: {problem}"
        for problem, found in ranks.items()
    ]

"""Sharded checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own shard, in
parallel, with no gather to rank 0; a checkpoint gets its final name only once it is complete.

Layout of ``checkpoint-<step>/``:
- ``model/``: DCP shards of the trainable parameters (LoRA adapters, or every weight), keyed by
  parameter name, so any world size and strategy can load them (DCP reshards on load). On node-local
  storage, one DCP checkpoint per node in ``model/node-<k>/`` (see ``shards.py``).
- ``optimizer/`` (``full`` mode): DCP shards of the optimizer state, keyed the same way.
- ``rng/rank-<r>.pt`` (``full`` mode): each rank's random generator states.
- ``trainer.json``: step, sampler cursor, scheduler state, and the run's totals so far (tokens per
  rank, train and wall time, first eval loss), so ``metrics.json`` after a resume counts the whole run.
- ``manifest.json``: step, mode, world size, strategy, config hash, storage (shared or node-local,
  with each node's host and ranks), and every file with its size and the rank and host that wrote
  it; written last, just before the rename that commits.
- ``config.yaml`` and the tokenizer files.

On node-local storage every node commits its own copy of the small files and its own shards; a
resume uses the newest checkpoint that every node committed.

A save either commits on every node or nowhere: each of its stages ends in a gather through which
every rank learns of any rank's write error (a full disk, a lost mount), and then all raise the same
``CheckpointSaveError`` together instead of leaving the others waiting in a collective. A rank that
dies mid-save leaves only a ``.checkpoint-<step>.tmp`` directory, which no resume reads.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardtune.atomic import replace_path, write_atomic
from shardtune.checkpoint.layout import (
    checkpoint_step,
    complete_checkpoints,
    lies_in,
    not_a_checkpoint,
    read_step,
    resume_conflicts,
)
from shardtune.checkpoint.names import without_wrappers
from shardtune.checkpoint.shards import (
    METADATA_FILE,
    RESUME_EARLIER,
    NodeSavePlanner,
    ShardMismatch,
    ShardsReader,
    UseEarlier,
    merge_rank_problems,
    missing_shards,
    resized_files,
    unreadable_shards,
)
from shardtune.config import Config, dump_config, load_config
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.expert_parallel import expert_state_names, expert_state_views
from shardtune.distributed.mesh import ParallelDims
from shardtune.distributed.storage import StorageDomains
from shardtune.errors import CheckpointSaveError, ConfigError, InputError, first_line
from shardtune.faults import fault_point
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO
from shardtune.run_dir import finished_run_outputs, nothing_to_resume_line
from shardtune.run_manifest import config_hash

log = logging.getLogger("shardtune")

TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading sets only the trainable parameters; the frozen ones come from the base model. Every
# trainable key is still required: dcp.load fails on any key the checkpoint lacks.
SET_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The trainable parameters' state (sharded as the model is), keyed by parameter name: what a lite
    checkpoint holds, and what a load or an export reads. DCP's ``ignore_frozen_params`` drops only the
    names ``named_parameters()`` reports, which skips the second name of a shared tensor: the frozen
    ``lm_head.weight`` of a model with tied embeddings would stay. Every name of a frozen tensor goes here."""
    state = get_model_state_dict(model, options=TRAINABLE_ONLY)
    frozen = {
        without_wrappers(name)
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if not parameter.requires_grad
    }
    return {name: value for name, value in state.items() if without_wrappers(name) not in frozen}


def checkpoint_model_state(model: torch.nn.Module, dims: ParallelDims) -> dict[str, Any]:
    """``trainable_state_dict`` as a checkpoint holds it: every routed-expert tensor a view of the whole
    layer's (``expert_state_views``), so a checkpoint loads into any expert-parallel size and world size."""
    return expert_state_views(trainable_state_dict(model), expert_state_names(model), dims)


def checkpoint_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the optimizer's state dict, the same as a checkpoint holds it: routed-expert moments viewed whole)."""
    state = get_optimizer_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    viewed = {**state, "state": expert_state_views(state["state"], expert_state_names(model), dims)}
    return state, viewed


@dataclass
class RunTotals:
    """What ``metrics.json`` sums over a run's segments (each resume starts one): saved in every
    checkpoint's ``trainer.json``."""

    tokens_per_rank: list[int] = field(default_factory=list)
    train_time_s: float = 0.0
    wall_time_s: float = 0.0
    first_eval_loss: float | None = None

    def plus(self, later: RunTotals) -> RunTotals:
        """This segment followed by ``later``; per-rank counts add up rank by rank (the world size may change)."""
        tokens = [
            (self.tokens_per_rank[rank] if rank < len(self.tokens_per_rank) else 0)
            + (later.tokens_per_rank[rank] if rank < len(later.tokens_per_rank) else 0)
            for rank in range(max(len(self.tokens_per_rank), len(later.tokens_per_rank)))
        ]
        return RunTotals(
            tokens_per_rank=tokens,
            train_time_s=self.train_time_s + later.train_time_s,
            wall_time_s=self.wall_time_s + later.wall_time_s,
            first_eval_loss=self.first_eval_loss if self.first_eval_loss is not None else later.first_eval_loss,
        )


@dataclass
class ResumePoint:
    path: Path
    step: int


def find_resume_checkpoint(config: Config, env: DistributedEnv, otherwise: str | None = None) -> ResumePoint | None:
    """The checkpoint ``training.resume_from_checkpoint`` names: ``auto`` (the newest complete on every
    node; where there is none, ``otherwise``, or none), a path, or none. A collective (every rank gets the same
    answer), made before anything is written or loaded. A checkpoint saved with a config that made other weights,
    another adapter or other data is refused here, naming each key that differs."""
    setting = config.training.resume_from_checkpoint
    output_dir = Path(config.training.output_dir)
    if setting == "auto":
        newest = _newest_everywhere(config, env)
        if newest is not None:
            return _resume_point(config, newest)
        log.info(
            "resume_from_checkpoint: auto found no checkpoint complete on every node in %s; %s",
            output_dir, f"starting from {otherwise}" if otherwise else "starting fresh",
        )  # fmt: skip
        setting = otherwise
    if setting is None:
        return None
    path = Path(setting)
    present = env.all_gather_objects(
        (socket.gethostname(), not_a_checkpoint(path), _later_checkpoints(path, output_dir))
    )
    lacking = {host: problem for host, problem, _ in present if problem}
    later = sorted({step for _, _, steps in present for step in steps})
    line = None
    if lacking:
        problem = next(iter(lacking.values()))
        where = f" on {', '.join(sorted(lacking))}" if env.world_size > 1 else ""
        line = f"training.resume_from_checkpoint: {path} {problem}{where}"
    elif later:
        # Its steps would be redone next to the later run's checkpoints: rotation and a later ``auto`` would
        # mix the two, and each save of a step the later run saved too would replace its checkpoint.
        names = ", ".join(f"checkpoint-{step}" for step in later)
        line = (
            f"training.resume_from_checkpoint: {path} is older than {names} in {output_dir}, saved by the run "
            f"that went on from it; resume from checkpoint-{later[-1]}, or from {path} into another output_dir"
        )
    if line:
        raise ConfigError(line if env.is_main else [])  # every rank exits 2; rank 0 says why, once
    return _resume_point(config, path)


def _newest_everywhere(config: Config, env: DistributedEnv) -> Path | None:
    """``auto``'s checkpoint: the newest complete on every node, or None. A collective."""
    output_dir = Path(config.training.output_dir)
    local = [checkpoint_step(path) for path in complete_checkpoints(output_dir)]
    seen = env.all_gather_objects((local, finished_run_outputs(output_dir)))
    everywhere = [steps for steps, _ in seen]
    common = set(everywhere[0]).intersection(*everywhere[1:])
    finished = sorted({name for _, names in seen for name in names})
    if not common and finished and not config.training.overwrite_output_dir:
        # On every node (the output directory's own check, in claim_output_dir, sees one disk's checkpoints).
        raise ConfigError(nothing_to_resume_line(output_dir, finished) if env.is_main else [])
    if not common:
        return None
    newest_anywhere = max(max(steps, default=0) for steps in everywhere)
    if newest_anywhere > max(common):
        log.warning(
            "resume_from_checkpoint: checkpoint-%d is not complete on every node; using checkpoint-%d",
            newest_anywhere, max(common), extra=SAID_BY_RANK_ZERO,
        )  # fmt: skip
    return output_dir / f"checkpoint-{max(common)}"


def _resume_point(config: Config, path: Path) -> ResumePoint:
    """``path``, once its config is known to have made the same weights, adapter and data as this one."""
    saved = load_config(path / "config.yaml", check_paths=False)
    conflicts = resume_conflicts(saved.to_dict(), config.to_dict())
    if conflicts:
        raise ConfigError(
            f"training.resume_from_checkpoint: {path} was saved with another model, adapter or data: "
            + "; ".join(conflicts)
            + ". Resume with the checkpoint's values (its config.yaml), or start a new run in another output_dir"
        )  # fmt: skip
    return ResumePoint(path, read_step(path))


def _later_checkpoints(path: Path, output_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``output_dir`` after ``path``'s, where ``path`` is one of them."""
    step = checkpoint_step(path)
    if step is None or not lies_in(path, output_dir):
        return []
    return [later for later in map(checkpoint_step, complete_checkpoints(output_dir)) if later > step]


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
        domains: StorageDomains,
    ):
        self.config, self.env = config, env
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.tokenizer, self.strategy = tokenizer, strategy
        # The totals of the segments before this one (set by load), and a callable giving this rank's
        # totals of this segment so far (set by the training loop once it counts them).
        self.earlier_totals = RunTotals()
        self.segment_totals: Callable[[], RunTotals] = RunTotals
        self.output_dir = Path(config.training.output_dir)
        self.mode = config.training.checkpoint_mode
        self.domains = domains  # the output directory's, as the run found them when it took the directory
        self.node_local = self.domains.count > 1
        # On node-local storage each node's ranks save as a group of their own. Every rank creates
        # every group, in the same order, as torch.distributed requires.
        self.domain_group = None
        if self.node_local:
            for domain in range(self.domains.count):
                group = dist.new_group(self.domains.ranks(domain))
                if domain == self.domains.mine:
                    self.domain_group = group

    def _shards(self, checkpoint: Path, kind: str) -> Path:
        """Where this rank's ``model`` or ``optimizer`` shards go."""
        return checkpoint / kind / f"node-{self.domains.mine}" if self.node_local else checkpoint / kind

    def _save_shards(self, state: dict[str, Any], directory: Path) -> None:
        planner = NodeSavePlanner() if self.node_local else None
        dcp.save(state, checkpoint_id=directory, process_group=self.domain_group, planner=planner)

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, mode: str | None = None) -> Path:
        """Save ``step`` in ``mode`` (default: the configured ``checkpoint_mode``); a collective.
        Raises ``CheckpointSaveError`` on every rank when any rank could not write its part."""
        mode = mode or self.mode
        started = time.perf_counter()
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f".checkpoint-{step}.tmp"
        fault_point("save.begin", step)
        failures = []
        if self.domains.is_leader:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            except OSError as error:
                failures = self._describe_failure(error)
        self._agree(step, staging, failures, "creating the checkpoint directory")  # also the barrier
        files, failures = [], []
        try:
            fault_point("save.shards", step)
            # Each rank writes the shards it owns; DCP exchanges only the (small) save plan.
            self._save_shards(checkpoint_model_state(self.model, self.env.mesh), self._shards(staging, "model"))
            if mode == "full":
                _, optimizer_state = checkpoint_optimizer_state(self.model, self.optimizer, self.env.mesh)
                self._save_shards(optimizer_state, self._shards(staging, "optimizer"))
                (staging / "rng").mkdir(exist_ok=True)
                torch.save(_rng_state(), staging / "rng" / f"rank-{self.env.rank}.pt")
            fault_point("save.written", step)
            files = self._files_written(staging)
        except (Exception, CheckpointException) as error:  # DCP's exception is a BaseException
            failures = self._describe_failure(error)
        # Each rank lists its files only after writing them, so once rank 0 holds every list, every
        # rank's shards are on disk and the checkpoint may be committed: the gather is the barrier.
        gathered = self.env.all_gather_objects((files, failures, asdict(self.segment_totals())))
        self._raise_if_any(step, staging, [failure for _, found, _ in gathered for failure in found], "writing shards")
        # Rank 0 composes the small files; every node's leader writes them on its own storage.
        small_files: list[Any] = [
            self._small_files(step, mode, [files for files, _, _ in gathered], [totals for _, _, totals in gathered])
            if self.env.is_main
            else None
        ]
        if self.node_local:
            dist.broadcast_object_list(small_files, src=0)
        failures = []
        if self.domains.is_leader:
            try:
                for name, text in small_files[0].items():
                    write_atomic(staging / name, text, durable=True)
                self.tokenizer.save_pretrained(staging)
                replace_path(staging, final)  # the commit
                self._rotate(step)
            except Exception as error:
                failures = self._describe_failure(error)
        self._agree(step, staging, failures, "committing")
        log.info("saved %s checkpoint %s in %.2f s", mode, final, time.perf_counter() - started)
        return final

    def _describe_failure(self, error: BaseException) -> list[str]:
        """One line per failed rank: DCP reports every rank's failure of its save to every rank."""
        if isinstance(error, CheckpointException):
            group_ranks = self.domains.ranks(self.domains.mine) if self.node_local else None
            return [
                f"rank {group_ranks[rank] if group_ranks else rank}: {type(failure).__name__}: {failure}"
                for rank, (failure, _) in sorted(error.failures.items())
            ]
        return [f"rank {self.env.rank} on {socket.gethostname()}: {type(error).__name__}: {error}"]

    def _agree(self, step: int, staging: Path, failures: list[str], stage: str) -> None:
        """Every rank learns of every rank's failures of this stage; all raise together if there are any."""
        gathered = self.env.all_gather_objects(failures)
        self._raise_if_any(step, staging, [failure for found in gathered for failure in found], stage)

    def _raise_if_any(self, step: int, staging: Path, failures: list[str], stage: str) -> None:
        if not failures:
            return
        if self.domains.is_leader:
            shutil.rmtree(staging, ignore_errors=True)  # the space a full disk needs back
        previous = [p.name for p in complete_checkpoints(self.output_dir) if p.name != f"checkpoint-{step}"]
        unique = list(dict.fromkeys(failures))
        raise CheckpointSaveError(
            f"checkpoint-{step} could not be saved ({stage}): " + "; ".join(unique[:4])
            + (f" (and {len(unique) - 4} more)" if len(unique) > 4 else "")
            + f". Nothing was committed; the newest complete checkpoint is {previous[-1] if previous else 'none'}"
            + f" in {self.output_dir}"
        )  # fmt: skip

    def _files_written(self, staging: Path) -> list[dict[str, Any]]:
        """The files under ``staging`` this rank wrote (DCP names shard files by rank in the saving group)."""
        host = socket.gethostname()
        group_rank = self.domains.ranks(self.domains.mine).index(self.env.rank) if self.node_local else self.env.rank
        mine = {f"rng/rank-{self.env.rank}.pt"}
        for kind in ("model", "optimizer"):
            shards = self._shards(staging, kind)
            if shards.is_dir():
                mine |= {str(p.relative_to(staging)) for p in shards.glob(f"__{group_rank}_*")}
                if group_rank == 0:
                    mine.add(str((shards / METADATA_FILE).relative_to(staging)))
        return [
            {"path": name, "bytes": (staging / name).stat().st_size, "host": host}
            for name in sorted(mine)
            if (staging / name).is_file()
        ]

    def _small_files(self, step: int, mode: str, files: list[Any], totals: list[dict[str, Any]]) -> dict[str, str]:
        segment = RunTotals(
            tokens_per_rank=[token for rank in totals for token in rank["tokens_per_rank"]],
            train_time_s=totals[0]["train_time_s"],
            wall_time_s=totals[0]["wall_time_s"],
            first_eval_loss=totals[0]["first_eval_loss"],
        )
        trainer = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "run_totals": asdict(self.earlier_totals.plus(segment)),
        }
        hosts = [entries[0]["host"] if entries else "?" for entries in files]
        nodes = [
            {"name": f"node-{domain}", "host": hosts[ranks[0]], "ranks": ranks}
            for domain in range(self.domains.count)
            for ranks in [self.domains.ranks(domain)]
        ]
        manifest = {
            "step": step,
            "mode": mode,
            "world_size": self.env.world_size,
            "strategy": self.strategy,
            "config_hash": config_hash(self.config),
            "storage": {"kind": "node-local" if self.node_local else "shared", "nodes": nodes},
            "files": {str(rank): entries for rank, entries in enumerate(files)},
        }
        # The manifest is written last: its presence is what marks a staged directory complete.
        return {
            "trainer.json": json.dumps(trainer, indent=2) + "\n",
            "config.yaml": dump_config(self.config),
            "manifest.json": json.dumps(manifest, indent=2) + "\n",
        }

    def _rotate(self, step: int) -> None:
        limit = self.config.training.save_total_limit
        if not limit:
            return
        checkpoints = complete_checkpoints(self.output_dir)
        # The newest complete checkpoint is always kept: only older ones beyond the limit go. Each is renamed
        # to a partial's name first (atomic), so a kill during the removal leaves no checkpoint-N without
        # its manifest, only a partial that the next start clears (``remove_partial``).
        for old in checkpoints[: max(0, len(checkpoints) - limit)]:
            doomed = old.with_name(f".{old.name}.removed.tmp")
            try:
                os.replace(old, doomed)
            except OSError as error:
                # The checkpoint just saved is committed: a copy that cannot go only costs disk space.
                log.warning("could not remove %s (save_total_limit=%d): %s; it stays", old, limit, error)
                continue
            fault_point("save.rotate", step)
            shutil.rmtree(doomed, ignore_errors=True)
            log.info("removed %s (save_total_limit=%d)", old, limit)

    def remove_partial(self) -> None:
        """Checkpoints a crash left half-written are never loaded; clear them at start, on every node's disk."""
        if self.domains.is_leader and self.output_dir.is_dir():
            for partial in self.output_dir.glob(".checkpoint-*.tmp"):
                shutil.rmtree(partial, ignore_errors=True)
                log.info("removed %s, left by an interrupted save or removal", partial)

    # -- loading -----------------------------------------------------------------------------------
    def load(self, path: Path) -> int:
        """Restore what ``path`` holds; returns the step to continue after."""
        manifest = json.loads((path / "manifest.json").read_text())
        # The tensors to fill, and their views as the checkpoint holds them: loading into the views fills them.
        model_state = trainable_state_dict(self.model)
        model_view = expert_state_views(model_state, expert_state_names(self.model), self.env.mesh)
        optimizer_state = optimizer_view = None
        if manifest["mode"] == "full":
            optimizer_state, optimizer_view = checkpoint_optimizer_state(self.model, self.optimizer, self.env.mesh)
        wanted = {"model": model_view, "optimizer": optimizer_view}
        readers = {kind: ShardsReader(path / kind) for kind, state in wanted.items() if state is not None}
        # Sizes first: a truncated shard would otherwise fail inside DCP's reader, far from its name. Only
        # files of the sizes they were saved at are then planned against.
        problems = resized_files(path, manifest)
        for kind, reader in [] if problems else readers.items():
            try:
                problems += describe_missing(path, kind, wanted[kind], reader, manifest)
            except ShardMismatch as mismatch:
                problems.append(str(mismatch))
                break  # the optimizer's state mirrors the model's: it would differ the same way
        # Every rank learns of every rank's problems, so all stop together instead of some waiting
        # in dcp.load for ranks that gave up.
        lacking = merge_rank_problems(self.env.all_gather_objects(problems))
        if lacking:
            raise ConfigError(
                f"training.resume_from_checkpoint: {path} cannot be loaded here: " + "; ".join(lacking[:4])
                + (f" (and {len(lacking) - 4} more)" if len(lacking) > 4 else "")
            )  # fmt: skip
        _read_shards(model_view, readers["model"], path, "model")
        set_model_state_dict(self.model, model_state, options=SET_TRAINABLE)
        trainer = json.loads((path / "trainer.json").read_text())
        try:
            self.sampler.load_state_dict(trainer["sampler"])
        except ValueError as error:  # the same config, but the dataset's files changed since the save
            raise ConfigError(
                f"training.resume_from_checkpoint: {path}: {error}; the training data changed since this checkpoint "
                "was saved: restore it, or start a new run in another output_dir"
            ) from None
        self.scheduler.load_state_dict(trainer["scheduler"])
        if "run_totals" in trainer:
            self.earlier_totals = RunTotals(**trainer["run_totals"])
        else:
            log.warning(
                "%s predates saved run totals: metrics.json will count the tokens and time from step %d on",
                path, manifest["step"], extra=SAID_BY_RANK_ZERO,
            )  # fmt: skip
        if optimizer_state is not None:
            _read_shards(optimizer_view, readers["optimizer"], path, "optimizer")
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=TRAINABLE_ONLY)
            rng_file = path / "rng" / f"rank-{self.env.rank}.pt"
            if manifest["world_size"] == self.env.world_size and rng_file.is_file():
                _set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.warning(
                "resuming from lite checkpoint %s: weights only, the optimizer state starts fresh",
                path, extra=SAID_BY_RANK_ZERO,
            )  # fmt: skip
        log.info(
            "resumed from %s (step %d, saved by %d rank(s) with %s, now %d rank(s))",
            path, manifest["step"], manifest["world_size"], manifest["strategy"], self.env.world_size,
        )  # fmt: skip
        return int(manifest["step"])


def read_trainable_shards(path: Path, model: torch.nn.Module, purpose: str) -> None:
    """Put a checkpoint's trained tensors into ``model`` (parallelize then spreads them): see
    ``read_trainable_state``."""
    set_model_state_dict(model, read_trainable_state(path, model, purpose), options=SET_TRAINABLE)


def read_trainable_state(path: Path, model: torch.nn.Module, purpose: str) -> dict[str, Any]:
    """A checkpoint's trained tensors, whole, in this one process (``export`` and ``eval`` read every rank's
    shards here), keyed as ``model``'s state dict: read into the model's own tensors, or into new CPU tensors
    where it is on the meta device (a merging export needs only the adapter). A missing or mismatched tensor
    is one ``InputError`` saying the checkpoint ``cannot {purpose}``."""
    state = {
        name: torch.empty_like(tensor, device="cpu") if tensor.is_meta else tensor
        for name, tensor in trainable_state_dict(model).items()
    }
    alone = ParallelDims(world_size=1, rank=0, local_world_size=1)  # this process reads every rank's shards
    viewed = expert_state_views(state, expert_state_names(model), alone)
    reader = ShardsReader(path / "model")
    manifest = json.loads((path / "manifest.json").read_text())
    try:
        problems = describe_missing(path, "model", viewed, reader, manifest, UseEarlier(path))
    except ShardMismatch as mismatch:  # its DCP metadata is missing or does not read
        problems = [str(mismatch)]
    if problems:
        raise InputError(f"{path}: cannot {purpose}: {'; '.join(problems)}")
    try:
        with warnings.catch_warnings():
            # DCP warns that no process group exists; reading every rank's shards in one process is the point.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(viewed, storage_reader=reader, no_dist=True)
    except CheckpointException as error:  # a shard of the recorded size whose content does not read back
        damage = unreadable_shards(path, "model", error, UseEarlier(path))
        raise InputError(f"{path}: cannot {purpose}: {damage}") from None
    except Exception as error:  # DCP wraps a shape mismatch in its own exception, with a traceback text
        problem = f"its tensors do not fit the config's model ({first_line(error)})"
        raise InputError(f"{path}: cannot {purpose}: {problem}") from None
    return state


def describe_missing(
    path: Path,
    kind: str,
    state: dict[str, Any],
    reader: ShardsReader,
    manifest: dict[str, Any],
    instead: str | UseEarlier = RESUME_EARLIER,
) -> list[str]:
    """Why ``state`` cannot be read from ``path/kind`` here, naming the files and where they were written; raises
    ``ShardMismatch`` as ``missing_shards`` does (``instead``: what the user may do where the checkpoint is
    damaged)."""
    writers = {
        entry["path"]: f"rank {rank} on {entry['host']}"
        for rank, entries in manifest["files"].items()
        for entry in entries
    }
    uncovered, absent = missing_shards(state, reader, instead)
    problems = [
        f"{kind}/{name} (written by {writers.get(f'{kind}/{name}', 'an unknown rank')}) is missing" for name in absent
    ]
    if uncovered:
        elsewhere = [
            f"{name} (written by {writer})"
            for name, writer in writers.items()
            if name.startswith(f"{kind}/") and not (path / name).is_file()
        ]
        problems.append(
            f"{len(uncovered)} {kind} tensor(s) (e.g. {uncovered[0]}) have shards that are not here; "
            "files absent here: "
            + (", ".join(elsewhere[:6]) + (" ..." if len(elsewhere) > 6 else "") if elsewhere else "none listed")
            + ". Resume on the nodes that wrote it, or copy every node's copy of the checkpoint into one directory"
        )
    return problems


def _read_shards(state: dict[str, Any], reader: ShardsReader, path: Path, kind: str) -> None:
    """``dcp.load``; a shard that does not read (damaged content) stops every rank with one line."""
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as error:  # DCP's exception is a BaseException
        raise ConfigError(f"training.resume_from_checkpoint: {unreadable_shards(path, kind, error)}") from None


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

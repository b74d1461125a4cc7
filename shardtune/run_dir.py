"""The run directory (``training.output_dir``): what a run leaves behind, written by global rank 0.

Files are written to a temporary name and renamed (``shardtune.atomic``), so a reader (or a crash) never
sees half a file. A run holds every copy of its directory alone, never mixes with an earlier run there, and
never removes or writes over what no run made (``claim_output_dir``, ``prepare_output_dir``); ``export``,
``convert``, ``eval``, ``plot`` and ``expert-usage`` never write over a run, what a run wrote, a checkpoint or their
own input (``check_output_place``).
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import socket
import sys
from datetime import datetime, timezone
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.atomic import write_atomic
from shardtune.checkpoint.layout import (
    STAGING_GLOB,
    checkpoint_step,
    complete_checkpoints,
    enclosing_checkpoint,
    lies_in,
)
from shardtune.config import Config, ConfigError, TrainingConfig, dump_config
from shardtune.errors import InputError
from shardtune.metrics.schema import SCHEMA_VERSION
from shardtune.run_lock import RunLock, current_holder, in_use_line

if TYPE_CHECKING:
    from shardtune.distributed.env import DistributedEnv
    from shardtune.distributed.storage import StorageDomains

log = logging.getLogger("shardtune")

# What a run writes into its directory that only shardtune writes: the run's arguments (written at its start, with
# config.yaml), heartbeats, committed checkpoints (``checkpoint-N`` with its manifest.json) and the staging names of
# saves. Any of them marks the directory as a run's.
_RUN_MARKS = ("run_args.json", "heartbeat")
_STAGING_PATTERNS = (STAGING_GLOB, ".final.tmp-*", ".final.old-*", ".final-merged.tmp-*", ".final-merged.old-*")
# What a run writes there under names common elsewhere too (a project's own config.yaml, logs/ or wandb/, another
# trainer's checkpoint-N): a previous run's only next to one of its marks, and otherwise never removed.
_COMMON_NAMES = (
    "config.yaml", "metrics.json", "logs", "final", "final-merged", "tensorboard", "wandb", "hang", "profile",
)  # fmt: skip
_COMMON_PATTERNS = ("hang-*", "checkpoint-*")
# What only a run that reached its end writes (global rank 0, after the last step).
FINISHED_RUN_OUTPUTS = ("final", "final-merged", "metrics.json")


def _marks_a_run(entry: Path) -> bool:
    if checkpoint_step(entry) is not None:
        return (entry / "manifest.json").is_file()
    return entry.name in _RUN_MARKS or any(fnmatch(entry.name, pattern) for pattern in _STAGING_PATTERNS)


def _has_a_common_name(entry: Path) -> bool:
    return entry.name in _COMMON_NAMES or any(fnmatch(entry.name, pattern) for pattern in _COMMON_PATTERNS)


def _run_names(output_dir: Path) -> tuple[bool, list[Path]]:
    """Whether ``output_dir`` holds a run (one of its marks), and every entry there with a name a run writes."""
    if not output_dir.is_dir():
        return False, []
    marked = [(entry, _marks_a_run(entry)) for entry in sorted(output_dir.iterdir())]
    entries = [entry for entry, mark in marked if mark or _has_a_common_name(entry)]
    return any(mark for _, mark in marked), entries


def run_artifacts(output_dir: Path) -> list[Path]:
    """Everything a run wrote into ``output_dir`` (checkpoints and interrupted saves included), and
    nothing else: a user's own files there are not a run's, nor is anything where no run has been."""
    holds_a_run, entries = _run_names(output_dir)
    return entries if holds_a_run else []


def existing_run_artifacts(output_dir: Path) -> list[str]:
    """The names of ``run_artifacts``, for messages."""
    return [path.name for path in run_artifacts(output_dir)]


def output_dir_problem(training: TrainingConfig) -> str | None:
    """The line with which ``shardtune train`` would refuse its output directory, asked ahead of it (``doctor``,
    ``slurm``): another run writing there now (its lock), else ``previous_run_problem``; None when free."""
    output_dir = Path(training.output_dir)
    holder = current_holder(output_dir)
    return in_use_line(output_dir, holder) if holder else previous_run_problem(training)


def previous_run_problem(training: TrainingConfig) -> str | None:
    """The line with which a run refuses its output directory for what is there (``train``, and ahead of it
    ``doctor`` and ``slurm``): files of its own names that no run made, or a previous run the config neither
    replaces nor continues. None where the directory is free."""
    output_dir = Path(training.output_dir)
    holds_a_run, entries = _run_names(output_dir)
    names = [entry.name for entry in entries]
    if names and not holds_a_run:
        # What a run would write over where no run has been (a project directory's own logs/ or config.yaml,
        # another trainer's checkpoints): never removed, not even with ``overwrite_output_dir``.
        return (
            f"training.output_dir: {output_dir} holds {', '.join(names)}, which a run writes but no shardtune "
            "run made there; choose a new or empty output_dir (overwrite_output_dir removes only a previous run's "
            "files)"
        )
    if training.overwrite_output_dir:
        return None
    resume = training.resume_from_checkpoint
    if resume == "auto":
        finished = [] if complete_checkpoints(output_dir) else finished_run_outputs(output_dir)
        return nothing_to_resume_line(output_dir, finished) if finished else None
    if starts_a_run(training) and holds_a_run:
        return _holds_a_run(output_dir, names, branch_from=resume)
    return None


def starts_a_run(training: TrainingConfig) -> bool:
    """Whether the run is a new one in its output directory: a fresh run, or one that branches from another
    directory's checkpoint. Only a resume from ``auto`` or from a checkpoint of the output directory itself
    continues the run there."""
    resume = training.resume_from_checkpoint
    return resume is None or (resume != "auto" and not lies_in(Path(resume), Path(training.output_dir)))


def nothing_to_resume_line(output_dir: Path, finished: list[str]) -> str:
    """``resume_from_checkpoint: auto`` found no checkpoint to continue from where a finished run (``finished``, by
    name) is: starting over would replace it, which only ``overwrite_output_dir`` may."""
    return (
        f"training.resume_from_checkpoint: auto found no checkpoint to continue from in {output_dir}, which holds a "
        f"finished run ({', '.join(finished)}); to train again from the start and replace it, set "
        "training.overwrite_output_dir=true, or choose another output_dir"
    )


def finished_run_outputs(output_dir: Path) -> list[str]:
    """What a run that reached its end left in ``output_dir`` (``FINISHED_RUN_OUTPUTS``), by name."""
    return [name for name in FINISHED_RUN_OUTPUTS if (output_dir / name).exists()]


def _holds_a_run(output_dir: Path, names: list[str], branch_from: str | None) -> str:
    """A fresh run's line, or (``branch_from``) that of a run resumed from another directory's checkpoint, which
    is a new run too: it would mix its checkpoints with that run's, and a later ``auto`` take the newest of either."""
    start = f"; to train from {branch_from}, choose" if branch_from else "; choose"
    # ``auto`` continues only from a complete checkpoint: without one it would train from the start and replace
    # what the run made, so it is offered only where there is one.
    resumable = "; or continue it with training.resume_from_checkpoint=auto" if complete_checkpoints(output_dir) else ""
    return (
        f"training.output_dir: {output_dir} already holds a run ({', '.join(names)}){start} another output_dir or "
        f"set training.overwrite_output_dir=true{resumable}"
    )


def claim_output_dir(env: DistributedEnv, training: TrainingConfig, domains: StorageDomains) -> RunLock | None:
    """Every copy of the output directory taken for this run before anything in it is removed or written: global
    rank 0's and, on node-local storage, each other node's, by the lowest rank that sees it. Each such rank locks
    its copy (a second run sharing only one node would mix its checkpoints with this run's there) and checks what
    is there (``previous_run_problem``); only once every copy is locked and free does a new run (``starts_a_run``)
    clear them (``prepare_output_dir``). A collective: where any copy is refused, every rank stops with its line,
    printed once. The lock this process holds, or None."""
    output_dir = Path(training.output_dir)
    lock, refused = None, None
    if domains.is_leader:
        try:
            lock = RunLock.take(output_dir)
            if problem := previous_run_problem(training):
                raise ConfigError(problem)
        except ConfigError as error:
            disk = "" if domains.mine == 0 else f" (on {socket.gethostname()}'s disk)"
            refused = [line + disk for line in error.lines]
    problems = [lines for lines in env.all_gather_objects(refused) if lines]
    if problems:
        if lock is not None:
            lock.release()
        raise ConfigError(problems[0] if env.is_main else [])  # every rank exits 2; rank 0 says why, once
    if domains.is_leader and starts_a_run(training):
        prepare_output_dir(output_dir, training.overwrite_output_dir)
    return lock


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    """A new run's directory, once ``previous_run_problem`` has found it free: with ``overwrite`` what the previous
    run wrote there (only that) is removed before this one writes anything, so neither checkpoint rotation nor a
    later ``resume_from_checkpoint: auto`` ever sees the old checkpoints."""
    existing = run_artifacts(output_dir) if overwrite else []
    if existing:
        log.info(
            "training.overwrite_output_dir: removing the previous run's %s from %s",
            ", ".join(path.name for path in existing), output_dir,
        )  # fmt: skip
    for target in existing:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)


def run_record(path: Path) -> tuple[Path, Path] | None:
    """The run directory and its entry (``logs``, ``final``, ``config.yaml``, ``checkpoint-N``, ...) that ``path``
    (links resolved) is or lies inside, or None. A name a run writes counts before the run has written it: the
    run would write over it later (a resumed run's ``final/``)."""
    target = path.resolve()
    for entry in (target, *target.parents):
        named_by_a_run = entry.parent != entry and (_marks_a_run(entry) or _has_a_common_name(entry))
        if named_by_a_run and _run_names(entry.parent)[0]:
            return entry.parent, entry
    return None


# How ``check_output_place`` names an input that is the base model trained weights adapt (``export``, ``eval``).
BASE_MODEL = "the checkpoint's base model"


def check_output_path(out: Path, inputs: dict[Path, str], overwrite: bool) -> Path:
    """``--out`` of ``export``, ``convert`` and ``eval``: a place ``check_output_place`` allows; an existing file or
    non-empty directory only with ``--overwrite`` (the caller writes a sibling and swaps it in once complete).
    Returns the path to write, as ``check_output_place`` does."""
    path = check_output_place(out, inputs)
    occupied = any(out.iterdir()) if out.is_dir() else out.exists()
    if occupied and not overwrite:
        raise InputError(f"--out {out}: already exists; choose another path, or pass --overwrite to replace it")
    return path


def check_output_place(out: Path, inputs: dict[Path, str]) -> Path:
    """Where a command's ``--out`` may never be, whatever is there and even with ``--overwrite``: one of the
    command's ``inputs`` (each named in the line as the caller says what it is: "the input", "the checkpoint's base
    model"), a checkpoint, a run directory, one of a run's own entries (``run_record``), or a path inside any of
    them. Returns the path to write: ``out``, or where ``out`` leads when it is a link, which is what was checked
    (the link stays and shows the new output; replacing the link itself would write beside a target it may point
    into)."""
    target = out.resolve()
    for path, what in inputs.items():
        source = path.resolve()
        overlap = (
            f"is {what} {source}" if target == source
            else f"is inside {what} {source}" if source in target.parents
            else f"contains {what} {source}" if target in source.parents
            else None
        )  # fmt: skip
        if overlap:
            raise InputError(f"--out {out}: {overlap}; choose another --out")
    if checkpoint := enclosing_checkpoint(target):
        raise InputError(f"--out {out}: {checkpoint} is a checkpoint, which is never written to; choose another --out")
    # A run's directory is protected; a new directory inside it (RUN/adapter) is not.
    if run := existing_run_artifacts(target):
        raise InputError(
            f"--out {out}: holds a training run ({', '.join(run[:4])}), which is never replaced; choose another --out"
        )
    if record := run_record(target):
        run, entry = record
        where = "is" if entry == target else "is inside"
        raise InputError(
            f"--out {out}: {where} the run's {entry.name} in {run}, which only the run writes; choose another --out"
        )
    return target if out.is_symlink() else out


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("shardtune", "torch", "transformers", "peft", "safetensors", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def write_run_start(output_dir: Path, config: Config, argv: list[str], world: dict[str, Any]) -> None:
    """``config.yaml`` and the run manifest ``run_args.json`` (``world`` from ``describe_world``)."""
    # Imported here: the command line (doctor, slurm, export) imports this module, and run_manifest imports torch.
    from shardtune.run_manifest import code_version, config_hash, device_versions

    write_atomic(output_dir / "config.yaml", dump_config(config))
    run_args = {
        "argv": [sys.executable, *argv],
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config_hash": config_hash(config),
        **code_version(),
        "log_schema_version": SCHEMA_VERSION,
        **world,
        "versions": {**package_versions(), **device_versions()},
    }
    write_atomic(output_dir / "run_args.json", json.dumps(run_args, indent=2) + "\n")


def write_metrics(output_dir: Path, metrics: dict[str, Any]) -> None:
    write_atomic(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")

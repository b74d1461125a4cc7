"""What makes a directory a checkpoint, and what a resume may change: the one place the config check,
``train``'s resume, rotation and ``export`` all ask. Light on purpose (no torch): the config is checked
with it before anything heavy is imported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# A save in progress (or killed in progress): never read, removed at the next start.
STAGING_GLOB = ".checkpoint-*.tmp"
MANIFEST_KEYS = ("step", "mode", "world_size", "files")

# A resume continues the weights, the adapter and the position in the data of the run that saved the
# checkpoint: every key of these sections must be as it was, except the ones that change only how the
# work is computed (attention kernel, expert kernel, dtype of the frozen base) or where it is read from.
RESUME_FIXED_SECTIONS = ("model", "lora", "data")
RESUME_FREE_KEYS = frozenset(
    {
        "model.dtype", "model.attn_implementation", "model.experts_implementation", "model.grouped_gemm",
        "model.liger_kernel", "model.float8_experts", "model.float8_linear",
        "lora.lora_dropout",
        "data.cache_dir", "data.prepare_timeout_s", "data.eval_path", "data.on_bad_row", "data.pad_to",
    }
)  # fmt: skip
# The data order (the sampler's permutation) and a random init derive from the seed.
RESUME_FIXED_KEYS = ("training.seed",)


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``checkpoint-<step>`` name, or None for any other name."""
    match = CHECKPOINT_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


def not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a complete shardtune checkpoint, or None. Reads only small files."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "is not a complete checkpoint (no manifest.json)"
    try:
        content = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"is not a shardtune checkpoint: its manifest.json does not read as JSON ({error})"
    lacking = [key for key in MANIFEST_KEYS if not isinstance(content, dict) or key not in content]
    if lacking:
        return f"is not a shardtune checkpoint: its manifest.json lacks {', '.join(lacking)}"
    absent = [name for name in ("trainer.json", "model", "config.yaml") if not (path / name).exists()]
    if absent:
        return f"is not a complete checkpoint: {', '.join(absent)} missing"
    return None


def is_checkpoint(path: Path) -> bool:
    return not_a_checkpoint(path) is None


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The committed checkpoints of a run directory, oldest first."""
    found = [(checkpoint_step(entry), entry) for entry in output_dir.glob("checkpoint-*")]
    return [path for step, path in sorted((s, p) for s, p in found if s is not None) if is_checkpoint(path)]


def what_to_name_in_a_run(path: Path, checkpoints_too: bool) -> str:
    """Where ``path`` is a run's directory, named where a command wants trained weights: the end of the line
    that refuses it, naming its ``final/`` (and, ``checkpoints_too``, its newest complete checkpoint); "" else."""
    choices = [str(path / "final")] if (path / "final").is_dir() else []
    if checkpoints_too and (checkpoints := complete_checkpoints(path)):
        choices.append(str(checkpoints[-1]))
    return f"; {path} is a run's directory: name {' or '.join(choices)}" if choices else ""


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint that ``path`` is, or lies inside (links resolved), or None: what is never written to."""
    target = path.resolve()
    return next((directory for directory in (target, *target.parents) if is_checkpoint(directory)), None)


def lies_in(path: Path, output_dir: Path) -> bool:
    """Whether ``path`` (a checkpoint) is an entry of the run directory ``output_dir``, links resolved."""
    return path.resolve().parent == output_dir.resolve()


def read_step(path: Path) -> int:
    return int(json.loads((path / "manifest.json").read_text(encoding="utf-8"))["step"])


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key in RESUME_FIXED_SECTIONS and not prefix:
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _same(key: str, saved: Any, current: Any) -> bool:
    if saved == current:
        return True
    # A relative path and the absolute path of the same directory name the same model or data.
    if key in ("model.name_or_path", "data.dataset_path") and isinstance(saved, str) and isinstance(current, str):
        return Path(saved).exists() and Path(current).exists() and Path(saved).resolve() == Path(current).resolve()
    return False


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each key that a resume from a checkpoint saved with config ``saved`` (as
    ``Config.to_dict``) may not change; empty when ``current`` may continue it."""
    old = {**_flatten(saved), **{key: saved["training"][key.split(".")[1]] for key in RESUME_FIXED_KEYS}}
    new = {**_flatten(current), **{key: current["training"][key.split(".")[1]] for key in RESUME_FIXED_KEYS}}
    fixed = [
        key
        for key in sorted(set(old) | set(new))
        if (key.split(".")[0] in RESUME_FIXED_SECTIONS and key not in RESUME_FREE_KEYS) or key in RESUME_FIXED_KEYS
    ]
    return [
        f"{key} {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}"
        for key in fixed
        if not _same(key, old.get(key), new.get(key))
    ]

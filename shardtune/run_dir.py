"""The run directory (``training.output_dir``): what a run leaves behind, written by global rank 0.

Files are written to a temporary name and renamed, so a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from shardtune.config import Config, ConfigError, dump_config
from shardtune.metrics.schema import SCHEMA_VERSION

# What a finished or interrupted run leaves; any of them means the directory holds a run.
RUN_ARTIFACTS = (
    "config.yaml", "run_args.json", "metrics.json", "logs", "final", "tensorboard", "wandb", "heartbeat", "hang",
)  # fmt: skip


def write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory unless told to replace the old one."""
    existing = [name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"training.output_dir: {output_dir} already holds a run ({', '.join(existing)}); "
            "choose another output_dir or set training.overwrite_output_dir=true"
        )
    for name in existing:
        target = output_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)


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
    # Imported here: the CLI imports this module for RUN_ARTIFACTS, and run_manifest imports torch.
    from shardtune.run_manifest import code_version, config_hash, device_versions

    config_text = dump_config(config)
    write_atomic(output_dir / "config.yaml", config_text)
    run_args = {
        "argv": [sys.executable, *argv],
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config_hash": config_hash(config_text),
        **code_version(),
        "log_schema_version": SCHEMA_VERSION,
        **world,
        "versions": {**package_versions(), **device_versions()},
    }
    write_atomic(output_dir / "run_args.json", json.dumps(run_args, indent=2) + "\n")


def write_metrics(output_dir: Path, metrics: dict[str, Any]) -> None:
    write_atomic(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")

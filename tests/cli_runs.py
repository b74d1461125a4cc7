"""Run ``shardtune train`` on the quickstart config as a user would (a subprocess, CPU, gloo), and read
back what the run wrote."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def train(tmp_path: Path, name: str, nproc: int, *overrides: str, steps: int = 5, env: dict | None = None) -> dict:
    """A short run logging every step: its losses, metrics.json, output directory and log; ``env`` adds
    environment variables."""
    out = tmp_path / name
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(
        [
            sys.executable, "-m", "shardtune", "train", "examples/quickstart.yaml", "--nproc", str(nproc),
            f"training.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", f"training.max_steps={steps}",
            "training.logging_steps=1", "training.per_device_train_batch_size=2", "training.eval_on_start=false",
            "training.eval_steps=null", "lora.lora_dropout=0", *overrides,
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return {
        "losses": [row["loss"] for row in jsonl(out / "logs/train_log.jsonl")],
        "metrics": json.loads((out / "metrics.json").read_text()),
        "out": out,
        "log": result.stderr,
    }


class RunsOnDemand:
    """A module's training runs, keyed, each trained the first time a test asks for it: a matrix whose
    cases CI runs only in part (see pyproject's markers) trains only the runs of the cases selected."""

    def __init__(self, recipes: dict):
        self.recipes, self.done = recipes, {}

    def __getitem__(self, key) -> dict:
        if key not in self.done:
            self.done[key] = self.recipes[key]()
        return self.done[key]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def schema_checked_logs(out: Path) -> dict[str, list[dict]]:
    """Every row of the run's JSONL logs, each validated against shardtune's log schema (raises on the
    first row that does not match); kinds whose log the run did not write are absent."""
    from shardtune.metrics.schema import LOG_FILES, validate

    logs = {}
    for kind, name in LOG_FILES.items():
        if (out / "logs" / name).is_file():
            logs[kind] = jsonl(out / "logs" / name)
            for row in logs[kind]:
                validate(kind, row)
    assert logs.get("train"), f"{out}: no train_log.jsonl rows"
    return logs


def process_status(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (its state, "Z" for a zombie, then its parent's
    id, ...), or None once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (a launcher): its workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            status = process_status(int(entry.name))
            if status is not None and int(status[1]) == parent:
                found.append(int(entry.name))
    return found


def snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directory``: its modification time and content hash."""
    return {
        str(path.relative_to(directory)): (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }

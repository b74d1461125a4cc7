"""Where metrics go: JSONL files always, TensorBoard and Weights & Biases when asked for."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from shardtune.config import Config
from shardtune.errors import ConfigError, first_line
from shardtune.metrics.schema import LOG_FILES, is_number, make_row, read_rows

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, kind: str, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``logs/train_log.jsonl``, ``logs/eval_log.jsonl`` and (MoE models) ``logs/expert_usage.jsonl``: one
    JSON object per line as ``shardtune.metrics.schema`` defines it, flushed at once."""

    def __init__(self, logs_dir: Path, resume_step: int = 0):
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir = logs_dir
        # Records past the checkpoint belong to a run that did not get further: they are redone. A run
        # that starts afresh (auto-resume found no checkpoint, e.g. a crash before the first) redoes all.
        for name in LOG_FILES.values():
            path = logs_dir / name
            if path.is_file():
                # Afresh, nothing is kept and the old rows are not even read. A last line cut short by a kill in
                # mid-write is left out by read_rows: its step is past any checkpoint.
                kept = (
                    [row for row in read_rows(path, "a log row") if row["step"] <= resume_step] if resume_step else []
                )
                path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        # Each file stays open for the whole run (closed by close()) once it has a first record.
        self.files: dict[str, Any] = {}

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        handle = self.files.get(kind)
        if handle is None:
            handle = self.files[kind] = open(self.logs_dir / LOG_FILES[kind], "a", encoding="utf-8")  # noqa: SIM115
        handle.write(json.dumps(make_row(kind, step, values)) + "\n")
        handle.flush()

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # installed: check_logging_packages

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if is_number(value):
                self.writer.add_scalar(f"{kind}/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, config: Config, output_dir: Path):
        import wandb  # installed: check_logging_packages

        settings = config.logging.wandb
        try:
            self.run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.name,
                tags=settings.tags,
                mode=settings.mode,
                dir=str(output_dir),
                config=config.to_dict(),
            )
        except wandb.errors.Error as error:  # no API key, a wrong one, the server out of reach
            raise ConfigError(
                f"logging.wandb: wandb.init failed ({first_line(error)}); log in on the node of global rank 0 "
                "(`wandb login`, or WANDB_API_KEY), or set logging.wandb.mode=offline and `wandb sync` the run later"
            ) from None

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        # Numbers only: per-layer lists (expert usage), host names and unknown MFU stay in the JSONL logs.
        numbers = {name: value for name, value in values.items() if is_number(value)}
        self.run.log({f"{kind}/{name}": value for name, value in numbers.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def check_logging_packages(config: Config) -> str:
    """The packages of the metric sinks the config asks for are installed (a preflight check: before the run writes
    anything, on every rank, though only global rank 0 opens the sinks)."""
    import importlib.util

    wanted = {"logging.tensorboard": "tensorboard"} if config.logging.tensorboard else {}
    if config.logging.wandb.enabled:
        wanted["logging.wandb.enabled"] = "wandb"
    # Each package's name is also the name of shardtune's extra that installs it.
    missing = [
        f"{key}: true needs the {package} package: pip install 'shardtune[{package}]'"
        for key, package in wanted.items()
        if importlib.util.find_spec(package) is None
    ]
    if missing:
        raise ConfigError(missing)
    return "JSONL" + "".join(f", {package}" for package in wanted.values())


def open_sinks(config: Config, output_dir: Path, resume_step: int = 0) -> list[MetricSink]:
    """The sinks of global rank 0 (the only rank that writes shared files)."""
    sinks: list[MetricSink] = [JsonlSink(output_dir / "logs", resume_step)]
    if config.logging.tensorboard:
        sinks.append(TensorBoardSink(output_dir / "tensorboard"))
    if config.logging.wandb.enabled:
        sinks.append(WandbSink(config, output_dir))
    return sinks

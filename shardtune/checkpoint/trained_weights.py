"""What a directory of trained weights holds (a checkpoint, or a ``final/`` adapter or full model), and
reading its tensors into a model: ``shardtune eval`` evaluates any of them, ``shardtune export`` exports a
checkpoint and merges a checkpoint's or a ``final/``'s adapter."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtune.checkpoint.checkpointer import read_trainable_shards, read_trainable_state, trainable_state_dict
from shardtune.checkpoint.export import saved_run_config
from shardtune.checkpoint.layout import checkpoint_step, not_a_checkpoint, read_step, what_to_name_in_a_run
from shardtune.checkpoint.shards import UseEarlier, checkpoint_damage
from shardtune.config import Config, load_config
from shardtune.errors import InputError, first_line

# PEFT's names for an adapter's weights file: safetensors, or the older pickle.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class TrainedWeights:
    """A DCP checkpoint, or a ``final/`` adapter or model directory."""

    path: Path
    kind: str  # "checkpoint", "adapter" or "model"
    step: int | None  # the training step the weights are from, when known
    saved_config: Config | None  # the config the weights were trained with, when it is at hand


def find_trained_weights(path: Path, argument: str = "--checkpoint") -> TrainedWeights:
    """``path`` as trained weights, or an ``InputError`` saying why it is none; ``argument``: how the command
    line named it, for the message."""
    named = f"{argument} {path}" if argument else str(path)
    if not path.exists():
        raise InputError(f"{named}: no such file or directory")
    if not path.is_dir():
        raise InputError(f"{named}: not a directory (name a checkpoint-<step>/ or final/ directory)")
    if (path / "manifest.json").exists() or checkpoint_step(path) is not None:
        problem = not_a_checkpoint(path)
        if problem:
            raise InputError(f"{named} {problem}")
        # Before any model is built: a shard cut short, or metadata that is missing or does not read, would
        # fail deep inside DCP's reader.
        damage = checkpoint_damage(path, UseEarlier(path))
        if damage:
            raise InputError(f"{named}: cannot be read: {'; '.join(damage)}")
        return TrainedWeights(path, "checkpoint", read_step(path), load_config(path / "config.yaml", check_paths=False))
    if (path / "adapter_config.json").is_file():
        kind = "adapter"
    elif (path / "config.json").is_file():
        kind = "model"
    else:
        raise InputError(
            f"{named}: neither a checkpoint (manifest.json) nor a final/ directory (adapter_config.json or config.json)"
            + what_to_name_in_a_run(path, checkpoints_too=True)
        )
    problem = weight_files_problem(path)
    if problem:
        raise InputError(problem)
    return TrainedWeights(path, kind, _final_step(path), saved_run_config(path))


def weight_files_problem(path: Path) -> str | None:
    """Why the weights of a ``final/`` directory or an export at ``path`` do not read whole, or None: an adapter
    config without its weights file, or a safetensors file cut short (an interrupted copy). Reads headers only,
    before any model is built."""
    from shardtune.train.preflight import safetensors_problem

    if (path / "adapter_config.json").is_file() and not any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        return f"{path / ADAPTER_WEIGHTS[0]} is missing (its adapter_config.json is there); export or copy it again"
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            return f"{weights} {problem}; export or copy it again"
    return None


def _final_step(path: Path) -> int | None:
    """A run's ``final/`` holds the weights of its last step, which its ``metrics.json`` records."""
    metrics = path.parent / "metrics.json"
    try:
        return int(json.loads(metrics.read_text())["steps"]) if metrics.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_trained_weights(weights: TrainedWeights, model: torch.nn.Module, purpose: str) -> None:
    """Put the trained tensors of ``weights`` into ``model`` (whole, on the CPU, not yet parallelized). A full
    model in ``final/`` is the model itself: the caller builds the model from it."""
    if weights.kind == "checkpoint":
        read_trainable_shards(weights.path, model, purpose)
    elif weights.kind == "adapter":
        load_adapter(weights.path, model)


def read_trained_state(weights: TrainedWeights, model: torch.nn.Module, purpose: str) -> dict[str, Any]:
    """The trained tensors of a checkpoint or adapter, whole, on the CPU, keyed as ``model``'s state dict, with
    ``model`` on the meta device (a merge streams the base weights from their files and needs only these)."""
    if weights.kind == "checkpoint":
        return read_trainable_state(weights.path, model, purpose)
    # PEFT loads an adapter into the model's own parameters: these get CPU memory first.
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.requires_grad and parameter.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.empty_like(parameter, device="cpu")))
    load_adapter(weights.path, model)
    return trainable_state_dict(model)


def load_adapter(path: Path, model: torch.nn.Module) -> None:
    """A PEFT adapter directory's tensors into ``model``'s adapter, or one ``InputError`` saying what does not fit."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    try:
        result = set_peft_model_state_dict(model, load_peft_weights(str(path), device="cpu"))
    except RuntimeError as error:  # size mismatches
        raise InputError(f"{path}: its adapter does not fit the config's model ({first_line(error)})") from None
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    missing = sorted(trainable.intersection(result.missing_keys))
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        detail = [f"{len(missing)} adapter tensor(s) missing (e.g. {missing[0]})"] if missing else []
        if unexpected:
            detail.append(f"{len(unexpected)} tensor(s) the model has no place for (e.g. {unexpected[0]})")
        raise InputError(f"{path}: its adapter does not fit the config's model: {'; '.join(detail)}")

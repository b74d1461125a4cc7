"""``shardtune eval``: loss and perplexity of a checkpoint or a ``final/`` on a config's eval data.

The model is built by the same functions as the training run's (``build_run_model``), the trained
tensors go into global rank 0's copy, and ``parallelize`` hands them to every rank as it hands over the
base weights in training; the data is the run's token store, and the loss the run's ``evaluate``. So
on the same world size and precision the result is the run's own eval loss of that step, and it
reshards to any other world size or strategy the config names.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.checkpoint.trained_weights import TrainedWeights, find_trained_weights, load_trained_weights
from shardtune.config import Config, looks_local
from shardtune.distributed.env import DistributedEnv
from shardtune.errors import ConfigError, DataError, InputError
from shardtune.metrics.progress import EvalProgress
from shardtune.run_dir import BASE_MODEL, check_output_path, write_atomic

log = logging.getLogger("shardtune")

# The keys of a config that decide which weights a checkpoint's tensors belong to: evaluating with a
# config that differs in one of them would load the tensors into another model (or fail deep in a load).
WEIGHT_KEYS = ("model.name_or_path", "model.revision", "model.init", "lora.enabled")
ADAPTER_KEYS = ("lora.r", "lora.lora_alpha", "lora.target_modules", "lora.moe_targets")


def _value(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _same_model_path(saved: str, given: str) -> bool:
    """Whether two spellings name the same model. A checkpoint's config keeps a relative path as the run
    gave it, relative to where it ran (``org/name`` reads like a hub id): from elsewhere, a local path that
    ends with it names the same model."""
    if saved == given:
        return True
    if not looks_local(given):
        return False  # two different hub ids
    here = Path(given).expanduser().resolve()
    if Path(saved).is_absolute() or Path(saved).exists():
        return Path(saved).expanduser().resolve() == here
    relative = Path(os.path.normpath(saved)).parts
    return here.parts[-len(relative) :] == relative


def config_mismatches(saved: Config, config: Config) -> list[str]:
    """``key: value here, value in the saved config`` for each key that decides the trained weights."""
    keys = list(WEIGHT_KEYS)
    if saved.lora.enabled and config.lora.enabled:
        keys += ADAPTER_KEYS
    if saved.model.init == "random" and config.model.init == "random":
        keys.append("training.seed")  # the frozen base weights are drawn from it
    differing = []
    for key in keys:
        here, there = _value(config, key), _value(saved, key)
        same = _same_model_path(there, here) if key == "model.name_or_path" else here == there
        if not same:
            differing.append(f"{key} is {here!r} here, {there!r} there")
    return differing


def check_weights_match(weights: TrainedWeights, config: Config, config_path: str) -> None:
    """The config describes the model ``weights`` were trained as, or one ``ConfigError`` naming the keys."""
    kind_wanted = "adapter" if config.lora.enabled else "model"
    if weights.kind != "checkpoint" and weights.kind != kind_wanted:
        held = "a LoRA adapter" if weights.kind == "adapter" else "a full model"
        has, wanted = (str(setting).lower() for setting in (config.lora.enabled, not config.lora.enabled))
        raise ConfigError(
            f"{config_path} does not match {weights.path}: it holds {held}, but the config has lora.enabled: {has}; "
            f"set lora.enabled={wanted}, or evaluate it with the config it was trained with"
        )
    if weights.saved_config is None:
        return
    differing = config_mismatches(weights.saved_config, config)
    if differing:
        raise ConfigError(
            f"{config_path} does not match the config {weights.path} was trained with: {'; '.join(differing)}; "
            "evaluate it with the config it was trained with (overrides may change data and eval settings)"
        )


def result_path(weights: TrainedWeights, out: str | None, overwrite: bool, inputs: dict[Path, str]) -> Path:
    """Where the JSON result goes; an existing file is replaced only with ``--overwrite``. The default,
    ``eval.json`` beside the weights it describes, is eval's own file; any other ``--out`` is never one of the
    command's ``inputs`` (each with what it is), a checkpoint or a run's own file (``check_output_path``)."""
    default = weights.path / "eval.json"
    path = Path(out) if out else default
    if path.is_dir():
        raise InputError(f"--out {path}: is a directory; name a file")
    if path.parent.resolve() / path.name != default.parent.resolve() / default.name:
        path = check_output_path(path, inputs, overwrite)
    elif path.exists() and not overwrite:
        raise InputError(f"{path} exists; pass --overwrite to replace it, or --out FILE to write elsewhere")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{path}: cannot write in {parent}; pass --out FILE in a writable directory")
    return path


def config_for_data_file(config: Config, data_file: str) -> Config:
    """The config with ``data_file`` as its only source, prepared as the run prepared its eval data:
    every row, same format, columns, length and truncation, unpacked. Its examples are the token
    store's train split."""
    if not Path(data_file).is_file():
        raise InputError(f"--data {data_file}: file not found")
    data = config.data.model_copy(
        update={
            "dataset_path": data_file,
            "dataset_weights": None,
            "eval_path": None,
            "eval_split_ratio": 0.0,
            "subset_size": None,
            "packing": False,
        }
    )
    return config.model_copy(update={"data": data})


@dataclass(frozen=True)
class EvalRequest:
    config: Config
    config_path: str
    weights: TrainedWeights
    data_file: str | None
    out: Path


def check_request(
    config: Config, config_path: str, checkpoint: str, data_file: str | None, out: str | None, overwrite: bool
) -> EvalRequest:
    """Everything ``shardtune eval`` can check before a model loads; every process runs the same checks."""
    weights = find_trained_weights(Path(checkpoint))
    check_weights_match(weights, config, config_path)
    if data_file is not None:
        config_for_data_file(config, data_file)
    elif not config.data.eval_path and config.data.eval_split_ratio == 0:
        raise ConfigError(
            f"{config_path}: no eval data (data.eval_path or data.eval_split_ratio); pass --data FILE to evaluate on"
        )
    # What the command reads: the weights, the config, the data and the base model, where they are local.
    named = [config_path, data_file, config.data.eval_path, *config.data.paths]
    inputs = {weights.path: "the input", **{Path(path): "the input" for path in named if path and Path(path).exists()}}
    if Path(config.model.name_or_path).exists():
        inputs[Path(config.model.name_or_path)] = BASE_MODEL
    return EvalRequest(config, config_path, weights, data_file, result_path(weights, out, overwrite, inputs))


def run_eval(request: EvalRequest, env: DistributedEnv) -> dict[str, Any]:
    """Evaluate as ``request`` says on this process's rank; global rank 0 writes the result."""
    import transformers

    from shardtune.distributed.parallelize import parallelize, plan_parallelism
    from shardtune.faults import fault_point, install_faults
    from shardtune.model.load import Precision, load_tokenizer
    from shardtune.plan.shape import read_model_shape
    from shardtune.train.loop import build_run_model, evaluate_run_model, prepare_run_data
    from shardtune.train.preflight import check_model

    config, weights = request.config, request.weights
    data_config = config_for_data_file(config, request.data_file) if request.data_file else config
    # A full model in final/ is loaded as the run's base model would be: in place of it.
    model_source = config
    if weights.kind == "model":
        model = config.model.model_copy(update={"name_or_path": str(weights.path), "init": "pretrained"})
        model_source = config.model_copy(update={"model": model})
    model_config = check_model(model_source)
    transformers.set_seed(config.training.seed)
    precision = Precision.resolve(config, env.device)
    tokenizer = load_tokenizer(config.model)
    data = prepare_run_data(data_config, env, tokenizer, model_config)
    examples = data.train if request.data_file else data.eval
    if len(examples) == 0:
        raise DataError(f"{request.data_file or request.config_path}: no eval example left after preparation")

    model, _ = build_run_model(model_source, env)
    problem: list[str] | None = None
    if env.is_main:
        try:
            load_trained_weights(weights, model, "be evaluated")
        except InputError as error:
            problem = error.lines
    # Rank 0 alone reads the weights: the others learn of its failure here rather than wait in parallelize.
    failed = env.all_gather_objects(problem)[0]
    if failed:
        raise InputError(failed if env.is_main else [])  # every rank exits 2; rank 0 says why, once
    plan = plan_parallelism(read_model_shape(model, config, precision), config, env)
    log.info("%s", plan.describe(env.world_size))
    model = parallelize(model, plan, config, env, precision.compute, materialized=env.is_main)
    install_faults(env.rank).attach(model)
    said = EvalProgress(log.info)  # rank 0 alone logs at this level

    def on_batch(done: int, total: int) -> None:
        fault_point("eval.batch")
        said(done, total)

    measured = evaluate_run_model(model, examples, config, env, precision, tokenizer.pad_token_id, on_batch=on_batch)
    result = {
        "checkpoint": str(weights.path),
        "kind": weights.kind,
        "step": weights.step,
        **measured,
        "examples": len(examples),
        "data": request.data_file or "the config's eval data",
        "config": request.config_path,
        "world_size": env.world_size,
        "strategy": plan.strategy,
        "dtype": str(precision.compute).removeprefix("torch."),
    }
    if env.is_main:
        write_atomic(request.out, json.dumps(result, indent=2) + "\n")
        step = f" (step {weights.step})" if weights.step is not None else ""
        print(
            f"eval {weights.path}{step}: loss {measured['eval_loss']:.6f}, perplexity "
            f"{measured['eval_perplexity']:.4f} over {measured['eval_tokens']:,} target tokens of "
            f"{len(examples):,} examples; wrote {request.out}",
            flush=True,
        )
    return result

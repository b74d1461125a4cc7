"""Checks of the model and the tokenized data that stop a run before training starts.

Each would otherwise surface deep inside training, far from its cause: a tokenizer that does not
belong to the model makes an embedding lookup index out of range (on a GPU, a device-side assert that
takes the process down); ``max_length`` beyond the model's positions breaks learned position
embeddings; a directory that holds no causal LM fails inside ``from_pretrained`` with a message about
auto classes. Every rank runs the same checks on the same inputs before its first collective, so all
ranks stop together, with the same message, and none waits in a collective for one that gave up.

``preflight`` runs every check that needs only the config, this machine and the model's config, before the
run writes or loads anything; ``shardtune doctor`` runs the same checks (``preflight_checks``) and reports
each as a row, so the doctor never passes a config that training refuses on these grounds.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardtune.config import Config, looks_local
from shardtune.data.prepare import PreparedData
from shardtune.errors import ConfigError, DataError, InputError, first_and_last_line, first_line
from shardtune.metrics.sinks import check_logging_packages
from shardtune.train.loss import logit_transforms

# Where configs of different families keep the number of positions the model was built for.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_model(config: Config) -> PretrainedConfig:
    """The model's config, once it is known to describe a causal LM that takes ``data.max_length`` tokens."""
    return check_model_config(config, read_model_config(config))


def read_model_config(config: Config) -> PretrainedConfig:
    """The model's config, or a ``ConfigError`` saying why this machine cannot read it."""
    from huggingface_hub.errors import StrictDataclassError

    from shardtune.hub import not_cached_line, say_the_cache_serves, use_the_cache_if_the_hub_is_out_of_reach
    from shardtune.model.load import load_model_config

    model = config.model
    out_of_reach = use_the_cache_if_the_hub_is_out_of_reach(model.name_or_path)
    try:
        model_config = load_model_config(model)
    except StrictDataclassError as error:
        # transformers validates each config field's type: a config.json that breaks one (beyond a whole number for a
        # float, which load.read_pretrained_config reads as that float) is the user's to correct, and the field's
        # name and the reason are on the message's two lines.
        raise ConfigError(
            f"model.name_or_path: {model.name_or_path}: transformers refuses its config.json "
            f"({first_and_last_line(error)}); correct that value in the config.json"
        ) from None
    except (OSError, ValueError, KeyError) as error:
        if out_of_reach is not None:
            raise ConfigError(
                not_cached_line("model.name_or_path", model.name_or_path, out_of_reach, "set model.name_or_path to it")
            ) from None
        raise ConfigError(
            f"model.name_or_path: {model.name_or_path} is not a model this machine can read ({first_line(error)})"
        ) from None
    if out_of_reach is not None:
        say_the_cache_serves(out_of_reach)
    return model_config


def check_model_config(config: Config, model_config: PretrainedConfig) -> PretrainedConfig:
    """The text config of ``model_config``, once it is known to describe a causal LM that takes
    ``data.max_length`` tokens and a loss as ``config`` computes it."""
    model = config.model
    remote = "AutoModelForCausalLM" in (getattr(model_config, "auto_map", None) or {})
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        architectures = ", ".join(getattr(model_config, "architectures", None) or []) or "no architectures listed"
        raise ConfigError(
            f"model.name_or_path: {model.name_or_path} is a {model_config.model_type!r} model ({architectures}), "
            "not a causal language model: AutoModelForCausalLM cannot load it"
        )
    text_config = model_config.get_text_config()
    built_for = model_positions(text_config)
    if built_for is not None and config.data.max_length > built_for[1]:
        key, positions = built_for
        raise ConfigError(
            f"data.max_length: {config.data.max_length} tokens is beyond the {positions} positions "
            f"{model.name_or_path} was built for ({key}); set data.max_length to at most {positions}"
        )
    for key, value, chunked in (("model.liger_kernel", config.model.liger_kernel, False),
                                ("training.loss_chunk_tokens", config.training.loss_chunk_tokens, True)):  # fmt: skip
        transforms = logit_transforms(text_config, chunked=chunked)
        if transforms and value and value != "auto":  # auto takes the standard loss for such a model
            raise ConfigError(
                f"{key}: not for {model.name_or_path}: it transforms its logits after the LM head "
                f"({', '.join(transforms)}), which a fused or chunked loss would skip; turn {key} off"
            )
    return text_config


def model_positions(text_config: PretrainedConfig) -> tuple[str, int] | None:
    """The number of positions the model was built for, and the config key that says so; None where none does."""
    for key in POSITION_KEYS:
        positions = getattr(text_config, key, None)
        if isinstance(positions, int) and positions > 0:
            return key, positions
    return None


def check_weights(config: Config) -> str:
    """A local pretrained model has its weights: a weight file at all, every file its safetensors index lists,
    and every safetensors file whole (its header reads and the file is as long as the header says). A
    download or copy cut short fails here, naming what is missing, instead of deep inside ``from_pretrained``."""
    model = config.model
    path = Path(model.name_or_path).expanduser()
    if model.init != "pretrained" or not looks_local(model.name_or_path) or not path.is_dir():
        return "not checked (random init, or weights from the hub)"
    files = weight_files(path)
    # Without these, from_pretrained fails after the run has started (a traceback on rank 0, the others waiting).
    if not files:
        raise ConfigError(
            f"model.name_or_path: {path} holds no weights (no *.safetensors or pytorch_model*.bin file); download "
            "or copy the model's weight files into it, or set model.init: random to train from random weights"
        )
    absent = [file.name for file in files if not file.is_file()]
    if absent:
        raise ConfigError(
            f"model.name_or_path: {path} lacks {len(absent)} of its {len(files)} weight files (first: {absent[0]}, "
            "listed by its index); download or copy the model again"
        )
    files = [file for file in files if file.suffix == ".safetensors"]
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            raise ConfigError(f"model.name_or_path: {file} {problem}; download or copy the model again")
    return f"{len(files)} safetensors file(s) whole"


def weight_files(path: Path) -> list[Path]:
    """The weight files of the local model directory ``path``: those it holds, and every shard its safetensors
    index lists, there or not (one missing is a download or copy cut short)."""
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(
                f"model.name_or_path: {index} is not a safetensors index (no weight_map); download or copy it again"
            ) from None
        files = sorted({*files, *(path / shard for shard in shards)})
    return files


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None. Reads the header only: 8 bytes of header
    length, the JSON header, then the tensors, whose last byte the header's offsets give."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"is not a safetensors file: {size} bytes, shorter than a header"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return f"is truncated or not a safetensors file: its header claims {length} bytes of {size}"
            header = json.loads(handle.read(length))
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except (ValueError, UnicodeDecodeError):
        return "is not a safetensors file: its header is not JSON"
    if not isinstance(header, dict):
        return "is not a safetensors file: its header is not a JSON object"
    tensors = [entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)]
    ends = [entry["data_offsets"][1] for entry in tensors if len(entry.get("data_offsets", [])) == 2]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return (
            f"is {'truncated' if size < expected else 'longer than its header says'}: {size} bytes, expected {expected}"
        )
    return None


def check_precision(config: Config, device: torch.device) -> str:
    from shardtune.model.load import resolve_dtype

    dtype = resolve_dtype(config.model.dtype, device)
    return f"model.dtype {config.model.dtype}: {str(dtype).removeprefix('torch.')} on {device.type}"


def check_kernels(config: Config, device: torch.device, model_config: PretrainedConfig | None, world_size: int) -> str:
    """The attention implementation, liger-kernel, the grouped GEMM and the CUDA graphs the config asks for can
    run here, on ``world_size`` ranks, for the model of ``model_config`` (None: the model check has failed)."""
    from shardtune.distributed.strategy import settled_strategy
    from shardtune.model.grouped_gemm import resolve_grouped_gemm
    from shardtune.model.load import supported_attention, training_attention_choice

    chosen, fallbacks = training_attention_choice(config, device)
    # The attention the model is built with (GPT-OSS's padded rows on a GPU: FlexAttention, it has no sdpa)
    attention = (
        supported_attention(model_config, config.model.attn_implementation, chosen, fallbacks)
        if model_config
        else chosen
    )
    if config.model.liger_kernel and model_config:
        from shardtune.model.liger import check_liger_kernel

        check_liger_kernel(device, model_config.model_type)
    if config.model.grouped_gemm == "quack":  # asked for by name: it must run here (auto falls back)
        resolve_grouped_gemm("quack", device)
    float8 = config.model.float8_keys
    if float8:
        from shardtune.model.float8 import require_float8

        require_float8(float8, device)
    # The device, compile and attention, known now; so is the strategy, unless auto chooses it on several ranks once
    # the model is built (`parallelize` asks again then).
    settled = settled_strategy(config, world_size)
    config.parallel.graphs_on(
        device.type, settled[0] if settled else "auto", config.data.batch_length is not None, attention,
        config.data.packing,
    )  # fmt: skip
    found = f"attention {attention}" + (", liger-kernel" if config.model.liger_kernel else "")
    found += "".join(f", {key.removeprefix('model.').replace('_', ' ')}" for key in float8)
    found += ", quack grouped GEMM" if config.model.grouped_gemm == "quack" else ""
    return found + (", CUDA graphs" if config.parallel.cuda_graphs is True else "")


def check_writable(key: str, directory: Path) -> str:
    """``directory`` can be written, or created (a file is written and removed in it, or in its nearest
    existing parent, where the run would create it): nothing is left behind either way."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        probe = existing / f".shardtune-probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"shardtune preflight\n")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"{key}: cannot write {directory} ({error.strerror or error}); set {key} to a directory this user "
            "can create and write (on every node)"
        ) from None
    return f"{directory} is writable"


def preflight_checks(config: Config, device: torch.device, world_size: int) -> list[tuple[str, Callable[[], str]]]:
    """The checks of a run on ``world_size`` ranks that need no data, no weights and no other process, each named,
    each raising an ``InputError`` that names the key and what to do, and returning what it found otherwise."""
    model_config: list[PretrainedConfig] = []

    def model() -> str:
        text_config = check_model(config)
        model_config.append(text_config)
        return f"{config.model.name_or_path}: {text_config.model_type}, a causal LM"

    def kernels() -> str:
        return check_kernels(config, device, model_config[0] if model_config else None, world_size)

    def expert_parallel() -> str:
        return check_expert_groups(config, device, world_size) if model_config else "not checked (no model config)"

    return [
        ("model config", model),
        # A directory that holds no causal LM has no weights worth naming.
        ("weights", lambda: check_weights(config) if model_config else "not checked (no model config)"),
        ("precision", lambda: check_precision(config, device)),
        ("kernels", kernels),
        *([("expert parallel", expert_parallel)] if config.parallel.expert_parallel_size > 1 else []),
        ("logging", lambda: check_logging_packages(config)),
        ("output dir", lambda: check_writable("training.output_dir", Path(config.training.output_dir))),
        ("cache dir", lambda: check_writable("data.cache_dir", config.data.resolved_cache_dir)),
    ]


def check_expert_groups(config: Config, device: torch.device, world_size: int) -> str:
    """``parallel.expert_parallel_size`` against the routed experts of the model, built on the meta device: an
    MoE model whose every MoE layer's experts split evenly over the EP group (``ParallelDims.check_model``, which
    training asks again of the built model). Checked here, before the run writes anything, as it costs a build
    on the meta device only where expert parallelism is on."""
    from shardtune.distributed.mesh import ParallelDims
    from shardtune.doctor.report import plural
    from shardtune.plan.shape import model_shape_on

    size = config.parallel.expert_parallel_size
    shape = model_shape_on(config, device)
    ParallelDims(world_size, 0, world_size, device.type, size).check_model(
        shape.expert_counts, config.model.name_or_path
    )
    return f"groups of {size} ranks split the routed experts of {plural(len(shape.moe_layers), 'MoE layer')}"


def preflight(config: Config, device: torch.device, world_size: int) -> None:
    """Run every check of ``preflight_checks``; raise one ``ConfigError`` with a line per failed check."""
    problems: list[str] = []
    for _, check in preflight_checks(config, device, world_size):
        try:
            check()
        except InputError as error:
            problems += error.lines
    if problems:
        raise ConfigError(problems)


def check_token_ids(data: PreparedData, model_config: PretrainedConfig, config: Config, pad_id: int | None) -> None:
    """Every token id the run will feed the model (data and padding) has a row in its embedding."""
    vocab_size = getattr(model_config, "vocab_size", None)
    if not isinstance(vocab_size, int):
        return
    largest = max(
        (int(array.max()) for split in (data.train, data.eval) for array in (split.input_ids, split.targets)
         if len(array)),
        default=-1,
    )  # fmt: skip
    if largest >= vocab_size:
        raise DataError(
            f"data: the token store {data.store} holds token id {largest}, but {config.model.name_or_path} has "
            f"a vocabulary of {vocab_size} ids (0..{vocab_size - 1}): the tokenizer does not belong to this model. "
            "Use the model's own tokenizer"
        )
    if pad_id is not None and pad_id >= vocab_size:
        raise DataError(
            f"data: the tokenizer's padding id {pad_id} is outside {config.model.name_or_path}'s vocabulary of "
            f"{vocab_size} ids: the tokenizer does not belong to this model"
        )

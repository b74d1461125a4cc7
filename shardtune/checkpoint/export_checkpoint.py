"""``shardtune export``: a checkpoint's shards -> a PEFT adapter directory, or a merged HF model; a ``final/``
adapter -> a merged HF model.

Runs in one process on the CPU whatever world size wrote the checkpoint: DCP reads the shards of
every rank into whole tensors. A node-local checkpoint exports once every node's copy has been
gathered into one directory (the error names the files still missing).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardtune.checkpoint.checkpointer import read_trainable_shards
from shardtune.checkpoint.export import save_final
from shardtune.checkpoint.merge import save_merged
from shardtune.checkpoint.trained_weights import find_trained_weights, read_trained_state
from shardtune.errors import InputError
from shardtune.model.load import Precision, build_model, load_tokenizer
from shardtune.run_dir import BASE_MODEL, check_output_path

log = logging.getLogger("shardtune")


def export_checkpoint(checkpoint: Path, out: Path, merge: bool = False, overwrite: bool = False) -> str:
    """Write ``out`` from ``checkpoint`` (a checkpoint, or with ``merge`` a ``final/`` adapter); returns what was
    written, for the user. ``out`` is checked before anything loads, and written under a temporary name that
    replaces it only once complete."""
    weights = find_trained_weights(checkpoint, argument="")
    if weights.kind == "model":
        raise InputError(f"{checkpoint}: holds a full model already; from_pretrained loads it as it is")
    if weights.kind == "adapter" and not merge:
        raise InputError(f"{checkpoint}: is a PEFT adapter already; add --merge for the base model with it merged")
    config = weights.saved_config
    if config is None:
        raise InputError(f"{checkpoint}: no config.yaml in it or in its run directory names the model it adapts")
    base = Path(config.model.name_or_path)
    inputs = {checkpoint: "the input", **({base: BASE_MODEL} if base.exists() else {})}
    out = check_output_path(out, inputs, overwrite)
    tokenizer = load_tokenizer(config.model.model_copy(update={"name_or_path": str(checkpoint)}))
    # Built as training builds it, on the CPU; the checkpoint supplies the trained weights.
    cpu = torch.device("cpu")
    if config.lora.enabled and merge:
        # The merge streams the base's weights from its files and takes only the adapter from the checkpoint:
        # the model is its structure, on the meta device, unless a random init's weights are to be drawn.
        model = build_model(config, cpu, materialize=config.model.init == "random")
        state = {**model.state_dict(), **read_trained_state(weights, model, "export")}
        save_merged(model, tokenizer, out, config, state)
        return f"merged model (base {config.model.name_or_path} + LoRA adapter) in {out}"
    model = build_model(config, cpu)
    read_trainable_shards(checkpoint, model, "export")
    save_final(model, tokenizer, out, Precision.resolve(config, cpu).compute, config=config)
    if config.lora.enabled:
        return f"PEFT adapter for {config.model.name_or_path} in {out}"
    return f"model in {out}"

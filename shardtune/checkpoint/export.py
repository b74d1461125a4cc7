"""``final/``: the trained model in the formats the ecosystem loads (PEFT adapter or HF model)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import peft
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune.atomic import replace_path


def save_final(
    model: PreTrainedModel | peft.PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    dtype: torch.dtype,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the model and tokenizer under a temporary name, then rename: ``out_dir`` is never partial.

    A LoRA model saves only its adapter (``adapter_model.safetensors`` + ``adapter_config.json``).
    A fully fine-tuned model saves its weights in ``dtype`` (the model's configured dtype), not in
    the fp32 of its master weights, so it is the size users expect. ``state_dict`` is the full
    state of a sharded model, gathered by the caller; by default the model's own.
    """
    state_dict = state_dict if state_dict is not None else model.state_dict()
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    # Training turned the KV cache off; the exported model is for generation, which wants it.
    use_cache, base.config.use_cache = base.config.use_cache, True
    try:
        if isinstance(model, peft.PeftModel):
            model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        else:
            state = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
            # Large models are split into safetensors shards with an index, as the hub does.
            model.save_pretrained(staging, state_dict=state, safe_serialization=True, max_shard_size="5GB")
            # save_pretrained records the dtype of the fp32 master weights; record the saved one.
            config_path = staging / "config.json"
            saved_config = json.loads(config_path.read_text())
            saved_config["dtype"] = str(dtype).removeprefix("torch.")
            config_path.write_text(json.dumps(saved_config, indent=2, sort_keys=True) + "\n")
    finally:
        base.config.use_cache = use_cache
    tokenizer.save_pretrained(staging)
    replace_path(staging, out_dir)

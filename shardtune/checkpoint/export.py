"""``final/``: the trained model in the formats the ecosystem loads (PEFT adapter or HF model)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import peft
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune.atomic import staged_directory
from shardtune.config import Config, dump_config, load_config, looks_local


def portable_model_name(name_or_path: str) -> str:
    """The base model as any directory can name it: a local path made absolute, a hub id as given."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if looks_local(name_or_path) and path.is_dir() else name_or_path


# Shards of a full model that shardtune writes itself, as the hub splits large models.
MAX_SHARD_SIZE = "5GB"


def saved_run_config(directory: Path) -> Config | None:
    """The config a ``final/`` (or an export) was trained with: its own ``config.yaml``, else its run's."""
    for candidate in (directory / "config.yaml", directory.parent / "config.yaml"):
        if candidate.is_file():
            return load_config(candidate, check_paths=False)
    return None


@contextlib.contextmanager
def checkpoint_wrappers_removed(model: torch.nn.Module) -> Iterator[None]:
    """The model without activation checkpointing's wrappers, for as long as the context lasts. PEFT picks
    an adapter's tensors out of a state dict by the names of the modules holding them; state dicts leave
    the wrapper out of their names, module names keep it, and PEFT would find nothing to save."""
    removed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_checkpoint_wrapped_module", None)
            if inner is not None:
                parent._modules[name] = inner
                removed.append((parent, name, child))
    try:
        yield
    finally:
        for parent, name, child in removed:
            parent._modules[name] = child


def save_final(
    model: PreTrainedModel | peft.PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    dtype: torch.dtype,
    state_dict: dict[str, torch.Tensor] | None = None,
    config: Config | None = None,
) -> None:
    """Write the model and tokenizer under a temporary name, then rename: ``out_dir`` is never partial, and an
    error or Ctrl-C leaves nothing half-written beside it.

    A LoRA model saves only its adapter (``adapter_model.safetensors`` + ``adapter_config.json``),
    whose ``base_model_name_or_path`` is absolute for a local base, so the adapter loads from any
    directory. A fully fine-tuned model saves its weights in ``dtype`` (the model's configured
    dtype), not in the fp32 of its master weights, so it is the size users expect. ``state_dict`` is
    the full state of a sharded model, gathered by the caller; by default the model's own. ``config``,
    the run's, is saved as ``config.yaml`` (its model path made portable the same way): ``generate``
    renders prompts in its data format, ``eval`` checks a config against it.
    """
    state_dict = state_dict if state_dict is not None else model.state_dict()
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    with staged_directory(out_dir) as staging:
        # Training turned the KV cache off; the exported model is for generation, which wants it.
        use_cache, base.config.use_cache = base.config.use_cache, True
        try:
            if isinstance(model, peft.PeftModel):
                with checkpoint_wrappers_removed(model):
                    model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
                adapter_config_path = staging / "adapter_config.json"
                adapter_config = json.loads(adapter_config_path.read_text())
                base_name = adapter_config.get("base_model_name_or_path")
                if base_name:
                    adapter_config["base_model_name_or_path"] = portable_model_name(base_name)
                adapter_config_path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
            else:
                state = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
                model.save_pretrained(staging, state_dict=state, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
                # save_pretrained records the dtype of the fp32 master weights; record the saved one.
                config_path = staging / "config.json"
                saved_config = json.loads(config_path.read_text())
                saved_config["dtype"] = str(dtype).removeprefix("torch.")
                config_path.write_text(json.dumps(saved_config, indent=2, sort_keys=True) + "\n")
        finally:
            base.config.use_cache = use_cache
        tokenizer.save_pretrained(staging)
        if config is not None:
            write_run_config(staging, config, adapter=isinstance(model, peft.PeftModel))


def write_run_config(directory: Path, config: Config, adapter: bool) -> None:
    """The run's config as ``directory/config.yaml``, its model path made portable (``portable_model_name``).
    ``adapter``: the directory holds a LoRA adapter; a full model (full fine-tuning, or a merged adapter) says
    ``lora.enabled: false``, since nothing is to be added to it (and ``training.merge_final: false``, which
    needs an adapter: the config must load for ``generate`` and ``eval``)."""
    model_section = config.model.model_copy(update={"name_or_path": portable_model_name(config.model.name_or_path)})
    lora = config.lora.model_copy(update={"enabled": adapter})
    training = config.training.model_copy(update={"merge_final": config.training.merge_final and adapter})
    saved = config.model_copy(update={"model": model_section, "lora": lora, "training": training})
    (directory / "config.yaml").write_text(dump_config(saved))

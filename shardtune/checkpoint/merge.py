"""``final-merged/`` (``training.merge_final``) and ``shardtune export --merge``: the base model's own files with
the LoRA adapter merged into them.

The merge streams the base's safetensors: it reads one file, adds every adapter delta that lands in it,
writes it under the same name and frees it before reading the next. Host memory holds one shard (and one
delta) beyond what the caller already holds, whatever the model's size, and the result has the base's
layout: the same files, index, tensor names and dtypes, loadable by ``from_pretrained``.

The arithmetic is PEFT's ``merge_and_unload`` (``peft/tuners/lora/layer.py``), so the merged model computes
what ``PeftModel.from_pretrained(base, final/).merge_and_unload()`` computes:

- a LoRA layer on a linear layer (``lora.Linear``) adds ``(B @ A) * scaling`` (transposed for GPT-2's
  ``Conv1D``, which stores ``(in, out)``: PEFT's ``fan_in_fan_out``), computed in fp32, into the stored
  weight; ``weight += delta`` rounds once, to the weight's dtype;
- an adapter on a parameter (PEFT's ``target_parameters``, a ``ParamWrapper``: fused routed experts, a
  router's bare weight) keeps one rank-r block per expert: lora_A ``(r * E, in)`` holds A_e in rows
  ``e*r .. (e+1)*r``, lora_B ``(out, r * E)`` holds B_e in columns ``e, e + E, ...``; expert e's delta is
  ``B_e @ A_e * scaling``, which PEFT casts to the weight's dtype before adding it. A shared expert adapter
  (``lora.shared_expert_adapter``) is saved in this layout with equal blocks and merges the same way.

The scaling is each layer's own (``lora_alpha / r``). A weight that transformers converts as it loads
(per-expert tensors of the files fused into one 3-D parameter, renamed modules) receives its delta through
transformers' reverse conversion, the one ``save_pretrained`` writes the files with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer, ParamWrapper
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from shardtune.atomic import staged_directory
from shardtune.checkpoint.checkpointer import without_wrappers
from shardtune.checkpoint.export import MAX_SHARD_SIZE, write_run_config
from shardtune.config import Config, ModelConfig, looks_local
from shardtune.errors import InputError

# What PEFT puts before the base model's names (``PeftModel.base_model.model``), and its name for the module a
# LoRA layer wraps: neither is part of the base model's own names.
PEFT_PREFIX = "base_model.model."
PEFT_WRAPPED = "base_layer"


def base_model_name(name: str) -> str:
    """A PEFT model's state-dict or module name as the base model names it."""
    return ".".join(part for part in name.removeprefix(PEFT_PREFIX).split(".") if part != PEFT_WRAPPED)


@dataclass(frozen=True)
class LoraDelta:
    """One weight of the base model that the adapter changes, and how PEFT computes the change."""

    weight: str  # its name in the transformers model (model.layers.1.mlp.experts.gate_up_proj)
    shape: tuple[int, ...]
    lora_a: str  # the adapter's tensors, by state-dict name
    lora_b: str
    scaling: float
    fan_in_fan_out: bool
    experts: int  # 0: a LoRA layer on a module (lora.Linear); else a ParamWrapper's expert count (1: a 2-D weight)
    experts_out_first: bool  # a 3-D expert weight stored (experts, out, in), as transformers stores them

    def compute(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The delta in fp32 on the CPU, laid out as the weight (PEFT's ``get_delta_weight``, op for op)."""
        a = state[self.lora_a].detach().to("cpu", torch.float32)
        b = state[self.lora_b].detach().to("cpu", torch.float32)
        if self.experts > 1:
            a = a.reshape(self.experts, -1, a.shape[-1])  # (experts, rank, in)
            b = b.reshape(b.shape[0], -1, self.experts)  # (out, rank, experts)
            layout = "o r e, e r i -> e o i" if self.experts_out_first else "o r e, e r i -> e i o"
            return torch.einsum(layout, b, a) * self.scaling
        product = b @ a
        return (product.T if self.fan_in_fan_out else product) * self.scaling

    def add_to(self, weight: torch.Tensor, delta: torch.Tensor) -> None:
        # PEFT's merge: lora.Linear adds the fp32 delta into the weight (the sum in fp32, rounded once to the
        # weight's dtype); ParamWrapper casts the delta to the weight's dtype first.
        weight += delta if self.experts == 0 else delta.to(weight.dtype)


def lora_deltas(model: peft.PeftModel) -> list[LoraDelta]:
    """Every weight ``model``'s active adapter changes. ``model`` gives the structure only (its weights may be
    sharded or on the meta device); its wrappers (activation checkpointing, compile) are looked through."""
    adapter = model.active_adapter
    deltas = []
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.r:  # r: every LoRA layer kind has one
            continue
        name = without_wrappers(path)
        if isinstance(module, ParamWrapper):
            weight, parameter, experts = module.get_param(), module.parameter_name, module.num_experts
        elif isinstance(module, LoraLinear):
            weight, parameter, experts = module.get_base_layer().weight, "weight", 0
        else:
            raise InputError(
                f"lora.target_modules: {base_model_name(name)} is a {type(module).__name__} LoRA layer; "
                "merging adds adapters of linear layers and of expert or router weights only"
            )
        deltas.append(
            LoraDelta(
                weight=f"{base_model_name(name)}.{parameter}",
                # The whole layer's experts: under expert parallelism a rank holds a run of them.
                shape=(experts, *weight.shape[1:]) if experts > 1 else tuple(weight.shape),
                lora_a=f"{name}.lora_A.{adapter}.weight",
                lora_b=f"{name}.lora_B.{adapter}.weight",
                scaling=module.scaling[adapter],
                fan_in_fan_out=module.fan_in_fan_out,
                experts=experts,
                experts_out_first=experts > 1 and module._did_swap_in_out_features,
            )
        )
    return deltas


@dataclass(frozen=True)
class BaseFiles:
    """A ``from_pretrained`` directory's safetensors: its files, and each tensor's file and shape."""

    directory: Path
    files: list[str]
    file_of: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    indexed: bool  # sharded, with model.safetensors.index.json

    @classmethod
    def read(cls, directory: Path) -> BaseFiles:
        """The files' headers only: no tensor is read here."""
        index = directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (directory / SAFE_WEIGHTS_NAME).is_file():
            files = [SAFE_WEIGHTS_NAME]
        else:
            raise InputError(
                f"{directory}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}: the merge reads the base "
                "model's safetensors files"
            )
        file_of, shapes = {}, {}
        for file in files:
            with safe_open(directory / file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                    file_of[key], shapes[key] = file, tuple(handle.get_slice(key).get_shape())
        return cls(directory, files, file_of, shapes, index.is_file())

    def stored_name(self, name: str, base: PreTrainedModel, shape: tuple[int, ...]) -> str | None:
        """The name under which the files hold the model's tensor ``name`` of ``shape``, or None. A file written
        from the bare base model lacks the causal LM's prefix (GPT-2's ``transformer.``), as on the hub."""
        for candidate in (name, name.removeprefix(f"{base.base_model_prefix}.")):
            if self.shapes.get(candidate) == shape:
                return candidate
        return None


@dataclass(frozen=True)
class PlacedDelta:
    """A delta and where it lands: {stored tensor name: the name of its part in ``revert_weight_conversion``'s
    output}; ``converted``: the files hold the weight in another layout (per-expert tensors of a fused weight)."""

    delta: LoraDelta
    parts: dict[str, str]
    converted: bool


def place(delta: LoraDelta, base: PreTrainedModel, files: BaseFiles) -> PlacedDelta:
    """Where in ``files`` the delta's weight is stored: as the model holds it, or as transformers' reverse
    conversion (worked out on the meta device: shapes only) writes it."""
    stored = files.stored_name(delta.weight, base, delta.shape)
    if stored is not None:
        return PlacedDelta(delta, {stored: delta.weight}, converted=False)
    converted = revert_weight_conversion(base, {delta.weight: torch.empty(delta.shape, device="meta")})
    parts = {}
    for part, tensor in converted.items():
        stored = files.stored_name(part, base, tuple(tensor.shape))
        if stored is None:
            raise InputError(
                f"{files.directory}: holds no tensor {part} {list(tensor.shape)}, where the adapter of {delta.weight} "
                "belongs: these are not the files of the model the adapter was trained on"
            )
        parts[stored] = part
    return PlacedDelta(delta, parts, converted=True)


def merge_file(
    files: BaseFiles,
    file: str,
    placed: list[PlacedDelta],
    state: Mapping[str, torch.Tensor],
    base: PreTrainedModel,
    out: Path,
) -> None:
    """Read one file of the base, add the deltas that land in it, write it to ``out``."""
    landing = [item for item in placed if any(files.file_of[stored] == file for stored in item.parts)]
    with safe_open(files.directory / file, framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        metadata = handle.metadata()
    for item in landing:
        delta = item.delta.compute(state)
        if item.converted:
            # The delta is converted to the files' layout rather than the files to the model's: the per-expert
            # tensors of one fused weight may lie in several files.
            parts = revert_weight_conversion(base, {item.delta.weight: delta})
        else:
            parts = {item.delta.weight: delta}
        for stored, part in item.parts.items():
            if files.file_of[stored] == file:
                item.delta.add_to(tensors[stored], parts[part])
    save_file(tensors, out / file, metadata=metadata)


def base_weights_dir(model: ModelConfig) -> Path:
    """The directory that holds the base's safetensors: the local model directory, or for a hub id its
    snapshot in the local Hugging Face cache, where training's ``from_pretrained`` put it (nothing is
    downloaded here)."""
    if looks_local(model.name_or_path):
        return Path(model.name_or_path).expanduser()
    for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
        cached = try_to_load_from_cache(model.name_or_path, name, revision=model.revision)
        if isinstance(cached, str):
            return Path(cached).parent
    raise InputError(
        f"model.name_or_path: {model.name_or_path} has no safetensors weights in the Hugging Face cache "
        f"({hub_constants.HF_HUB_CACHE}), which the merge reads"
    )


def save_random_base(
    model: peft.PeftModel, state: Mapping[str, torch.Tensor], deltas: list[LoraDelta], out: Path
) -> Path:
    """A random init's base weights (the run's, from ``state``) as a ``from_pretrained`` directory, for the
    merge to read as it reads a pretrained base's files. Written as the model holds them (no reverse
    conversion): every delta then lands on a stored tensor of its own name."""
    adapter = {name for delta in deltas for name in (delta.lora_a, delta.lora_b)}
    weights = {base_model_name(name): tensor for name, tensor in state.items() if name not in adapter}
    model.get_base_model().save_pretrained(
        out, state_dict=weights, max_shard_size=MAX_SHARD_SIZE, save_original_format=False
    )
    return out


def save_merged(
    model: peft.PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    config: Config,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Write ``out_dir``, the base model with ``model``'s LoRA adapter merged (a ``from_pretrained``
    directory: the base's weight files and index, its ``config.json`` and generation config, the tokenizer,
    the run's ``config.yaml`` with ``lora.enabled: false``), under a temporary name renamed into place once
    complete. Returns its size in bytes.

    ``state_dict`` holds the trained tensors, whole, by the model's state-dict names (by default the model's
    own): the adapter's, and for ``model.init: random``, whose weights are in no file, the base's too.
    """
    state = state_dict if state_dict is not None else model.state_dict()
    deltas = lora_deltas(model)
    base = model.get_base_model()
    with staged_directory(out_dir) as staging:
        staging.mkdir(parents=True)
        random_init = config.model.init == "random"
        if random_init:
            base_dir = save_random_base(model, state, deltas, staging / ".base")
        else:
            base_dir = base_weights_dir(config.model)
        files = BaseFiles.read(base_dir)
        placed = [place(delta, base, files) for delta in deltas]
        for file in files.files:
            merge_file(files, file, placed, state, base, staging)
        if files.indexed:  # the same tensors, shapes and dtypes in the same files: the index still holds
            shutil.copyfile(base_dir / SAFE_WEIGHTS_INDEX_NAME, staging / SAFE_WEIGHTS_INDEX_NAME)
        model_config = json.loads((base_dir / "config.json").read_text())
        model_config["use_cache"] = True  # training turned the KV cache off; generation wants it
        (staging / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
        if (base_dir / "generation_config.json").is_file():
            shutil.copyfile(base_dir / "generation_config.json", staging / "generation_config.json")
        tokenizer.save_pretrained(staging)
        write_run_config(staging, config, adapter=False)
        if random_init:
            shutil.rmtree(base_dir)
    return sum(path.stat().st_size for path in out_dir.rglob("*") if path.is_file())

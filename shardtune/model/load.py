"""Load the tokenizer and the model (pretrained weights or a seeded random init) in the right dtype.

``build_model`` is the one way a command gets its model: training, ``doctor``'s estimates, ``export``
and evaluation all build it the same way, with the same dtypes, attention and LoRA adapters.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
from dataclasses import dataclass

import peft
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from shardtune.config import Config, ModelConfig
from shardtune.errors import ConfigError
from shardtune.hub import use_the_cache_if_the_hub_is_out_of_reach
from shardtune.model.fused_moe import TRANSFORMERS_IMPLEMENTATIONS

log = logging.getLogger(__name__)

# The class attribute by which a transformers model says it runs an attention implementation; eager
# runs everywhere.
ATTENTION_SUPPORT = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def resolve_dtype(name: str, device: torch.device, bf16_supported: bool | None = None) -> torch.dtype:
    """``auto`` is bf16 on GPUs that support it and fp32 everywhere else (CPUs emulate bf16 slowly).

    ``bf16_supported``: whether ``device`` does, for a GPU that is not this machine's (``shardtune plan``
    sizes runs for GPUs it does not have); None asks this machine's."""
    if bf16_supported is None:
        bf16_supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_supported else torch.float32
    if name == "bfloat16" and device.type == "cuda" and not bf16_supported:
        raise ConfigError(f"model.dtype: bfloat16 is not supported by {torch.cuda.get_device_name(device)}")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


@dataclass(frozen=True)
class Precision:
    """How numbers are stored and computed.

    Frozen weights are stored in the compute dtype (half the memory in bf16). Trainable weights are
    fp32 master copies (LoRA adapters via PEFT, all weights in full fine-tuning) and the forward pass
    autocasts to bf16, so updates smaller than bf16's resolution are not rounded away. Full weights in
    ``final/`` and exports are written in the compute dtype.
    """

    compute: torch.dtype
    frozen_storage: torch.dtype
    autocast: torch.dtype | None

    @classmethod
    def resolve(cls, config: Config, device: torch.device, bf16_supported: bool | None = None) -> Precision:
        """On ``device`` (``bf16_supported``: as ``resolve_dtype``)."""
        compute = resolve_dtype(config.model.dtype, device, bf16_supported)
        bf16 = config.training.bf16 if config.training.bf16 is not None else compute == torch.bfloat16
        if compute == torch.bfloat16 and not bf16:
            raise ConfigError("training.bf16: false contradicts model.dtype: bfloat16; set one of them differently")
        if bf16:
            compute = torch.bfloat16
        storage = compute if config.lora.enabled else torch.float32
        return cls(compute, storage, torch.bfloat16 if bf16 else None)


def training_attention(config: Config, device: torch.device) -> str:
    """What ``model.attn_implementation: auto`` means for a training run on ``device``.

    Packed sequences need each example isolated from the others. sdpa gets that through a materialized
    mask, which sends it to a slower kernel (on one H100, Mistral-7B at the seed's seq 512 on alpaca-like
    data: 0.325 s per step); FlexAttention skips the masked blocks (0.137 s). Without packing (one
    example per sequence, or padding) plain causal sdpa is the fastest kernel. FlexAttention's kernels are
    Triton's, for GPUs.
    """
    chosen = config.model.attn_implementation
    if chosen == "flash_attention_2":
        # Checked here, before any weight is read: transformers would only fail inside from_pretrained.
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed: "
                "pip install flash-attn, or set model.attn_implementation: sdpa"
            )
        if device.type != "cuda":
            raise ConfigError(
                "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only; set model.attn_implementation: "
                "sdpa on this machine"
            )
    if chosen == "flex_attention" and device.type != "cuda":
        # torch's FlexAttention computes no backward on CPU: training would end in its traceback at the first step.
        raise ConfigError(
            "model.attn_implementation: flex_attention trains on CUDA GPUs only (torch's FlexAttention has no "
            "backward on CPU); set model.attn_implementation: sdpa or auto on this machine"
        )
    if chosen != "auto":
        return chosen
    return "flex_attention" if config.data.packing and device.type == "cuda" else "sdpa"


# What ``auto`` falls back to, best first, where an architecture does not run its choice: in training on a GPU,
# FlexAttention before eager attention, which keeps each sequence's heads x S x S scores (GPT-OSS, which has no sdpa,
# outside packed rows: gpt-oss-20b at seq 4,096 on one H200, 5,917 tokens/s eager with 17 layers' attention recomputed)
GPU_TRAINING_FALLBACKS = ("sdpa", "flex_attention", "eager")
FALLBACKS = ("sdpa", "eager")


def training_attention_choice(config: Config, device: torch.device) -> tuple[str, tuple[str, ...]]:
    """What ``attn_implementation: auto`` asks for in training on ``device`` (``training_attention``) and what it falls
    back to where the architecture does not run that: ``supported_attention``'s ``chosen`` and ``fallbacks``."""
    return training_attention(config, device), GPU_TRAINING_FALLBACKS if device.type == "cuda" else FALLBACKS


def supported_attention(
    model_config: PretrainedConfig, requested: str, chosen: str, fallbacks: tuple[str, ...] = FALLBACKS
) -> str:
    """``requested`` (``model.attn_implementation``) resolved to ``chosen`` for ``auto``, or to the first of
    ``fallbacks`` the architecture runs when it does not run ``chosen`` (Gemma-2 has no sdpa, GPT-2 no
    FlexAttention). A choice the user named and the architecture lacks is a config error."""
    if attention_runs(model_config, chosen):
        return chosen
    if requested != "auto":
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
        cap = attention_cap(model_config) if chosen == "sdpa" else None
        capped = f" with capped attention scores (attn_logit_softcapping: {cap})" if cap is not None else ""
        raise ConfigError(
            f"model.attn_implementation: {model_class.__name__} does not run {chosen}{capped}; set it to auto"
        )
    return next(name for name in fallbacks if attention_runs(model_config, name))


def attention_runs(model_config: PretrainedConfig, name: str) -> bool:
    """Whether the architecture of ``model_config`` runs attention ``name`` (GPT-OSS has no sdpa: its sinks; nor has a
    model whose attention scores are capped, ``attention_cap``); remote code is taken to (its own class says what it
    runs, at load time)."""
    if name == "sdpa" and attention_cap(model_config) is not None:
        return False
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    if model_class is None or name not in ATTENTION_SUPPORT:
        return True
    return bool(getattr(model_class, ATTENTION_SUPPORT[name], False))


def attention_cap(model_config: PretrainedConfig) -> float | None:
    """The cap tanh puts on the attention scores (Gemma 2's ``attn_logit_softcapping``: 50), which sdpa's kernels do
    not apply. transformers 5.17 lets Gemma 2 take sdpa all the same and drops the cap without a word: the model
    trained would not be the model (later versions mark Gemma 2 as having no sdpa, and raise for another model so
    configured)."""
    return getattr(model_config.get_text_config(), "attn_logit_softcapping", None)


def check_experts_implementation(model_config: PretrainedConfig, requested: str | None) -> None:
    """A choice among transformers' own experts (``model.experts_implementation: grouped_mm`` or ``batched_mm``)
    needs an architecture whose experts offer them (Llama 4's and Phi-3.5-MoE's do not); else a config error
    instead of transformers' traceback at load time."""
    if requested not in ("grouped_mm", "batched_mm"):
        return
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    if model_class is not None and not model_class._can_set_experts_implementation():
        raise ConfigError(
            f"model.experts_implementation: {model_class.__name__} has no {requested} experts in transformers; "
            "set it to auto (shardtune's fused block, where it runs) or eager"
        )


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    use_the_cache_if_the_hub_is_out_of_reach(config.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(
        config.name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
    )
    if tokenizer.pad_token_id is None:
        # Padded positions are masked out of attention and loss, so any id works; EOS is always there.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(config: ModelConfig) -> PretrainedConfig:
    use_the_cache_if_the_hub_is_out_of_reach(config.name_or_path)
    return read_pretrained_config(
        config.name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
    )


_WHOLE_NUMBERS_SAID: set[str] = set()


def read_pretrained_config(name_or_path, **options) -> PretrainedConfig:
    """``AutoConfig.from_pretrained(name_or_path, **options)``, where a whole number stands in config.json for a
    field transformers' typed config takes as a float only (DBRX's published config gives
    ``moe_normalize_expert_weights`` as 1, which transformers refuses: huggingface_hub's StrictDataclassError) is read
    as that float, with one log line a model. Any other refusal is raised as it was."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return AutoConfig.from_pretrained(name_or_path, **options)
    except StrictDataclassError:
        reading = {key: options[key] for key in ("revision", "local_files_only") if key in options}
        values, _ = PretrainedConfig.get_config_dict(name_or_path, **reading)
        model_type = values.get("model_type")
        if model_type not in CONFIG_MAPPING or "auto_map" in values:
            raise
        config_class = CONFIG_MAPPING[model_type]  # a lazy mapping: its get() answers None
        if not (read := _floats_for_whole_numbers(config_class, values)):
            raise
    config = config_class.from_dict(values)
    if str(name_or_path) not in _WHOLE_NUMBERS_SAID:
        _WHOLE_NUMBERS_SAID.add(str(name_or_path))
        log.warning(
            "%s: config.json gives %s as whole numbers, which transformers takes as floats only: read as floats",
            name_or_path,
            ", ".join(read),
        )
    return config


def _floats_for_whole_numbers(config_class: type, values: dict) -> list[str]:
    """Turn each int of ``values`` (a config.json's dict, changed in place) whose field ``config_class`` types as a
    float and not an int into that float, in its sub-configs' dicts too; returns the keys it turned (dotted)."""
    if not dataclasses.is_dataclass(config_class):
        return []
    types = {field.name: str(field.type) for field in dataclasses.fields(config_class)}
    turned = []
    for key, value in values.items():
        sub_config = getattr(config_class, "sub_configs", {}).get(key)
        if isinstance(value, dict) and dataclasses.is_dataclass(sub_config):
            turned += [f"{key}.{name}" for name in _floats_for_whole_numbers(sub_config, value)]
        elif type(value) is int and key in types:
            # An annotation as written ("float | None") or as a type ("<class 'float'>").
            named = set(re.findall(r"\b(float|int)\b", types[key]))
            if named == {"float"}:
                values[key] = float(value)
                turned.append(key)
    return turned


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    seed: int,
    materialize: bool = True,
    random_init_device: torch.device | None = None,
    auto_attention: str = "sdpa",
    model_config: PretrainedConfig | None = None,
    attention_fallbacks: tuple[str, ...] = FALLBACKS,
) -> PreTrainedModel:
    """The causal LM on the CPU with weights stored in ``dtype``.

    ``materialize=False`` builds the architecture on the meta device (no memory, no disk reads): the
    weights of such a replica come later from the rank that did load them. Random weights
    (``init: random``) are drawn on ``random_init_device`` when given: a GPU draws tens of billions in
    seconds where a CPU takes minutes (the values then depend on the device type, not on the world size).
    ``auto_attention`` is what ``attn_implementation: auto`` asks for (``supported_attention``): plain
    sdpa outside training (export, evaluation of padded examples), and ``attention_fallbacks`` what it takes where
    the architecture does not run that (``GPU_TRAINING_FALLBACKS`` in training on a GPU). ``model_config``: the
    architecture's config when it is not read from ``config.name_or_path`` (``shardtune plan``'s shapes of hub
    models).
    """
    model_config = model_config or load_model_config(config)
    requested = config.attn_implementation
    chosen = auto_attention if requested == "auto" else requested
    attention = supported_attention(model_config, requested, chosen, attention_fallbacks)
    log.info("attention: %s", attention)
    check_experts_implementation(model_config, config.experts_implementation)
    common = {
        "dtype": dtype,
        "attn_implementation": attention,
        "trust_remote_code": config.trust_remote_code,
        # fused (and auto) blocks are swapped in by training (shardtune.model.fused_moe); other uses of
        # the model run transformers' default.
        **(
            {"experts_implementation": config.experts_implementation}
            if config.experts_implementation in TRANSFORMERS_IMPLEMENTATIONS
            else {}
        ),
    }
    if config.init == "random" or not materialize:
        torch.manual_seed(seed)
        with torch.device((random_init_device or "cpu") if materialize else "meta"):
            model = AutoModelForCausalLM.from_config(model_config, **common)
    else:
        use_the_cache_if_the_hub_is_out_of_reach(config.name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            config.name_or_path, config=model_config, revision=config.revision, **common
        )
    # Training never reuses past key/values; a cache would also break packed-sequence isolation.
    model.config.use_cache = False
    return model


def build_model(
    config: Config,
    device: torch.device,
    *,
    training: bool = False,
    materialize: bool = True,
    precision: Precision | None = None,
    model_config: PretrainedConfig | None = None,
    patch_kernels: bool = True,
) -> PreTrainedModel | peft.PeftModel:
    """The model a run computes with on ``device``: loaded, kernels patched, LoRA adapters added.

    ``device`` decides what ``model.dtype: auto`` means (``Precision.resolve``): frozen weights are
    stored in ``Precision.frozen_storage``, trainable ones in fp32. Random weights (``init: random``) are
    drawn with ``training.seed`` on ``device`` when it is a GPU, else on the CPU; pretrained weights load
    onto the CPU. ``training=True`` builds it as a training run does: the attention training picks for
    packed sequences (``training_attention``) and liger-kernel when configured; otherwise plain sdpa
    for ``attn_implementation: auto`` (export, generation, evaluation of padded examples). Either way an
    architecture without the chosen kernel gets the best one it has. ``materialize=False`` builds it on
    the meta device (no weights read): what replicas that receive their weights later, and ``doctor``'s
    estimates, use. ``precision`` and ``model_config``, when given, replace what ``device`` and
    ``model.name_or_path`` would say (``shardtune plan`` builds, on the meta device, the model of GPUs and
    hub models it does not have; ``patch_kernels=False`` leaves liger's kernels out, which need not be installed
    where it plans). Returns a ``peft.PeftModel`` when ``lora.enabled``, else the transformers model.
    """
    from shardtune.model.liger import apply_liger_kernels
    from shardtune.model.lora import apply_lora

    precision = precision or Precision.resolve(config, device)
    auto_attention, fallbacks = training_attention_choice(config, device) if training else ("sdpa", FALLBACKS)
    model = load_model(
        config.model,
        precision.frozen_storage,
        config.training.seed,
        materialize=materialize,
        random_init_device=device if device.type == "cuda" else None,
        auto_attention=auto_attention,
        model_config=model_config,
        attention_fallbacks=fallbacks,
    )
    if training and patch_kernels and config.model.liger_kernel:
        apply_liger_kernels(model, device)
    return apply_lora(model, config.lora) if config.lora.enabled else model

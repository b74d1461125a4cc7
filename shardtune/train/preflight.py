"""Checks of the model and the tokenized data that stop a run before training starts.

Each would otherwise surface deep inside training, far from its cause: a tokenizer that does not
belong to the model makes an embedding lookup index out of range (on a GPU, a device-side assert that
takes the process down); ``max_length`` beyond the model's positions breaks learned position
embeddings; a directory that holds no causal LM fails inside ``from_pretrained`` with a message about
auto classes. Every rank runs the same checks on the same inputs before its first collective, so all
ranks stop together, with the same message, and none waits in a collective for one that gave up.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardtune.config import Config
from shardtune.data.prepare import PreparedData
from shardtune.errors import ConfigError, DataError

# Where configs of different families keep the number of positions the model was built for.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_model(config: Config) -> PretrainedConfig:
    """The model's config, once it is known to describe a causal LM that takes ``data.max_length`` tokens."""
    model = config.model
    try:
        model_config = AutoConfig.from_pretrained(
            model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"model.name_or_path: {model.name_or_path} is not a model this machine can read ({first_line})"
        ) from None
    remote = "AutoModelForCausalLM" in (getattr(model_config, "auto_map", None) or {})
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        architectures = ", ".join(getattr(model_config, "architectures", None) or []) or "no architectures listed"
        raise ConfigError(
            f"model.name_or_path: {model.name_or_path} is a {model_config.model_type!r} model ({architectures}), "
            "not a causal language model: AutoModelForCausalLM cannot load it"
        )
    text_config = model_config.get_text_config()
    for key in POSITION_KEYS:
        positions = getattr(text_config, key, None)
        if isinstance(positions, int) and positions > 0:
            if config.data.max_length > positions:
                raise ConfigError(
                    f"data.max_length: {config.data.max_length} tokens is beyond the {positions} positions "
                    f"{model.name_or_path} was built for ({key}); set data.max_length to at most {positions}"
                )
            break
    return text_config


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

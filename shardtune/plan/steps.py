"""Steps per epoch of a run, from its local data, counted by the code that prepares it for training.

With the model's tokenizer on this machine (a local model directory, or the hub model in the Hugging Face
cache) the rows are read, rendered, tokenized and packed exactly as the token store would hold them (in
memory: nothing is written); without it the rows are read and chosen as training chooses them, not
tokenized, so the count of sequences is an upper bound (examples that end up too long or empty are dropped
in preparation, and packing puts several into one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from shardtune.config import Config, looks_local
from shardtune.data.sources import is_local


@dataclass(frozen=True)
class EpochSteps:
    sequences: int  # training sequences per epoch (an upper bound unless ``exact``)
    exact: bool
    how: str  # how they were counted
    steps_per_epoch: int
    total_steps: int


def local_tokenizer(config: Config) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer when this machine has it, without the network; None otherwise."""
    from transformers import AutoTokenizer

    from shardtune.model.load import load_tokenizer

    model = config.model
    try:
        if looks_local(model.name_or_path):
            return load_tokenizer(model)
        tokenizer = AutoTokenizer.from_pretrained(
            model.name_or_path,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            local_files_only=True,
        )
    except (OSError, ValueError):  # a model directory without a tokenizer, or nothing in the cache
        return None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def why_not_counted(config: Config) -> str | None:
    """Why this machine cannot count the run's sequences (hub datasets, files elsewhere), or None."""
    data = config.data
    paths = [*data.paths, *([data.eval_path] if data.eval_path else [])]
    hub = [path for path in paths if not is_local(path)]
    if hub:
        what = "is a hub dataset" if len(hub) == 1 else "are hub datasets"
        return f"{', '.join(hub)} {what} (shardtune prepare counts it)"
    missing = [path for path in paths if not Path(path).expanduser().exists()]
    if missing:
        return f"{', '.join(missing)} not found on this machine"
    return None


def epoch_steps(config: Config, world_size: int) -> EpochSteps:
    """The run's sequences, steps per epoch and steps in all on ``world_size`` GPUs (its data is local)."""
    from shardtune.data.prepare import build_splits, select_rows
    from shardtune.data.sampler import GlobalBatchSampler
    from shardtune.train.loop import total_steps_for

    tokenizer = local_tokenizer(config)
    if tokenizer is not None:
        _, summary, _ = build_splits(config, tokenizer)
        sequences = summary["train"]["sequences"]
        how = f"tokenized with {config.model.name_or_path}'s tokenizer" + (", packed" if config.data.packing else "")
        exact = True
    else:
        sequences = len(select_rows(config, None).train)
        how = f"rows counted, not tokenized: {config.model.name_or_path}'s tokenizer is not on this machine"
        exact = False
    training = config.training
    global_batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * world_size
    sampler = GlobalBatchSampler(sequences, global_batch, training.seed)
    return EpochSteps(sequences, exact, how, sampler.batches_per_epoch, total_steps_for(config, sampler))

"""Answer one prompt with a trained model: the quickest look at what fine-tuning did.

The prompt is rendered and tokenized by the code that rendered the training rows, in the data format
the run trained on (its saved ``config.yaml``): the alpaca prompt, the tokenizer's chat template (or
shardtune's layout) for ``messages``, the raw text for ``text``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from shardtune.checkpoint.export import saved_run_config
from shardtune.checkpoint.layout import is_checkpoint, what_to_name_in_a_run
from shardtune.checkpoint.trained_weights import weight_files_problem
from shardtune.config import looks_local
from shardtune.data.formats import RowError, render_generation_prompt
from shardtune.data.tokenize import ExampleTokenizer
from shardtune.errors import InputError, first_line
from shardtune.hub import not_cached_line, use_the_cache_if_the_hub_is_out_of_reach
from shardtune.train.preflight import model_positions


def load_for_inference(model_dir: str | Path, base: str | None = None) -> torch.nn.Module:
    """A ``final/`` directory as a model: PEFT adapter on its base model, or a full HF model."""
    model_dir = Path(model_dir)
    problem = weight_files_problem(model_dir)
    if problem:
        raise InputError(problem)
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.is_file():
        from peft import PeftModel

        from shardtune.model.lora import targets_as_given

        settings = json.loads(adapter_config.read_text())
        saved = saved_run_config(model_dir)
        if base is None and saved is not None and saved.model.init == "random":
            # Its base_model_name_or_path names the architecture only: the weights it trained on were drawn at
            # random, and an adapter on any others answers as if untrained.
            merged = model_dir.parent / "final-merged"
            instead = f"generate from {merged}" if merged.is_dir() else "train with training.merge_final: true"
            raise InputError(
                f"{model_dir}: an adapter trained on random weights (model.init: random), which no file holds: "
                f"{instead} (the run's weights with the adapter merged), or pass --base with the weights it trained on"
            )
        where = "--base" if base else f"base_model_name_or_path of {adapter_config}"
        base = base or settings["base_model_name_or_path"]
        if looks_local(base) and not Path(base).expanduser().is_dir():
            raise InputError(f"{where}: {base}: directory not found; pass --base with the base model's directory")
        out_of_reach = use_the_cache_if_the_hub_is_out_of_reach(base)
        try:
            base_model = AutoModelForCausalLM.from_pretrained(base)
        except (OSError, ValueError, KeyError) as error:
            if out_of_reach is not None:
                raise InputError(not_cached_line(where, base, out_of_reach, "pass --base DIR")) from None
            raise InputError(
                f"{where}: {base} is not a model this machine can read ({first_line(error)}); "
                "pass --base with the base model's directory or hub id"
            ) from None
        # Paths like mlp.shared_experts.gate_proj are shardtune's MoE targets, taken from a transformers-5
        # model: PEFT must not convert them as if written for transformers 4.
        targets = settings.get("target_modules") or []
        ours = isinstance(targets, list) and any("." in target for target in targets)
        try:
            with targets_as_given() if ours else contextlib.nullcontext():
                return PeftModel.from_pretrained(base_model, model_dir)
        except (RuntimeError, ValueError, KeyError) as error:  # e.g. shapes of another base model
            raise InputError(f"{model_dir}: the adapter does not fit {base} ({first_line(error)})") from None
    if base:
        raise InputError(f"--base {base}: {model_dir} holds a full model, not an adapter; leave --base out")
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"{model_dir}: its model cannot be loaded ({first_line(error)})") from None


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise InputError(f"{model_dir}: no such directory (name a final/ directory or an export)")
    if not (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file():
        if is_checkpoint(model_dir):
            raise InputError(
                f"{model_dir}: a training checkpoint, not a model: export it first (shardtune export {model_dir} "
                "--out DIR) and name DIR, or name the run's final/"
            )
        raise InputError(
            f"{model_dir}: neither a PEFT adapter (adapter_config.json) nor a model (config.json)"
            + what_to_name_in_a_run(model_dir, checkpoints_too=False)
        )


def data_format(model_dir: Path, given: str | None) -> str:
    """The format the model was trained on: ``--format`` when given, else the run's saved config's."""
    if given:
        return given
    saved = saved_run_config(model_dir)
    if saved is None:
        raise InputError(
            f"{model_dir}: no config.yaml in it or its parent directory to take the data format from; "
            "pass --format alpaca|messages|text"
        )
    return saved.data.format


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    format: str,
    text: str,
    input_text: str = "",
    system: str | None = None,
) -> list[int]:
    """The token ids the model reads before its answer, exactly as training tokenized such a prompt."""
    if input_text and format != "alpaca":
        raise InputError(f"--input: only alpaca-format models take an input; this one was trained on {format}")
    if system is not None and format != "messages":
        raise InputError(f"--system: a system prompt is for messages-format models; this one was trained on {format}")
    try:
        rendered = render_generation_prompt(format, tokenizer, text, input_text, system)
    except RowError as error:  # a chat template that refuses a system turn (Gemma's), say
        raise InputError(f"--system/--instruction: {error}") from None
    ids = ExampleTokenizer(tokenizer, max_length=10**9).encode_prompt(rendered)
    if not ids:  # a text-format model, and a tokenizer that puts no BOS before text: nothing to continue from
        raise InputError("--instruction: the prompt is empty (not one token); give the text to continue")
    return ids


def check_length(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the answer fit the positions the model was built for, as training's ``data.max_length`` must:
    beyond them, learned position embeddings fail to index (a traceback) and rotary ones answer nonsense."""
    built_for = model_positions(model.config.get_text_config())
    if built_for is None or prompt_tokens + max_new_tokens <= built_for[1]:
        return
    key, positions = built_for
    if prompt_tokens >= positions:
        raise InputError(
            f"--instruction: the prompt is {prompt_tokens:,} tokens, and the model was built for {positions:,} "
            f"positions ({key}): none is left for the answer; shorten it"
        )
    raise InputError(
        f"--max-new-tokens: {max_new_tokens:,} after the prompt's {prompt_tokens:,} tokens go beyond the "
        f"{positions:,} positions the model was built for ({key}); set at most {positions - prompt_tokens:,}"
    )


@torch.no_grad()
def generate_response(
    model_dir: str | Path,
    instruction: str,
    input_text: str = "",
    max_new_tokens: int = 64,
    base: str | None = None,
    system: str | None = None,
    format: str | None = None,
) -> str:
    """Greedy answer to ``instruction`` (the text to continue, for a ``text``-format model)."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: must be at least 1, got {max_new_tokens}")
    model_dir = Path(model_dir)
    _check_model_dir(model_dir)
    format = data_format(model_dir, format)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"{model_dir}: its tokenizer cannot be loaded ({first_line(error)})") from None
    ids = prompt_ids(tokenizer, format, instruction, input_text, system)
    model = load_for_inference(model_dir, base).eval()
    check_length(model, len(ids), max_new_tokens)
    input_ids = torch.tensor([ids])
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True).strip()

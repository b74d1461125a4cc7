"""Answer one instruction with a trained model: the quickest look at what fine-tuning did."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.data.alpaca import render_prompt
from shardtune.data.tokenize import ExampleTokenizer
from shardtune.errors import InputError


def load_for_inference(model_dir: str | Path, base: str | None = None) -> torch.nn.Module:
    """A ``final/`` directory as a model: PEFT adapter on its base model, or a full HF model."""
    from shardtune.train.preflight import safetensors_problem

    model_dir = Path(model_dir)
    for weights in sorted(model_dir.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise InputError(f"{weights} {problem}; export or copy it again")
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.is_file():
        from peft import PeftModel

        from shardtune.model.lora import targets_as_given

        settings = json.loads(adapter_config.read_text())
        base = base or settings["base_model_name_or_path"]
        # Paths like mlp.shared_experts.gate_proj are shardtune's MoE targets, taken from a transformers-5
        # model: PEFT must not convert them as if written for transformers 4.
        targets = settings.get("target_modules") or []
        ours = isinstance(targets, list) and any("." in target for target in targets)
        with targets_as_given() if ours else contextlib.nullcontext():
            return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), model_dir)
    if (model_dir / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(model_dir)
    raise InputError(f"{model_dir}: neither a PEFT adapter (adapter_config.json) nor a model (config.json)")


@torch.no_grad()
def generate_response(
    model_dir: str | Path,
    instruction: str,
    input_text: str = "",
    max_new_tokens: int = 64,
    base: str | None = None,
) -> str:
    """Greedy answer to an alpaca-style instruction, rendered exactly as in training."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_for_inference(model_dir, base).eval()
    prompt_ids = ExampleTokenizer(tokenizer, max_length=10**9).encode_prompt(render_prompt(instruction, input_text))
    input_ids = torch.tensor([prompt_ids])
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True).strip()

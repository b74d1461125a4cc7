"""Trainable parameters of each LoRA target group (``lora.moe_targets``) on real MoE shapes.

    python benchmarks/moe_lora_counts.py [--r 16]

Models are built on the meta device: no memory, no download. Prints a markdown table (README).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from shardtune.bench.shapes import SHAPES, shape_config
from shardtune.config import MOE_LORA_TARGETS, LoraConfig
from shardtune.model.lora import apply_lora, count_parameters


def group_counts(name: str, r: int) -> tuple[int, dict[str, int]]:
    counts = {}
    total = 0
    for group in MOE_LORA_TARGETS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape_config(name), dtype=torch.bfloat16)
        total = count_parameters(model)[1]
        try:
            peft_model = apply_lora(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, moe_targets=[group]))
        except Exception:  # the architecture has no such group (e.g. no shared experts)
            counts[group] = 0
            continue
        counts[group] = count_parameters(peft_model)[0]
    return total, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--r", type=int, default=16)
    args = parser.parse_args()
    print(f"| shape (r={args.r}) | total | " + " | ".join(MOE_LORA_TARGETS) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in MOE_LORA_TARGETS) + " |")
    moe_shapes = [name for name, (kind, _) in SHAPES.items() if kind in ("qwen3_moe", "glm4_moe", "mixtral")]
    for name in (name for name in moe_shapes if not name.endswith("-tiny")):
        total, counts = group_counts(name, args.r)
        cells = [f"{counts[group] / 1e6:,.1f}M" if counts[group] else "-" for group in MOE_LORA_TARGETS]
        print(f"| {name} | {total / 1e9:.1f}B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

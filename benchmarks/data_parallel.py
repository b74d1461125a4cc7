"""Throughput and memory of real-shaped models (random weights) on 1 and 2 GPUs, DDP and FSDP2.

    python benchmarks/data_parallel.py --out results/ [--runs 1b-1gpu,1b-ddp,1b-fsdp,7b-fsdp]

Each run is a plain ``shardtune train`` (full fine-tuning unless the run says LoRA; bf16; sequences
of 2,048 tokens) of a model directory this script writes: a Llama-3.2-1B-shaped or a Mistral-7B-shaped config with the
quickstart's tokenizer (the token ids it produces are valid for any larger vocabulary), weights
initialised at random (``model.init: random``). It reports tokens/s per GPU (mean of the logging
windows after the first, which holds warm-up), model FLOPs utilization and peak memory per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHAPES = {
    "1b": {  # Llama 3.2 1B
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
    },
    "7b": {  # Mistral 7B
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False, "rope_theta": 10000.0,
    },
}  # fmt: skip
# name: (shape, GPUs, strategy, sequences per GPU, activation checkpointing, LoRA)
RUNS = {
    "1b-1gpu": ("1b", 1, "ddp", 4, False, False),
    "1b-ddp": ("1b", 2, "ddp", 4, False, False),
    "1b-fsdp": ("1b", 2, "fsdp", 4, False, False),
    "7b-fsdp": ("7b", 2, "fsdp", 2, True, False),
    "7b-ddp": ("7b", 2, "ddp", 2, True, False),  # expected to run out of memory: replicated state is ~116 GB
    "7b-lora-ddp": ("7b", 2, "ddp", 4, True, True),  # seed 002's job: Mistral-7B-shaped LoRA with DDP
    "1b-fsdp-offload": ("1b", 2, "fsdp", 4, False, False),
}
OFFLOADED = {"1b-fsdp-offload"}  # parameters, gradients and optimizer state in host memory
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM


def write_model(directory: Path, shape: dict) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(REPO / "examples" / "tiny-llama" / name, directory / name)
    config = json.loads((REPO / "examples" / "tiny-llama" / "config.json").read_text())
    config.update(shape, max_position_embeddings=4096, head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return n * per_layer + v * h * (1 if shape["tie_word_embeddings"] else 2)


def write_data(path: Path, rows: int) -> None:
    rng = random.Random(0)
    words = str.split("the of and to in is was for on that with as by at from it his an were are which this")
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(3000))}) + "\n")


def run(name: str, work: Path, out: Path) -> dict:
    shape_name, gpus, strategy, batch, checkpointing, lora = RUNS[name]
    model_dir = work / f"model-{shape_name}"
    params = write_model(model_dir, SHAPES[shape_name])
    steps = 12
    config = {
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "bfloat16"},
        "data": {"dataset_path": str(work / "docs.jsonl"), "format": "text", "max_length": 2048,
                 "cache_dir": str(work / "cache")},
        "training": {"output_dir": str(work / name), "overwrite_output_dir": True, "max_steps": steps,
                     "per_device_train_batch_size": batch, "learning_rate": 1e-4 if lora else 1e-5, "logging_steps": 2,
                     "gradient_checkpointing": checkpointing},
        "lora": {"enabled": lora, "r": 16, "lora_alpha": 32,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "parallel": {"strategy": strategy, "cpu_offload": name in OFFLOADED},
        "logging": {"progress_bar": False},
    }  # fmt: skip
    result, command = launch(name, config, gpus, work, out)
    record = {"run": name, "params": params, "gpus": gpus, "strategy": strategy, "batch_per_gpu": batch,
              "seq": 2048, "activation_checkpointing": checkpointing, "lora": lora,
              "command": " ".join(command[1:])}  # fmt: skip
    if result.returncode != 0:
        oom = "OutOfMemoryError" in result.stderr or "CUDA out of memory" in result.stderr
        return {**record, "status": "out of memory" if oom else f"failed ({result.returncode})"}
    metrics = json.loads((work / name / "metrics.json").read_text())
    windows = [json.loads(line) for line in (work / name / "logs" / "train_log.jsonl").read_text().splitlines()]
    per_gpu = statistics.mean(w["tokens_per_s_per_device"] for w in windows[1:])
    layers, hidden = SHAPES[shape_name]["num_hidden_layers"], SHAPES[shape_name]["hidden_size"]
    # Per token: 2 FLOPs per parameter forward, 2 for input gradients, 2 more for weight gradients
    # only when the weights train (full fine-tuning; LoRA's frozen weights skip them), plus the
    # causal attention scores. Recomputation under activation checkpointing is not counted.
    flops_per_token = (6 if not lora else 4) * params + 6 * layers * hidden * 2048
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in metrics["gpu"]), None)
    return {
        **record,
        "status": "ok",
        "gpu": metrics["gpu"],
        "tokens_per_s_per_gpu": round(per_gpu),
        "mfu": round(per_gpu * flops_per_token / peak, 3) if peak else None,
        "peak_memory_gib_per_gpu": round(max(metrics["peak_memory_gib_per_rank"]), 1),
        "final_loss": metrics["train_loss"],
    }


def launch(name: str, config: dict, gpus: int, work: Path, out: Path) -> tuple[subprocess.CompletedProcess, list]:
    """Write ``config`` and run ``shardtune train`` on it with ``gpus`` workers; its log goes to ``out``."""
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "shardtune", "train", str(config_path), "--nproc", str(gpus)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out / f"{name}.log").write_text(result.stderr[-200_000:])
    return result, command


def run_benchmarks(
    run: Callable[[str, Path, Path], dict], description: str, default_runs: str, default_work: str, rows: int,
    results_name: str,
) -> None:  # fmt: skip
    """The command line shared by the GPU benchmarks: run the named runs, print and save each result."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=default_runs)
    parser.add_argument("--work", type=Path, default=Path(default_work))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    write_data(args.work / "docs.jsonl", rows)
    results = []
    for name in args.runs.split(","):
        results.append(run(name, args.work, args.out))
        print(json.dumps(results[-1]), flush=True)
        (args.out / results_name).write_text(json.dumps(results, indent=2))


def main() -> None:
    run_benchmarks(
        run, __doc__.splitlines()[0], "1b-1gpu,1b-ddp,1b-fsdp,7b-fsdp", "/tmp/shardtune-bench", 256, "results.json"
    )


if __name__ == "__main__":
    main()

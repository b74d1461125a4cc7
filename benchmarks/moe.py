"""MoE throughput: where an MoE layer's time goes, and end-to-end LoRA + FSDP training per expert kernel.

    PYTHONPATH=benchmarks python benchmarks/moe.py --out results/ [--shape qwen3-30b-a3b]
        [--layer-tokens 8192] [--runs grouped_mm,batched_mm,eager] [--gpus 2] [--seq 4096] [--batch 2]

1. ``layer``: one decoder layer of the shape (bf16, frozen weights as in LoRA, input gradients on), on
   one GPU: forward + backward time of the whole layer and of its routed experts alone (the same tokens
   and routing), for each of transformers' experts implementations (``eager``: a Python loop over the
   experts hit; ``batched_mm``: per-token batched matmuls; ``grouped_mm``: one grouped GEMM over
   expert-sorted tokens). The experts' share says whether they are the bottleneck.
2. ``train``: ``shardtune train --nproc G`` of the whole shape (random weights drawn on the GPU), LoRA on
   the attention projections (the MoE default), FSDP2 with the experts as their own units, activation
   checkpointing, packed sequences, bf16, once per implementation (``model.experts_implementation``):
   tokens/s per GPU (mean of the logging windows after the first), MFU and peak memory per GPU.

MFU counts the FLOPs of the active parameters (attention, router, the top_k routed experts and shared
experts, LM head): 4 per active frozen parameter and token (forward and input gradients; LoRA's weight
gradients are negligible), plus causal attention scores (6 x layers x attention width x sequence length),
over 989 TFLOP/s (H100/H200 SXM dense bf16). Recomputation under checkpointing is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from data_parallel import PEAK_BF16_FLOPS, TOKENIZER_FILES, launch, write_data

from shardtune.bench.shapes import shape_config

REPO = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def active_parameters(config) -> tuple[int, int]:
    """(active parameters per token, attention width) of a Qwen3-MoE / Mixtral / Glm4Moe config."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = 2 * h * q + 2 * h * kv
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    experts = experts or config.num_local_experts
    moe_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "n_shared_experts", 0) or 0
    dense_layers = getattr(config, "first_k_dense_replace", 0) or 0
    moe_layer = h * experts + (config.num_experts_per_tok + shared) * 3 * h * moe_width
    dense_layer = 3 * h * config.intermediate_size
    per_token = layers * attention + (layers - dense_layers) * moe_layer + dense_layers * dense_layer
    return per_token + config.vocab_size * h, q


def time_ms(function, repeats: int = 10) -> float:
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def layer_benchmark(shape: str, tokens: int) -> list[dict]:
    """Forward + backward of one decoder layer and of its experts, per implementation (1 GPU)."""
    from transformers import AutoModelForCausalLM

    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.model.moe import find_moe_blocks

    config = shape_config(shape, num_hidden_layers=1, first_k_dense_replace=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.requires_grad_(False)
    layer = decoder_layers(model)[0]
    block = find_moe_blocks(model, [layer])[0]
    sequence = min(tokens, 4096)
    hidden = torch.randn(tokens // sequence, sequence, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(sequence, device="cuda").expand(tokens // sequence, -1)
    rotary = model.model.rotary_emb(hidden, positions)
    flat = hidden.reshape(-1, config.hidden_size)
    with torch.no_grad():
        _, weights, chosen = block.router(flat)
    rows = []
    for implementation in IMPLEMENTATIONS:
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(implementation)
        else:
            model.config._experts_implementation = implementation

        def whole_layer():
            x = hidden.detach().requires_grad_()
            out = layer(x, position_embeddings=rotary, attention_mask=None, position_ids=positions)
            (out[0] if isinstance(out, tuple) else out).sum().backward()

        def experts_only():
            x = flat.detach().requires_grad_()
            block.experts(x, chosen, weights).sum().backward()

        torch.cuda.reset_peak_memory_stats()
        try:
            layer_ms, experts_ms = time_ms(whole_layer), time_ms(experts_only)
        except torch.OutOfMemoryError as exc:
            # batched_mm gathers every token's expert weights: meant for decoding, not 8k-token batches.
            rows.append({"benchmark": "layer", "shape": shape, "experts_implementation": implementation,
                         "tokens": tokens, "status": f"out of memory ({str(exc).split('.')[0]})"})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
            continue
        rows.append(
            {
                "benchmark": "layer",
                "status": "ok",
                "shape": shape,
                "experts_implementation": implementation,
                "tokens": tokens,
                "layer_fwd_bwd_ms": round(layer_ms, 2),
                "experts_fwd_bwd_ms": round(experts_ms, 2),
                "experts_share": round(experts_ms / layer_ms, 3),
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_model_dir(directory: Path, shape: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shape_config(shape).save_pretrained(directory)
    for name in TOKENIZER_FILES:  # the tiny tokenizer's ids are valid in any larger vocabulary
        (directory / name).write_bytes((REPO / "examples" / "tiny-llama" / name).read_bytes())


def train_benchmark(args: argparse.Namespace, implementation: str) -> dict:
    model_dir = args.work / f"model-{args.shape}"
    write_model_dir(model_dir, args.shape)
    name = f"{args.shape}-{implementation}"
    config = {
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "bfloat16",
                  "experts_implementation": implementation},
        "data": {"dataset_path": str(args.work / "docs.jsonl"), "format": "text", "max_length": args.seq,
                 "packing": True, "cache_dir": str(args.work / "cache")},
        "training": {"output_dir": str(args.work / name), "overwrite_output_dir": True, "max_steps": args.steps,
                     "per_device_train_batch_size": args.batch, "learning_rate": 1e-4, "logging_steps": 2,
                     "gradient_checkpointing": True},
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
        "parallel": {"strategy": "fsdp"},
        "logging": {"progress_bar": False},
    }  # fmt: skip
    started = time.perf_counter()
    result, command = launch(name, config, args.gpus, args.work, args.out)
    record = {"benchmark": "train", "shape": args.shape, "experts_implementation": implementation,
              "gpus": args.gpus, "seq": args.seq, "batch_per_gpu": args.batch, "lora": "attention, r=16",
              "strategy": "fsdp", "activation_checkpointing": True, "command": " ".join(command[1:]),
              "wall_s": round(time.perf_counter() - started)}  # fmt: skip
    if result.returncode != 0:
        oom = "OutOfMemoryError" in result.stderr or "CUDA out of memory" in result.stderr
        return {**record, "status": "out of memory" if oom else f"failed ({result.returncode})"}
    metrics = json.loads((args.work / name / "metrics.json").read_text())
    windows = [json.loads(line) for line in (args.work / name / "logs/train_log.jsonl").read_text().splitlines()]
    per_gpu = statistics.mean(w["tokens_per_s_per_device"] for w in windows[1:])
    active, attention_width = active_parameters(shape_config(args.shape))
    flops_per_token = 4 * active + 6 * shape_config(args.shape).num_hidden_layers * attention_width * args.seq
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in metrics["gpu"]), None)
    usage = [json.loads(line) for line in (args.work / name / "logs/expert_usage.jsonl").read_text().splitlines()]
    return {
        **record,
        "status": "ok",
        "gpu": metrics["gpu"],
        "active_params": active,
        "total_params": metrics["total_params"],
        "trainable_params": metrics["trainable_params"],
        "tokens_per_s_per_gpu": round(per_gpu),
        "step_time_s": round(args.batch * args.seq / per_gpu, 2),
        "mfu": round(per_gpu * flops_per_token / peak, 3) if peak else None,
        "peak_memory_gib_per_gpu": round(max(metrics["peak_memory_gib_per_rank"]), 1),
        "final_loss": metrics["train_loss"],
        "max_mean_ratio_last": max(layer["max_mean_ratio"] for layer in usage[-1]["layers"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/shardtune-moe-bench"))
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layer-tokens", type=int, default=8192, help="0: skip the layer benchmark")
    parser.add_argument("--runs", default="grouped_mm,eager", help="implementations to train with ('' none)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = []

    def save(rows: list[dict]) -> None:
        results.extend(rows)
        (args.out / "moe.json").write_text(json.dumps(results, indent=2))

    if args.layer_tokens:
        save(layer_benchmark(args.shape, args.layer_tokens))
    write_data(args.work / "docs.jsonl", 256)
    for implementation in filter(None, args.runs.split(",")):
        row = train_benchmark(args, implementation)
        print(json.dumps(row), flush=True)
        save([row])


if __name__ == "__main__":
    sys.exit(main())

"""MoE throughput: where an MoE layer's time goes, and end-to-end LoRA + FSDP training per expert kernel.

    python benchmarks/moe.py --out results/ [--shape qwen3-30b-a3b] [--layer-tokens 8192]
        [--runs grouped_mm,batched_mm,eager] [--gpus 2] [--seq 4096] [--batch 2] [--warmup 2] [--steps 6]

1. ``layer``: one decoder layer of the shape (bf16, frozen weights as in LoRA, input gradients on), on
   one GPU: forward + backward time of the whole layer and of its routed experts alone (the same tokens
   and routing), for each of transformers' experts implementations (``eager``: a Python loop over the
   experts hit; ``batched_mm``: per-token batched matmuls; ``grouped_mm``: one grouped GEMM over
   expert-sorted tokens). The experts' share says whether they are the bottleneck.
2. ``train``: ``shardtune bench`` of the whole shape on G GPUs (random weights drawn on the GPU), LoRA
   r=16 on the attention projections (the MoE default), FSDP2 with the experts as their own units,
   activation checkpointing, bf16, once per implementation (``model.experts_implementation``): tokens/s
   per GPU, step time, MFU (``shardtune.metrics.flops``: active parameters only) and peak memory per GPU,
   and the last logging step's worst expert load (max/mean).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from shardtune.bench.shapes import shape_config

IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


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


def train_benchmark(args: argparse.Namespace, implementation: str) -> dict:
    """One ``shardtune bench`` run with the given experts implementation."""
    out = args.work / f"{args.shape}-{implementation}"
    command = [
        sys.executable, "-m", "shardtune", "bench", "--shape", args.shape, "--seq", str(args.seq),
        "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--gradient-checkpointing", "--strategy", "fsdp", "--nproc", str(args.gpus), "--out", str(out),
        f"model.experts_implementation={implementation}",
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    record = {"benchmark": "train", "shape": args.shape, "experts_implementation": implementation,
              "gpus": args.gpus, "seq": args.seq, "batch_per_gpu": args.batch, "lora": "attention, r=16",
              "strategy": "fsdp", "activation_checkpointing": True, "command": " ".join(command[1:]),
              "wall_s": round(time.perf_counter() - started)}  # fmt: skip
    if result.returncode != 0:
        log = (out / "shardtune.log").read_text() if (out / "shardtune.log").is_file() else result.stderr
        oom = "OutOfMemoryError" in log or "CUDA out of memory" in log
        return {**record, "status": "out of memory" if oom else f"failed ({result.returncode})"}
    run = json.loads((out / "bench.json").read_text())["shardtune"]
    usage = [json.loads(line) for line in (out / "shardtune/logs/expert_usage.jsonl").read_text().splitlines()]
    return {
        **record,
        "status": "ok",
        "gpu": run["device"],
        "total_params": run["total_params"],
        "trainable_params": run["trainable_params"],
        "tokens_per_s_per_gpu": round(run["tokens_per_s_per_device"]),
        "step_time_s": round(run["step_time_s"], 2),
        "mfu": round(run["mfu"], 3) if run["mfu"] is not None else None,
        "peak_memory_gib_per_gpu": round(run["peak_memory_gib_per_device"], 1),
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
    parser.add_argument("--warmup", type=int, default=2, help="training steps run first and not measured")
    parser.add_argument("--steps", type=int, default=6, help="measured training steps")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = []

    def save(rows: list[dict]) -> None:
        results.extend(rows)
        (args.out / "moe.json").write_text(json.dumps(results, indent=2))

    if args.layer_tokens:
        save(layer_benchmark(args.shape, args.layer_tokens))
    for implementation in filter(None, args.runs.split(",")):
        row = train_benchmark(args, implementation)
        print(json.dumps(row), flush=True)
        save([row])


if __name__ == "__main__":
    sys.exit(main())

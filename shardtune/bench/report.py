"""What a benchmark run measured: tokens/s per device (all tokens and target tokens), step time, TFLOP/s
and MFU (``shardtune.metrics.flops``), peak memory per device, and for MoE models the expert load the
routers produced (``expert_usage.jsonl``, as training logs it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.metrics.expert_usage import USAGE_FILE, read_usage
from shardtune.metrics.flops import peak_flops, run_token_flops
from shardtune.metrics.schema import LOG_FILES, read_rows


def _summary(
    *,
    tokens: float,
    targets: float,
    seconds: float,
    steps: int,
    devices: int,
    device: str,
    peak_tflops: float | None,
    peak_memory_gib: float,
    lora: bool,
    trainable: int,
    routed_trainable: int,
    total: int,
    model_config,
    seq: int,
) -> dict[str, Any]:
    """The measures of a run from its totals over the measured steps (shardtune and the HF baseline alike)."""
    flops = run_token_flops(model_config, seq, lora, trainable, routed_trainable)
    per_device = tokens / seconds / devices
    tflops = per_device * flops.per_token / 1e12
    peak = peak_flops(device, peak_tflops)
    return {
        "measured_steps": steps,
        "step_time_s": seconds / steps,
        "tokens_per_s_per_device": per_device,
        "target_tokens_per_s_per_device": targets / seconds / devices,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "device": device,
        "peak_memory_gib_per_device": peak_memory_gib,
        "flops_per_token": flops.per_token,
        "trainable_params": trainable,
        "total_params": total,
    }


def expert_load(usage_path: Path, warmup: int) -> dict[str, float] | None:
    """The max/mean expert load of the measured steps (``expert_usage.jsonl`` records after ``warmup``),
    averaged over layers and steps, and its largest single value; None for a dense model."""
    if not usage_path.is_file():
        return None
    ratios = [
        layer["max_mean_ratio"]
        for record in read_usage(usage_path)
        if record["step"] > warmup
        for layer in record["layers"]
    ]
    if not ratios:
        raise ValueError(f"{usage_path}: no routing record after the {warmup} warm-up steps")
    return {"max_mean": sum(ratios) / len(ratios), "max_mean_worst": max(ratios)}


def summarize_shardtune(run_dir: Path, warmup: int, model_config, seq: int) -> dict[str, Any]:
    """From the run's train_log.jsonl (one record per step) and metrics.json."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = read_rows(run_dir / "logs" / LOG_FILES["train"], "a log row")
    measured = [row for row in rows if row["step"] > warmup]
    if not measured:
        raise ValueError(f"{run_dir}: no step after the {warmup} warm-up steps was logged")
    summary = _summary(
        tokens=sum(row["tokens"] for row in measured),
        targets=sum(row["target_tokens"] for row in measured),
        seconds=sum(row["tokens"] / row["tokens_per_s"] for row in measured),
        steps=len(measured),
        devices=metrics["world_size"],
        device=metrics["gpu"],
        peak_tflops=metrics.get("peak_tflops"),
        peak_memory_gib=max(metrics["peak_memory_gib_per_rank"]),
        lora=metrics["use_lora"],
        trainable=metrics["trainable_params"],
        routed_trainable=metrics["routed_expert_trainable_params"],
        total=metrics["total_params"],
        model_config=model_config,
        seq=seq,
    )
    # Every step's loss, warm-up included: two settings of the same run can be
    # checked to train the same numbers (an optimization that changes the losses is a bug).
    # Fetching and collating batches on the host, per step: well under the step time means the data
    # loader never kept the device waiting.
    data_wait = sum(row["data_wait_s"] for row in measured) / len(measured)
    return {**summary, "strategy": metrics["strategy"], "data_wait_s_per_step": data_wait,
            "gradient_checkpointing": metrics["gradient_checkpointing"],
            "checkpointed_layers": metrics["checkpointed_layers"],
            "checkpointed_parts": metrics["checkpointed_parts"],
            "cuda_graph_layers": metrics["cuda_graph_layers"],
            "cuda_graphs_captured_in_step": metrics["cuda_graphs_captured_in_step"],
            "loss": metrics["loss"],
            "expert_load": expert_load(run_dir / "logs" / USAGE_FILE, warmup),
            "losses": [row["loss"] for row in rows]}  # fmt: skip


def summarize_hf(out_dir: Path, warmup: int, model_config, seq: int) -> dict[str, Any]:
    """From the per-step timings the HF baseline writes (``steps.json``)."""
    record = json.loads((out_dir / "steps.json").read_text())
    measured = [step for step in record["steps"] if step["step"] > warmup]
    if not measured:
        raise ValueError(f"{out_dir}: no step after the {warmup} warm-up steps was timed")
    summary = _summary(
        tokens=sum(step["tokens"] for step in measured),
        targets=sum(step["target_tokens"] for step in measured),
        seconds=sum(step["seconds"] for step in measured),
        steps=len(measured),
        devices=record["world_size"],
        device=record["device"],
        peak_tflops=record.get("peak_tflops"),
        peak_memory_gib=record["peak_memory_gib"],
        lora=record["use_lora"],
        trainable=record["trainable_params"],
        routed_trainable=record["routed_expert_trainable_params"],
        total=record["total_params"],
        model_config=model_config,
        seq=seq,
    )
    return {**summary, "versions": record["versions"], "expert_load": expert_load(out_dir / USAGE_FILE, warmup),
            "router_weights_sha256": record["router_weights_sha256"],
            "routing_weights_cast": record.get("routing_weights_cast", [])}  # fmt: skip


def format_report(results: dict[str, Any]) -> str:
    lines = [
        f"{results['shape']}: seq {results['seq']}, {results['batch_per_device']} sequences per device, "
        f"{results['nproc']} device(s), data {results.get('data', 'synthetic')}, {results.get('layers')} layers",
        f"{'':<12}{'tokens/s/dev':>14}{'target tok/s':>14}{'step s':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}",
    ]
    for name in ("shardtune", "hf"):
        if name not in results:
            continue
        row = results[name]
        if row.get("out_of_memory"):
            lines.append(f"{name:<12}out of memory (every layer checkpointed too)")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        lines.append(
            f"{name:<12}{row['tokens_per_s_per_device']:>14,.0f}{row['target_tokens_per_s_per_device']:>14,.0f}"
            f"{row['step_time_s']:>9.3f}{row['tflops_per_device']:>9.1f}{mfu:>7}"
            f"{row['peak_memory_gib_per_device']:>10.1f}"
        )
    loads = {
        name: results[name]["expert_load"] for name in ("shardtune", "hf") if results.get(name, {}).get("expert_load")
    }
    if loads:
        measured = ", ".join(
            f"{name} {load['max_mean']:.2f} (worst layer {load['max_mean_worst']:.2f})" for name, load in loads.items()
        )
        lines.append(f"expert load, max/mean over layers and measured steps ({results['routing']} routing): {measured}")
    captured = results["shardtune"].get("cuda_graphs_captured_in_step")
    if captured is not None and captured > results["warmup"]:
        lines.append(
            f"shardtune captured its layers' CUDA graphs in measured step {captured}, whose time counts the capture; "
            f"--warmup {captured} or more measures the replayed steps alone"
        )
    if "data_wait_s_per_step" in results["shardtune"]:
        run = results["shardtune"]
        wait = run["data_wait_s_per_step"]
        lines.append(f"shardtune data wait: {wait * 1e3:.2f} ms a step ({wait / run['step_time_s']:.1%} of a step)")
    if "ratio" in results:
        lines.append(
            f"shardtune / HF Trainer + PEFT (padding: {results['hf'].get('padding', 'max_length')}): "
            f"{results['ratio']:.2f}x tokens/s, {results['target_ratio']:.2f}x target tokens/s per device"
        )
    if "epoch" in results:
        epoch = results["epoch"]
        lines.append(
            f"one epoch of {epoch['examples']:,} examples: {epoch['steps']} steps in {epoch['train_time_s']:.1f} s"
        )
    return "\n".join(lines)

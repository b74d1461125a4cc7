"""Two "nodes" on one 2-GPU machine: two ``shardtune launch`` processes, one GPU each, over NCCL.

    python benchmarks/multi_node.py --out results/ [--runs 1b-fsdp-2nodes,1b-ddp-2nodes]

Each node sees only its own GPU (``CUDA_VISIBLE_DEVICES``), starts one worker and meets the other at a
c10d rendezvous on 127.0.0.1, as two real nodes would at node 0's address. The model, data and
settings are those of the same-named single-launcher runs of ``data_parallel.py`` (a
Llama-3.2-1B-shaped model, full fine-tuning, bf16, 2,048-token sequences), so the numbers compare
directly with ``1b-fsdp`` and ``1b-ddp`` there.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from data_parallel import PEAK_BF16_FLOPS, SHAPES, run_benchmarks, write_model

RUNS = {"1b-fsdp-2nodes": "fsdp", "1b-ddp-2nodes": "ddp"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(name: str, work: Path, out: Path) -> dict:
    strategy = RUNS[name]
    model_dir = work / "model-1b"
    params = write_model(model_dir, SHAPES["1b"])
    config = {
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "bfloat16"},
        "data": {"dataset_path": str(work / "docs.jsonl"), "format": "text", "max_length": 2048,
                 "cache_dir": str(work / "cache")},
        "training": {"output_dir": str(work / name), "overwrite_output_dir": True, "max_steps": 12,
                     "per_device_train_batch_size": 4, "learning_rate": 1e-5, "logging_steps": 2},
        "lora": {"enabled": False},
        "parallel": {"strategy": strategy},
        "network": {"nccl_debug": "WARN"},
        "logging": {"progress_bar": False},
    }  # fmt: skip
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    commands, processes = [], []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "shardtune", "launch", str(config_path), "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1", "--join-timeout", "120",
        ]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(node), "PYTHONUNBUFFERED": "1"}
        commands.append(command)
        # Each node logs to its own file: two pipes read one after the other could fill and block.
        with open(out / f"{name}-node{node}.log", "w") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    for process in processes:
        process.wait(timeout=900)
    logs = [(out / f"{name}-node{node}.log").read_text() for node in (0, 1)]
    banners = [line for log in logs for line in log.splitlines() if line.startswith("shardtune: ") and " node " in line]
    record = {"run": name, "params": params, "nodes": 2, "gpus_per_node": 1, "strategy": strategy,
              "batch_per_gpu": 4, "seq": 2048, "banners": banners,
              "command": " ".join(commands[0][1:]).replace(str(port), "PORT")}  # fmt: skip
    if any(process.returncode != 0 for process in processes):
        return {**record, "status": f"failed ({[process.returncode for process in processes]})"}
    metrics = json.loads((work / name / "metrics.json").read_text())
    windows = [json.loads(line) for line in (work / name / "logs" / "train_log.jsonl").read_text().splitlines()]
    per_gpu = statistics.mean(w["tokens_per_s_per_device"] for w in windows[1:])
    layers, hidden = SHAPES["1b"]["num_hidden_layers"], SHAPES["1b"]["hidden_size"]
    flops_per_token = 6 * params + 6 * layers * hidden * 2048  # as in data_parallel.py
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in metrics["gpu"]), None)
    return {
        **record,
        "status": "ok",
        "gpu": metrics["gpu"],
        "hostnames": metrics.get("hostnames"),
        "tokens_per_s_per_gpu": round(per_gpu),
        "mfu": round(per_gpu * flops_per_token / peak, 3) if peak else None,
        "peak_memory_gib_per_gpu": round(max(metrics["peak_memory_gib_per_rank"]), 1),
        "final_loss": metrics["train_loss"],
    }


def main() -> None:
    run_benchmarks(run, __doc__.splitlines()[0], ",".join(RUNS), "/tmp/shardtune-nodes-bench", 256, "multi_node.json")


if __name__ == "__main__":
    main()

"""Time lite and full checkpoint saves of a Mistral-7B-shaped LoRA model (r=16, all linear layers).

    python benchmarks/checkpoint_save.py --out results/ [--runs lite-2gpu,full-2gpu] [--gpus-note ...]

Each run trains 6 steps with FSDP, saving every 2 steps; saves are synchronous, so the time a save
takes is the training stall it causes. Reports the mean save time and the checkpoint's size.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from data_parallel import SHAPES, launch, run_benchmarks, write_model

RUNS = {"lite-1gpu": (1, "lite"), "full-1gpu": (1, "full"), "lite-2gpu": (2, "lite"), "full-2gpu": (2, "full")}
SAVED = re.compile(r"saved (lite|full) checkpoint (\S+) in ([0-9.]+) s")


def run(name: str, work: Path, out: Path) -> dict:
    gpus, mode = RUNS[name]
    model_dir = work / "model-7b"
    write_model(model_dir, SHAPES["7b"])
    config = {
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "bfloat16"},
        "data": {"dataset_path": str(work / "docs.jsonl"), "format": "text", "max_length": 2048,
                 "cache_dir": str(work / "cache")},
        "training": {"output_dir": str(work / name), "overwrite_output_dir": True, "max_steps": 6,
                     "per_device_train_batch_size": 2, "learning_rate": 1e-4, "logging_steps": 2,
                     "gradient_checkpointing": True, "save_steps": 2, "checkpoint_mode": mode},
        "lora": {"enabled": True, "r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "parallel": {"strategy": "fsdp"},
        "logging": {"progress_bar": False},
    }  # fmt: skip
    result, command = launch(name, config, gpus, work, out)
    if result.returncode != 0:
        return {"run": name, "status": f"failed ({result.returncode})"}
    saves = [(Path(m.group(2)), float(m.group(3))) for m in SAVED.finditer(result.stderr)]
    size = sum(f.stat().st_size for f in saves[-1][0].rglob("*") if f.is_file())
    return {
        "run": name,
        "gpus": gpus,
        "mode": mode,
        "status": "ok",
        "saves": len(saves),
        "save_s_mean": round(statistics.mean(t for _, t in saves), 3),
        "save_s_max": round(max(t for _, t in saves), 3),
        "checkpoint_mib": round(size / 2**20, 1),
        "command": " ".join(command[1:]),
    }


def main() -> None:
    run_benchmarks(
        run, __doc__.splitlines()[0], "lite-2gpu,full-2gpu", "/tmp/shardtune-ckpt-bench", 64, "checkpoint_save.json"
    )


if __name__ == "__main__":
    main()

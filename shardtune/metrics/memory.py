"""Peak memory of this process: device memory on GPUs, resident memory on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux and bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def start_training_peak(device: torch.device) -> None:
    """Peaks from here on are training's: rank 0's one-time copy of the full weights (kept while it
    hands out the shards) is released and no longer counts."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

"""A smaller GPU emulated on a bigger one, for benchmarks: with this folder on PYTHONPATH and
SHARDTUNE_BENCH_ALLOCATOR_GIB set, every worker that torchrun starts (LOCAL_RANK set) holds torch's caching
allocator to that many GiB of its GPU, so a step that would not fit the smaller GPU fails with an out-of-memory
error there too. The planner is told the smaller GPU's memory by ``training.memory_budget_gib``. What the allocator
does not hold (the CUDA context, NCCL's buffers) is measured separately: nvidia-smi's memory.used
(``benchmarks/suite.sh h200x2-moe-ddp-80gb``)."""

import os

if "LOCAL_RANK" in os.environ and os.environ.get("SHARDTUNE_BENCH_ALLOCATOR_GIB"):
    import torch

    device = int(os.environ["LOCAL_RANK"])
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(
        float(os.environ["SHARDTUNE_BENCH_ALLOCATOR_GIB"]) * 2**30 / total, device
    )

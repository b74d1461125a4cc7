"""A rank out of device memory (``is_out_of_memory``) in ``train`` or ``eval``: the one line it stops with. The rank
may be the only one to run out while the others wait in a collective with it: they learn of it as of any rank that
stops alone (``shardtune.peer_stop``).
"""

from __future__ import annotations

import re

import torch

from shardtune.errors import first_line

TRAINING_ADVICE = (
    "Lower training.per_device_train_batch_size or data.max_length, set training.gradient_checkpointing: auto (the "
    "default) or true, or shard the model over more GPUs (parallel.strategy: fsdp); shardtune plan CONFIG estimates "
    "the peak"
)
EVAL_ADVICE = (
    "Lower training.per_device_eval_batch_size or data.max_length, or shard the model over more GPUs "
    "(parallel.strategy: fsdp)"
)


# Besides the caching allocator's torch.OutOfMemoryError, libraries that allocate for themselves fail with a
# status of their own when the device is full: cuBLAS creating its handle (seen on an H100 in the first step of
# a model that did not fit: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
# cuDNN, or a plain cudaMalloc.
ALLOCATION_FAILURES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says that the device had no memory left for an allocation."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(failure in str(error) for failure in ALLOCATION_FAILURES)


def out_of_memory_line(error: RuntimeError, rank: int, where: str, advice: str) -> str:
    """What ran out of memory where, what the allocator said (its first sentences: the size asked for and what
    was free), and what to change."""
    said = re.match(r".*?(?:is free\.|$)", first_line(error)).group(0)
    return f"rank {rank}: out of memory {where}: {said} {advice}"

"""A rank that runs out of device memory stops the run with one line naming the rank, the step and what the
allocator said, and what to change; exit status 5, no traceback from it or from the ranks whose collectives
failed as it left, no restart (it would run out again), and the checkpoints already saved stay intact.

On a CPU no allocator raises ``torch.OutOfMemoryError``: ``SHARDTUNE_FAULT=POINT:oom`` makes a forward raise it
with the CUDA caching allocator's words (``shardtune/faults.py``)."""

from __future__ import annotations

import pytest
import torch
from faulty_runs import assert_intact, run

from shardtune.errors import EXIT_OUT_OF_MEMORY
from shardtune.out_of_memory import is_out_of_memory, out_of_memory_line

ADVICE = (
    "Lower training.per_device_train_batch_size or data.max_length, set training.gradient_checkpointing: auto (the "
    "default) or true, or shard the model over more GPUs (parallel.strategy: fsdp); shardtune plan CONFIG estimates "
    "the peak"
)
INJECTED = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.06 GiB is free."
)


def errors_of(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("shardtune: error:")]


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.variants), "fsdp"])
def test_one_rank_out_of_memory_stops_the_run_with_one_line_and_keeps_its_checkpoints(tmp_path, strategy):
    out = tmp_path / "run"
    # Rank 1 alone runs out of memory in step 3's forward; rank 0 is then inside a collective with it.
    result = run(
        tmp_path, out, 2, "training.max_steps=6", "training.save_steps=2", f"parallel.strategy={strategy}",
        "parallel.timeout_s=120", fault="forward_backward:oom:rank=1:step=3", max_restarts=1,
    )  # fmt: skip
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.log[-4000:]
    assert errors_of(result.log) == [
        f"shardtune: error: rank 1: out of memory in step 3 (forward backward): {INJECTED} {ADVICE}"
    ], result.log[-4000:]
    assert "Traceback" not in result.log and "[rank0]" not in result.log, result.log[-4000:]
    assert "restart" not in result.log  # a launcher does not restart what a restart would meet again
    assert "worker 1 failed" not in result.log  # the rank said why itself
    assert result.seconds < 100  # long before the 120 s collective timeout: nobody waited for rank 1
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert_intact(out / "checkpoint-2")


def test_out_of_memory_in_one_process_is_one_line_with_exit_5(tmp_path):
    result = run(tmp_path, tmp_path / "run", 1, "training.max_steps=4", fault="forward_backward:oom:step=2")
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.log[-4000:]
    assert errors_of(result.log) == [
        f"shardtune: error: rank 0: out of memory in step 2 (forward backward): {INJECTED} {ADVICE}"
    ]
    assert "Traceback" not in result.log


def test_the_line_quotes_what_the_allocator_said_up_to_what_was_free():
    torch_said = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 42.12 MiB "
        "is free. Including non-PyTorch memory, this process has 79.13 GiB memory in use. Of the allocated memory "
        "77.75 GiB is allocated by PyTorch.\nSee documentation for Memory Management"
    )
    assert out_of_memory_line(torch_said, 3, "in step 7 (eval)", ADVICE) == (
        "rank 3: out of memory in step 7 (eval): CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
        f"capacity of 79.18 GiB of which 42.12 MiB is free. {ADVICE}"
    )
    # A message without "is free" is quoted whole (its first line).
    assert out_of_memory_line(torch.OutOfMemoryError("HIP out of memory.\nmore"), 3, "in evaluation", "Advice.") == (
        "rank 3: out of memory in evaluation: HIP out of memory. Advice."
    )


def test_allocation_failures_of_cublas_cudnn_and_cuda_count_as_out_of_memory():
    # What a real H100 raised in the first step of a model that did not fit, before the caching allocator did.
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert is_out_of_memory(cublas) and is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(ValueError("CUBLAS_STATUS_ALLOC_FAILED"))
    assert out_of_memory_line(cublas, 0, "in step 1 (forward backward)", "Advice.") == (
        "rank 0: out of memory in step 1 (forward backward): CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
        "`cublasCreate(handle)` Advice."
    )

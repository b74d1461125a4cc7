"""The frozen experts' float8 grouped GEMM (``float8.float8_grouped_mm``) as a persistent Triton kernel.

``(rows * row_scales) @ (values[e] * scales[e])^T`` for the rows of each expert e, e4m3 operands scaled per row
as ``float8.rowwise_float8`` makes them, accumulated in fp32 with Hopper's fast float8 accumulation (as
``torch._scaled_grouped_mm(..., use_fast_accum=True)``) and written in bf16.

Written here because ``torch._scaled_grouped_mm`` (CUTLASS) runs these GEMMs at 631-1,185 TFLOP/s on one H100,
where this kernel takes 6-30% less device time a GEMM with the same output bit for bit
(``python benchmarks/moe_kernels.py --float8``, ``benchmarks/results/moe_kernels_float8_triton_h100.txt``): an
expert layer's four GEMMs 1,289 against 1,602 us at Qwen3-30B-A3B's shapes, 4,554 against 5,608 at
GLM-4.5-Air's and 9,155 against 10,142 at Mixtral-8x7B's. What it does differently:

- one program per SM walks the tiles of every expert, expert after expert, so that the programs running at
  once share a few experts' rows and weights in the L2 cache; within an expert the row tiles vary fastest;
- operands come in by TMA, 4 stages deep, and Triton's flattened loop issues the next tile's loads while a
  tile's epilogue (the two scales, bf16, the store) runs;
- a row tile may run past its expert's last row into the next expert's rows: those results are masked at the
  store, so no row needs padding or a per-expert copy.

Used on Hopper GPUs (compute capability 9.x), where it was measured; elsewhere, and with
``model.grouped_gemm: torch``, ``torch._scaled_grouped_mm`` runs, as it does from the first call on where the
kernel fails to build or launch (one warning). Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors (``tests/train/test_float8_grouped_kernel.py``).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shardtune.errors import first_line
from shardtune.model import triton_kernels
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO

log = logging.getLogger("shardtune")

# Measured fastest on one H100 of the tilings tried, at every expert GEMM of Qwen3-30B-A3B and GLM-4.5-Air
# (128x128, 64x256 and 64-deep K steps, 3 stages, and the loop not flattened were each slower, by 2-20%).
BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 128, 256, 128, 8, 4


@triton.jit
def _grouped_float8_gemm_kernel(
    rows_desc, row_scales_ptr, values_desc, scales_ptr, bounds_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
    EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PROGRAMS: tl.constexpr,
):  # fmt: skip
    expert_ids = tl.arange(0, EXPERTS_POW2)
    real = expert_ids < EXPERTS
    starts = tl.load(bounds_ptr + expert_ids, mask=real, other=0)
    ends = tl.load(bounds_ptr + expert_ids + 1, mask=real, other=0)
    row_tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles = row_tiles * tl.cdiv(N, BLOCK_N)
    tiles_end = tl.cumsum(tiles, 0)  # expert e's tiles are tiles_end[e] - tiles[e] .. tiles_end[e] - 1
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0), PROGRAMS, flatten=True):
        expert = tl.sum((tiles_end <= tile).to(tl.int32), 0)
        this = expert_ids == expert
        local = tile - tl.sum(tl.where(this, tiles_end - tiles, 0), 0)
        expert_row_tiles = tl.sum(tl.where(this, row_tiles, 0), 0)
        first_row = tl.sum(tl.where(this, starts, 0), 0) + (local % expert_row_tiles) * BLOCK_M
        end_row = tl.sum(tl.where(this, ends, 0), 0)
        first_column = (local // expert_row_tiles) * BLOCK_N
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
            a = rows_desc.load([first_row, k * BLOCK_K])
            b = values_desc.load([expert * N + first_column, k * BLOCK_K])
            accumulator = tl.dot(a, b.T, accumulator)
        row = first_row + tl.arange(0, BLOCK_M)
        column = first_column + tl.arange(0, BLOCK_N)
        row_scale = tl.load(row_scales_ptr + row, mask=row < end_row, other=0.0)
        scale = tl.load(scales_ptr + expert * N + column, mask=column < N, other=0.0)
        result = (accumulator * row_scale[:, None] * scale[None, :]).to(out_ptr.dtype.element_ty)
        inside = (row[:, None] < end_row) & (column[None, :] < N)
        tl.store(out_ptr + row[:, None].to(tl.int64) * N + column[None, :], result, mask=inside)


def kernel_takes(rows: torch.Tensor) -> bool:
    """Whether the kernel can take rows of this shape: TMA needs each row's bytes (K e4m3 values) a multiple of
    16. Checked on shapes only, so that torch.compile traces it (a tensor's address would break the graph)."""
    return rows.shape[-1] % 16 == 0


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous from a 16-byte aligned address, as TMA loads it: copied where a view starts
    elsewhere (rare: the block's operands are tensors of their own)."""
    tensor = tensor.contiguous()
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


class _Kernel:
    """The compiled kernel for each (device, N, K, experts, alignment of the pointer operands), and why the kernel
    failed at run time, if it did (torch's kernel computes from then on)."""

    compiled: dict[tuple, object] = {}
    failure: str | None = None


# Registered with the dispatcher directly: torch.library.custom_op's wrapper (its autograd and aliasing checks at
# every call) costs about 17 us of host time a call (one H200), and a step of Qwen3-30B-A3B's 48 layers makes 192
# of these calls where the step waits on the host as much as on the device.
torch.library.define(
    "shardtune::float8_grouped_mm",
    "(Tensor rows, Tensor row_scales, Tensor values, Tensor scales, Tensor bounds) -> Tensor",
)


@torch.library.impl("shardtune::float8_grouped_mm", ["CUDA", "CPU"])
def _float8_grouped_mm(
    rows: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """bf16 ``(rows * row_scales) @ (values[e] * scales[e])^T`` for each expert e's rows bounds[e]:bounds[e + 1]:
    ``rows`` (M, K) and ``values`` (E, N, K) e4m3, K a multiple of 16 (``kernel_takes``); ``row_scales`` (M,)
    and ``scales`` (E, N) fp32; ``bounds`` (E + 1,) int32. An opaque op to torch.compile: Triton builds its TMA
    descriptors on the host. (CPU tensors: under Triton's interpreter only.) Where the kernel fails to build or
    launch, torch's float8 grouped GEMM computes it, for the rest of the run."""
    if _Kernel.failure is None:
        try:
            return _launch(rows, row_scales, values, scales, bounds)
        except torch.OutOfMemoryError:
            raise  # the run's own failure (one line, exit status 5), not the kernel's
        except Exception as error:  # a Triton or a driver that cannot build or run this kernel here
            _Kernel.failure = f"{type(error).__name__}: {first_line(error)}"
            log.warning(
                "model.grouped_gemm: shardtune's float8 grouped GEMM failed (%s); torch's computes the float8 "
                "experts from here on (the same results); set model.grouped_gemm: torch to skip it",
                _Kernel.failure,
                extra=SAID_BY_RANK_ZERO,
            )
    from shardtune.model.float8 import float8_grouped_mm  # torch's kernel; float8 imports this module

    return float8_grouped_mm(rows, row_scales, values, scales, bounds, torch.bfloat16, "torch")


def _launch(
    rows: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    experts, columns, depth = values.shape
    out = rows.new_empty(rows.shape[0], columns, dtype=torch.bfloat16)
    if rows.shape[0] == 0:
        return out
    rows, values = _aligned(rows), _aligned(values)
    row_scales, scales, bounds = row_scales.contiguous(), scales.contiguous(), bounds.contiguous()  # read flat
    programs = _programs(rows.device)
    rows_desc = TensorDescriptor.from_tensor(rows, [BLOCK_M, BLOCK_K])
    values_desc = TensorDescriptor.from_tensor(values.view(experts * columns, depth), [BLOCK_N, BLOCK_K])
    arguments = (
        rows_desc, row_scales, values_desc, scales, bounds, out, columns, depth, experts,
        triton.next_power_of_2(experts), BLOCK_M, BLOCK_N, BLOCK_K, STAGES, programs,
    )  # fmt: skip
    # What Triton specializes a compiled kernel on besides the constants: whether each pointer is 16-byte aligned
    # (a descriptor only on its dtype and block shape, fixed here).
    aligned = (tensor.data_ptr() % 16 == 0 for tensor in (row_scales, scales, bounds, out))
    key = (rows.device, columns, depth, experts, *aligned)
    compiled = _Kernel.compiled.get(key)
    if compiled is None:
        compiled = _grouped_float8_gemm_kernel[(programs,)](*arguments, num_warps=WARPS, num_stages=STAGES)
        if not triton_kernels.INTERPRETED:
            _Kernel.compiled[key] = compiled
    else:
        # The compiled kernel launched directly: Triton's own launch (binding the arguments, computing their
        # specialization, finding the kernel again) takes about 20 us more host time a call.
        compiled[(programs, 1, 1)](*arguments)
    return out


@torch.library.register_fake("shardtune::float8_grouped_mm")
def _(rows, row_scales, values, scales, bounds):
    return rows.new_empty(rows.shape[0], values.shape[1], dtype=torch.bfloat16)


@functools.cache
def _programs(device: torch.device) -> int:
    """One program per SM (on CPU, under the interpreter: a few)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def runs_on(device: torch.device) -> bool:
    """Whether ``float8.float8_grouped_mm`` takes this kernel on ``device``: Hopper GPUs, where it was measured
    faster, and eagerly any device under Triton's interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] == 9
    return triton_kernels.runs_on(device)

"""The backward of the fused MoE block's weighted SiLU (``fused_moe.WeightedSiluMul``) as one Triton kernel.

For each row of a [gate | up] GEMM output, its routing weight w and the gradient g of w * SiLU(gate) * up,
it writes both halves of the input gradient and the weight's gradient (a dot product over the row) in one
pass, computing in fp32 and rounding once. Written here because inductor does not make one pass of it: it
lowers the concatenation of the two halves to a kernel that loads every operand under a mask for each
output element (7 loads an element) and runs the weight's dot product as a second kernel over the same
rows, 1.7-1.9 TB/s together. This kernel reads each operand once, 4.1-4.2 TB/s, on one H200
(``benchmarks/moe_kernels.py``): 119 against 285 us at Qwen3-30B-A3B's shape (65,536 rows, 768 wide), 219
against 527 at GLM-4.5-Air's and 567 against 1,229 at Mixtral-8x7B's, with the same input gradient bit for
bit.

It is a ``torch.library.triton_op``, so a compiled graph calls the kernel itself. Importing this module needs
Triton (CUDA builds of torch on Linux ship it); ``fused_moe`` uses it on CUDA tensors where it imports.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors too, which is how the CPU tests check it
(``tests/train/test_weighted_silu_kernel.py``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Set before Triton is imported, TRITON_INTERPRET=1 makes its kernels run on CPU tensors (as numpy).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of ``device``: CUDA devices, and eagerly any under Triton's
    interpreter (inductor would build the interpreted kernel into a CPU graph)."""
    return device.type == "cuda" or (INTERPRETED and not torch.compiler.is_compiling())


# Columns a program handles at once; wider rows take several tiles (Mixtral's 14,336). 1,024 with one row a
# program measured fastest of the tilings tried, at all three widths above.
COLUMN_TILE = 1024


@triton.jit
def _weighted_silu_mul_backward_kernel(
    gate_up_ptr, row_weights_ptr, grad_ptr, grad_gate_up_ptr, grad_weights_ptr, width: tl.constexpr,
    tile: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    weight = tl.load(row_weights_ptr + row).to(tl.float32)
    gate_up_row = gate_up_ptr + row * (2 * width)
    grad_gate_up_row = grad_gate_up_ptr + row * (2 * width)
    grad_row = grad_ptr + row * width
    dot = tl.zeros([tile], dtype=tl.float32)
    for start in tl.static_range(0, width, tile):
        column = start + tl.arange(0, tile)
        inside = column < width
        gate = tl.load(gate_up_row + column, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up_row + width + column, mask=inside, other=0.0).to(tl.float32)
        grad = tl.load(grad_row + column, mask=inside, other=0.0).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        silu = gate * sigmoid
        dot += grad * silu * up
        weighted = grad * weight
        grad_gate = weighted * up * (sigmoid * (1 + gate * (1 - sigmoid)))
        out_dtype = grad_gate_up_ptr.dtype.element_ty
        tl.store(grad_gate_up_row + column, grad_gate.to(out_dtype), mask=inside)
        tl.store(grad_gate_up_row + width + column, (weighted * silu).to(out_dtype), mask=inside)
    tl.store(grad_weights_ptr + row, tl.sum(dot, axis=0))


@triton_op("shardtune::weighted_silu_mul_backward", mutates_args=())
def weighted_silu_mul_backward(
    gate_up: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient of ``gate_up`` in its dtype, the fp32 gradient of ``row_weights``) for the output
    ``row_weights * SiLU(gate) * up`` with gradient ``grad``; ``gate_up`` (rows, 2 * width) and ``grad``
    (rows, width) row-major, at least one row."""
    rows, width = grad.shape
    grad_gate_up = torch.empty_like(gate_up)
    grad_weights = torch.empty(rows, device=grad.device, dtype=torch.float32)
    tile = min(COLUMN_TILE, triton.next_power_of_2(width))
    wrap_triton(_weighted_silu_mul_backward_kernel)[(rows,)](
        gate_up, row_weights, grad, grad_gate_up, grad_weights, width, tile
    )
    return grad_gate_up, grad_weights

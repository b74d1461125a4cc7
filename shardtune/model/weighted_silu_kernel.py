"""The fused MoE block's weighted SiLU as Triton kernels: its backward (``fused_moe.WeightedSiluMul``), and for
frozen experts in float8 (``fused_moe.Float8Experts``) its forward and backward writing the next GEMM's rows in
e4m3.

For each row of a [gate | up] GEMM output, its routing weight w and the gradient g of w * SiLU(gate) * up,
the backward kernel writes both halves of the input gradient and the weight's gradient (a dot product over the
row) in one pass, computing in fp32 and rounding once. Written here because inductor does not make one pass of
it: it lowers the concatenation of the two halves to a kernel that loads every operand under a mask for each
output element (7 loads an element) and runs the weight's dot product as a second kernel over the same
rows, 1.7-1.9 TB/s together. This kernel reads each operand once, 4.1-4.2 TB/s, on one H200
(``benchmarks/moe_kernels.py``): 119 against 285 us at Qwen3-30B-A3B's shape (65,536 rows, 768 wide), 219
against 527 at GLM-4.5-Air's and 567 against 1,229 at Mixtral-8x7B's, with the same input gradient bit for
bit.

The float8 kernels quantize by rows (``float8.rowwise_float8``) what they compute, the activation (forward) or
the gate/up gradient (backward) as bf16 would hold it, without writing it in bf16 first: a row's largest
magnitude must be known before any of its e4m3 values, and inductor, given the torch ops, read the rows twice
(an amax pass, then a scaling pass) and in backward first wrote them in bf16. Each of these holds a row in
registers (up to 2,048 wide; the backward computes wider rows twice, the second time from the L2 cache): on one
H100, 87 against 138 us (forward) and 147 against 162 + 191 us (backward, with the quantization it replaces) at
Qwen3-30B-A3B's shape in a step's profile, 156 against 288 and 281 against 652 us at GLM-4.5-Air's
(``--float8-silu``). The backward's values and scales equal ``rowwise_float8`` of the bf16 kernel's gradient bit
for bit on a GPU.

It is a ``torch.library.triton_op``, so a compiled graph calls the kernel itself. Importing this module needs
Triton (CUDA builds of torch on Linux ship it); ``fused_moe`` uses it on CUDA tensors where it imports.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors too, which is how the CPU tests check it
(``tests/train/test_weighted_silu_kernel.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from shardtune.model import float8

FLOAT8_MAX = tl.constexpr(float8.FLOAT8_MAX)  # e4m3's largest magnitude
RECIPROCAL_FLOAT8_MAX = tl.constexpr(1 / float8.FLOAT8_MAX)

# Columns a program handles at once; wider rows take several tiles (Mixtral's 14,336). 1,024 with one row a
# program measured fastest of the tilings tried, at all three widths above.
COLUMN_TILE = 1024


@triton.jit
def _silu_backward_tile(gate_up_row, grad_row, column, inside, width: tl.constexpr, weight):
    """For the columns ``column`` of one row, in fp32: (the gate half's gradient, the up half's, the terms of the
    routing weight's gradient)."""
    gate = tl.load(gate_up_row + column, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_row + width + column, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(grad_row + column, mask=inside, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    weighted = grad * weight
    grad_gate = weighted * up * (sigmoid * (1 + gate * (1 - sigmoid)))
    return grad_gate, weighted * silu, grad * silu * up


@triton.jit
def _weighted_silu_mul_backward_kernel(
    gate_up_ptr, row_weights_ptr, grad_ptr, grad_gate_up_ptr, grad_weights_ptr, width: tl.constexpr,
    tile: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    weight = tl.load(row_weights_ptr + row).to(tl.float32)
    gate_up_row = gate_up_ptr + row * (2 * width)
    grad_gate_up_row = grad_gate_up_ptr + row * (2 * width)
    dot = tl.zeros([tile], dtype=tl.float32)
    for start in tl.static_range(0, width, tile):
        column = start + tl.arange(0, tile)
        inside = column < width
        grad_gate, grad_up, terms = _silu_backward_tile(
            gate_up_row, grad_ptr + row * width, column, inside, width, weight
        )
        dot += terms
        out_dtype = grad_gate_up_ptr.dtype.element_ty
        tl.store(grad_gate_up_row + column, grad_gate.to(out_dtype), mask=inside)
        tl.store(grad_gate_up_row + width + column, grad_up.to(out_dtype), mask=inside)
    tl.store(grad_weights_ptr + row, tl.sum(dot, axis=0))


@triton.jit
def _weighted_silu_tile(gate_up_row, column, inside, width: tl.constexpr, weight, rounded: tl.constexpr):
    """weight * SiLU(gate) * up for the columns ``column`` of one row, computed in fp32 and rounded to ``rounded``
    (the GEMM output's dtype, as the bf16 activation would be), returned in fp32."""
    gate = tl.load(gate_up_row + column, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_row + width + column, mask=inside, other=0.0).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up * weight).to(rounded).to(tl.float32)


@triton.jit
def _inverse_scale(amax):
    """448 / ``amax`` as ``rowwise_float8`` computes it on a GPU, bit for bit: torch takes a number over a tensor as
    the tensor's reciprocal (rounded to nearest, ``div_rn``; Triton's ``/`` is approximate) times the number, and a
    tensor over a number (the scale, ``amax * RECIPROCAL_FLOAT8_MAX``) as the product by its reciprocal."""
    return tl.math.div_rn(1.0, amax) * FLOAT8_MAX


@triton.jit
def _store_float8(values_row, column, inside, value, inverse_scale):
    """``value`` * ``inverse_scale`` in e4m3, saturated at its largest magnitude, as ``rowwise_float8`` makes it."""
    scaled = tl.clamp(value * inverse_scale, -FLOAT8_MAX, FLOAT8_MAX)
    tl.store(values_row + column, scaled.to(values_row.dtype.element_ty), mask=inside)


@triton.jit
def _weighted_silu_mul_float8_kernel(
    gate_up_ptr, row_weights_ptr, values_ptr, scales_ptr, width: tl.constexpr, tile: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    weight = tl.load(row_weights_ptr + row).to(tl.float32)
    gate_up_row = gate_up_ptr + row * (2 * width)
    values_row = values_ptr + row * width
    rounded = gate_up_ptr.dtype.element_ty
    column = tl.arange(0, tile)  # the whole row, in registers between its largest magnitude and its e4m3 values
    inside = column < width
    hidden = _weighted_silu_tile(gate_up_row, column, inside, width, weight, rounded)
    amax = tl.maximum(tl.max(tl.abs(hidden), axis=0), 1e-30)
    _store_float8(values_row, column, inside, hidden, _inverse_scale(amax))
    tl.store(scales_ptr + row, amax * RECIPROCAL_FLOAT8_MAX)


@triton.jit
def _rounded_silu_backward_tile(
    gate_up_row, grad_row, column, inside, width: tl.constexpr, weight, rounded: tl.constexpr
):
    """``_silu_backward_tile`` with both halves of the gradient rounded to ``rounded`` (as the bf16 gradient would
    hold them), in fp32."""
    grad_gate, grad_up, terms = _silu_backward_tile(gate_up_row, grad_row, column, inside, width, weight)
    return grad_gate.to(rounded).to(tl.float32), grad_up.to(rounded).to(tl.float32), terms


@triton.jit
def _weighted_silu_mul_backward_float8_kernel(
    gate_up_ptr, row_weights_ptr, grad_ptr, values_ptr, scales_ptr, grad_weights_ptr, width: tl.constexpr,
    tile: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    weight = tl.load(row_weights_ptr + row).to(tl.float32)
    gate_up_row = gate_up_ptr + row * (2 * width)
    grad_row = grad_ptr + row * width
    values_row = values_ptr + row * (2 * width)
    rounded = gate_up_ptr.dtype.element_ty
    if tile >= width:  # the row stays in registers between its largest magnitude and its e4m3 values
        column = tl.arange(0, tile)
        inside = column < width
        grad_gate, grad_up, terms = _rounded_silu_backward_tile(
            gate_up_row, grad_row, column, inside, width, weight, rounded
        )
        amax = tl.maximum(tl.max(tl.maximum(tl.abs(grad_gate), tl.abs(grad_up)), axis=0), 1e-30)
        inverse_scale = _inverse_scale(amax)
        _store_float8(values_row, column, inside, grad_gate, inverse_scale)
        _store_float8(values_row + width, column, inside, grad_up, inverse_scale)
        dot = tl.sum(terms, axis=0)
    else:  # wider rows: computed twice, the second time from what the first read into the L2 cache
        largest = tl.zeros([tile], dtype=tl.float32)
        dots = tl.zeros([tile], dtype=tl.float32)
        for start in tl.static_range(0, width, tile):
            column = start + tl.arange(0, tile)
            inside = column < width
            grad_gate, grad_up, terms = _rounded_silu_backward_tile(
                gate_up_row, grad_row, column, inside, width, weight, rounded
            )
            largest = tl.maximum(largest, tl.maximum(tl.abs(grad_gate), tl.abs(grad_up)))
            dots += terms
        amax = tl.maximum(tl.max(largest, axis=0), 1e-30)
        inverse_scale = _inverse_scale(amax)
        for start in tl.static_range(0, width, tile):
            column = start + tl.arange(0, tile)
            inside = column < width
            grad_gate, grad_up, _ = _rounded_silu_backward_tile(
                gate_up_row, grad_row, column, inside, width, weight, rounded
            )
            _store_float8(values_row, column, inside, grad_gate, inverse_scale)
            _store_float8(values_row + width, column, inside, grad_up, inverse_scale)
        dot = tl.sum(dots, axis=0)
    tl.store(scales_ptr + row, amax * RECIPROCAL_FLOAT8_MAX)
    tl.store(grad_weights_ptr + row, dot)


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


# The widest row the float8 kernels hold in registers at once (GLM-4.5-Air's 1,408 columns fit). The backward
# takes wider rows (Mixtral-8x7B's 14,336) in tiles of COLUMN_TILE, computed twice, still faster than writing and
# quantizing the bf16 gradient (1,101 against 1,309 us on one H100); the forward's rows wider than this are left
# to inductor, whose two passes were faster there (587 against 697 us).
FLOAT8_ROW_TILE = 2048


def _float8_tile(width: int) -> int:
    whole = triton.next_power_of_2(width)
    return whole if whole <= FLOAT8_ROW_TILE else COLUMN_TILE


@triton_op("shardtune::weighted_silu_mul_float8", mutates_args=())
def weighted_silu_mul_float8(gate_up: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rowwise_float8`` of ``row_weights * SiLU(gate) * up`` as the GEMM output's dtype holds it, (e4m3 values,
    fp32 scale of each row), without writing that activation: the down projection's operand in float8
    (``fused_moe.Float8Experts``). ``gate_up`` (rows, 2 * width) row-major, at least one row, width at most
    ``FLOAT8_ROW_TILE``."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert width <= FLOAT8_ROW_TILE, f"rows of {width} exceed the kernel's {FLOAT8_ROW_TILE}"
    values = torch.empty(rows, width, device=gate_up.device, dtype=float8.FLOAT8)
    scales = torch.empty(rows, device=gate_up.device, dtype=torch.float32)
    wrap_triton(_weighted_silu_mul_float8_kernel)[(rows,)](
        gate_up, row_weights, values, scales, width, triton.next_power_of_2(width)
    )
    return values, scales


@triton_op("shardtune::weighted_silu_mul_backward_float8", mutates_args=())
def weighted_silu_mul_backward_float8(
    gate_up: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weighted_silu_mul_backward`` with the gradient of ``gate_up`` as ``rowwise_float8`` makes it from the
    dtype of ``gate_up``: (e4m3 values, fp32 scale of each row, the fp32 gradient of ``row_weights``), the gate/up
    input gradient's GEMM operand, without writing the gradient in that dtype first."""
    rows, width = grad.shape
    values = torch.empty(rows, 2 * width, device=grad.device, dtype=float8.FLOAT8)
    scales = torch.empty(rows, device=grad.device, dtype=torch.float32)
    grad_weights = torch.empty(rows, device=grad.device, dtype=torch.float32)
    wrap_triton(_weighted_silu_mul_backward_float8_kernel)[(rows,)](
        gate_up, row_weights, grad, values, scales, grad_weights, width, _float8_tile(width)
    )
    return values, scales, grad_weights

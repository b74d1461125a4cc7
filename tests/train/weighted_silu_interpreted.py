"""Run by ``test_weighted_silu_kernel.py`` with TRITON_INTERPRET=1 set (the Triton kernels then run on CPU
tensors): the weighted SiLU's backward kernel against the same math in fp32 torch ops, its float8 kernels
against ``rowwise_float8`` of the same math, and a fused MoE model whose every gradient is the same through the
kernel as through the torch ops (``tests`` on PYTHONPATH, for tiny_models). Exits non-zero, with the reason,
when one differs; prints the kernel's call count on success.

The interpreter's own fp32 -> e4m3 conversion does not carry a rounding into the exponent (126.9 becomes 64, not
128) nor make subnormals, so the float8 kernels' values are compared with what that same conversion makes of
the expected scaled values (``interpreted_float8``): this checks everything the kernels compute up to the
conversion, which the GPU test checks against torch's."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model import fused_moe
from shardtune.model.float8 import FLOAT8, FLOAT8_MAX
from shardtune.model.triton_kernels import INTERPRETED
from shardtune.model.weighted_silu_kernel import (
    FLOAT8_ROW_TILE,
    weighted_silu_mul_backward,
    weighted_silu_mul_backward_float8,
    weighted_silu_mul_float8,
)


def in_fp32(gate_up: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad = grad.float()
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    weighted = grad * row_weights.unsqueeze(-1)
    grad_gate = weighted * up * sigmoid * (1 + gate * (1 - sigmoid))
    return torch.cat([grad_gate, weighted * silu], dim=-1), (grad * silu * up).sum(dim=-1)


def check_kernel() -> None:
    generator = torch.Generator().manual_seed(0)
    # (rows, width, dtype): widths of one partial tile, two tiles (1,024 columns each) and a tile of 8
    cases = [(7, 48, torch.bfloat16), (3, 1100, torch.bfloat16), (5, 40, torch.float32), (1, 8, torch.bfloat16)]
    for rows, width, dtype in cases:
        gate_up = (torch.randn(rows, 2 * width, generator=generator) * 3).to(dtype)
        row_weights = torch.rand(rows, generator=generator)
        grad = torch.randn(rows, width, generator=generator).to(dtype)
        grad_gate_up, grad_weights = weighted_silu_mul_backward(gate_up, row_weights, grad)
        expected, expected_weights = in_fp32(gate_up, row_weights, grad)
        assert grad_gate_up.dtype == dtype and grad_weights.dtype == torch.float32
        # within one rounding to the output's dtype of the fp32 result (a unit in the last place)
        unit = torch.finfo(dtype).eps
        error = (grad_gate_up.float() - expected).abs() - unit * expected.abs()
        assert error.max().item() <= 1e-6, f"{rows}x{width} {dtype}: input gradient off by {error.max().item()}"
        scale = expected_weights.abs().max().item()
        off = (grad_weights - expected_weights).abs().max().item()
        assert off <= 1e-5 * scale, f"{rows}x{width} {dtype}: weight gradient off by {off} of {scale}"


@triton.jit
def _to_float8_kernel(source_ptr, values_ptr, count, block: tl.constexpr):
    offsets = tl.arange(0, block)
    inside = offsets < count
    tl.store(
        values_ptr + offsets, tl.load(source_ptr + offsets, mask=inside).to(values_ptr.dtype.element_ty), mask=inside
    )


def interpreted_float8(rows: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rowwise_float8(rows)`` as torch computes it on a GPU (448 / amax as amax's reciprocal times 448, the scale
    as amax times 1 / 448), with the e4m3 conversion the interpreter runs (see the module's docstring); with
    ``scales``, those scales of the rows instead of their own."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-30)
    if scales is not None:
        amax = scales.unsqueeze(-1) * FLOAT8_MAX
    scaled = (rows.float() * (amax.reciprocal() * FLOAT8_MAX)).clamp(-FLOAT8_MAX, FLOAT8_MAX).contiguous()
    values = torch.empty(scaled.shape, dtype=FLOAT8)
    count = scaled.numel()
    _to_float8_kernel[(1,)](scaled, values, count, triton.next_power_of_2(count))
    return values, (amax * torch.tensor(1 / FLOAT8_MAX, dtype=torch.float32)).squeeze(-1)


def check_float8_kernels() -> None:
    """The backward's float8 kernel: exactly the bf16 kernel's gate/up gradient quantized by rows, and its weight
    gradient to fp32's summation order; the forward's (rows it holds): the scales of the fp32 math rounded to the
    rows' dtype, and for fp32 rows their values."""
    generator = torch.Generator().manual_seed(1)
    # (rows, width, dtype): one tile of a partial row, a row of 1,100 in one tile, fp32 rows, 2,100 fp32 columns,
    # wider than the kernels hold at once (the backward's two passes over three tiles), and 2,000 in one tile
    cases = [
        (7, 48, torch.bfloat16),
        (3, 1100, torch.bfloat16),
        (5, 40, torch.float32),
        (2, 2100, torch.float32),
        (3, 2000, torch.float32),
    ]
    for rows, width, dtype in cases:
        gate_up = (torch.randn(rows, 2 * width, generator=generator) * 3).to(dtype)
        gate_up[0] = 0  # a row of zeros: scale ~0, zero values
        row_weights = torch.rand(rows, generator=generator)
        grad = torch.randn(rows, width, generator=generator).to(dtype)
        values, scales, grad_weights = weighted_silu_mul_backward_float8(gate_up, row_weights, grad)
        expected, expected_weights = weighted_silu_mul_backward(gate_up, row_weights, grad)
        expected_values, expected_scales = interpreted_float8(expected)
        assert values.dtype == FLOAT8 and values.shape == (rows, 2 * width)
        assert torch.equal(scales, expected_scales), f"{rows}x{width} {dtype}: backward scales differ"
        assert torch.equal(values.float(), expected_values.float()), f"{rows}x{width} {dtype}: backward values differ"
        # summed in tiles of another width than the bf16 kernel's
        off = (grad_weights - expected_weights).abs().max().item()
        assert off <= 1e-5 * expected_weights.abs().max().item(), f"{rows}x{width} {dtype}: weight gradients differ"
        assert values[0].float().abs().max() == 0 and scales[0] < 1e-30

        if width > FLOAT8_ROW_TILE:  # the forward leaves rows this wide to inductor (Float8Experts)
            continue
        values, scales = weighted_silu_mul_float8(gate_up, row_weights)
        gate, up = gate_up.float().chunk(2, dim=-1)
        hidden = (gate * torch.sigmoid(gate) * up * row_weights.unsqueeze(-1)).to(dtype)
        expected_scales = interpreted_float8(hidden)[1]
        assert values.dtype == FLOAT8 and values.shape == (rows, width)
        off = (scales - expected_scales).abs() / expected_scales.clamp(min=1e-30)
        assert off.max() <= torch.finfo(dtype).eps, f"{rows}x{width} {dtype}: forward scales off by {off.max()}"
        if dtype == torch.float32:
            # The values at the kernel's scales (rows in bf16 are rounded by the interpreter otherwise than by
            # torch, which its e4m3 conversion can make a factor of 2; the GPU test checks those).
            expected = interpreted_float8(hidden, scales)[0].float()
            differ = (values.float() != expected).float().mean().item()
            assert differ <= 0.01, f"{rows}x{width} {dtype}: {differ:.1%} of the forward values differ"


def gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def check_block() -> int:
    """Every gradient of a tiny Qwen3-MoE model with fused experts through the kernel and through the torch
    ops (fp32, where the two compute alike); the number of kernel calls."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.float32)
    model.config.use_cache = False
    fused_moe.use_fused_experts(model, decoder_layers(model), "fused")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    calls = []
    kernel = fused_moe.weighted_silu_mul_backward

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    fused_moe.weighted_silu_mul_backward = counted
    through_kernel = gradients(model, ids)
    fused_moe.weighted_silu_mul_backward = None
    through_ops = gradients(model, ids)
    assert through_kernel.keys() == through_ops.keys()
    for name, expected in through_ops.items():
        scale = expected.abs().max().item()
        off = (through_kernel[name] - expected).abs().max().item()
        assert off <= 1e-5 * scale + 1e-9, f"{name}: off by {off} of {scale}"
    return len(calls)


if __name__ == "__main__":
    if not INTERPRETED:
        sys.exit("run with TRITON_INTERPRET=1")
    check_kernel()
    check_float8_kernels()
    print(f"kernel calls: {check_block()}")

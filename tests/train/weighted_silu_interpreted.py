"""Run by ``test_weighted_silu_kernel.py`` with TRITON_INTERPRET=1 set (the Triton kernel then runs on CPU
tensors): the weighted SiLU's backward kernel against the same math in fp32 torch ops, and a fused MoE
model whose every gradient is the same through the kernel as through the torch ops (``tests`` on
PYTHONPATH, for tiny_models). Exits non-zero, with the reason, when one differs; prints the kernel's call
count on success."""

from __future__ import annotations

import sys

import torch
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model import fused_moe
from shardtune.model.weighted_silu_kernel import INTERPRETED, weighted_silu_mul_backward


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
    print(f"kernel calls: {check_block()}")

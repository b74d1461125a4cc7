"""Run by ``test_float8_grouped_kernel.py`` with TRITON_INTERPRET=1 set (the Triton kernels then run on CPU
tensors): the float8 grouped GEMM kernel against the fp32 emulation of the same product, and a tiny bf16
Qwen3-MoE model with float8 experts whose loss and gradients through the kernel equal those through the
emulation to bf16's rounding (``tests`` on PYTHONPATH, for tiny_models). Exits non-zero, with the reason, when
one differs; prints the kernel's call count on success.

The interpreter converts fp32 to bf16 toward zero, not to nearest, so its outputs may be a whole unit in the last
place from the fp32 product, where a GPU's are within half a unit (the GPU test checks the kernel bit for bit
against torch's)."""

from __future__ import annotations

import sys

import torch
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model import fused_moe
from shardtune.model.float8 import float8_grouped_mm, quantize_expert_weight, rowwise_float8
from shardtune.model.float8_grouped_kernel import BLOCK_K, BLOCK_M, BLOCK_N
from shardtune.model.triton_kernels import INTERPRETED


def check_kernel() -> None:
    """Row counts with experts of no row, one row, and more rows than a row tile; an expert count that is not a
    power of two; N and K that are not multiples of the tiles' (the rows and columns past them masked)."""
    generator = torch.Generator().manual_seed(0)
    cases = [([0, BLOCK_M + 2, 1, 0, 2 * BLOCK_M + 1], BLOCK_N + 64, BLOCK_K + 16), ([3, 17, 0], 48, 32)]
    for counts, columns, depth in cases:
        bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        weight = torch.randn(len(counts), columns, depth, generator=generator) * 0.05
        values, scales, _, _ = quantize_expert_weight(weight)
        rows = rowwise_float8(torch.randn(sum(counts), depth, generator=generator) * 3)
        got = float8_grouped_mm(*rows, values, scales, bounds, torch.bfloat16, "triton")
        exact = float8_grouped_mm(*rows, values, scales, bounds, torch.float32, "torch")  # the fp32 emulation
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        # rounded once to bf16 from the fp32 sum (toward zero: a unit in the last place), summed in another order
        off = ((got.float() - exact).abs() - 2**-7 * exact.abs()).max().item()
        assert off <= 1e-5 * exact.abs().max().item(), f"{counts} {columns}x{depth}: off by {off}"


def loss_and_gradients(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), model.get_input_embeddings().weight.grad.float()


def check_model() -> int:
    """A bf16 model with float8 experts, through the kernel and through the emulation: the loss to 1e-3, the
    embedding's gradient (through every layer's experts, forward and backward) to 2e-2 of its norm; the number of
    kernel calls."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)
    model.config.use_cache = False
    layers = decoder_layers(model)
    fused_moe.use_fused_experts(model, layers, "fused")
    model.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(True)
    blocks, backend = fused_moe.use_float8_experts(model)
    assert (blocks, backend) == (len(layers), "triton"), (blocks, backend)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.profiler.profile() as profile:
        loss, grad = loss_and_gradients(model, ids)
    calls = sum(event.count for event in profile.key_averages() if event.key == "shardtune::float8_grouped_mm")
    for block in fused_moe.find_moe_blocks(model, layers):
        block.block.experts.float8_grouped_gemm = "torch"
    expected_loss, expected_grad = loss_and_gradients(model, ids)
    assert abs(loss - expected_loss) <= 1e-3 * abs(expected_loss), (loss, expected_loss)
    off = ((grad - expected_grad).norm() / expected_grad.norm()).item()
    assert off <= 2e-2, f"embedding gradient off by {off:.1e}"
    return calls


if __name__ == "__main__":
    if not INTERPRETED:
        sys.exit("run with TRITON_INTERPRET=1")
    check_kernel()
    print(f"kernel calls: {check_model()}")

"""The fused MoE block's weighted SiLU backward as one Triton kernel (``weighted_silu_kernel.py``): on CPU under
Triton's interpreter (a child process, because TRITON_INTERPRET must be set before Triton is imported), and
compiled on a GPU (``SHARDTUNE_TEST_GPU=1 python -m pytest -m gpu``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import kernel_sized_qwen3_moe
from transformers import AutoModelForCausalLM

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model import fused_moe

pytest.importorskip("triton")  # CUDA builds of torch ship it; the dev extra installs it on Linux x86-64

CHECK = Path(__file__).with_name("weighted_silu_interpreted.py")


def test_the_kernel_equals_the_torch_ops_and_serves_the_fused_block():
    """Interpreted on CPU: the kernel's input gradient is within one rounding of the fp32 math and its weight
    gradient within 1e-5, for widths of a partial tile, two tiles and fp32 rows; a tiny Qwen3-MoE model's every
    gradient is the same through the kernel as through the torch ops, and its two MoE layers call the kernel."""
    tests = str(CHECK.parent.parent)  # for tiny_models
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "kernel calls: 2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_compiled_bf16_blocks_train_through_the_kernel_like_through_inductors_kernels():
    """On a GPU, a compiled bf16 Qwen3-MoE model's loss and gradients through the kernel are those of the same
    model through inductor's kernels for the torch ops, to bf16's precision, and the compiled backward graphs
    call the kernel."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(kernel_sized_qwen3_moe(), dtype=torch.bfloat16).cuda()
    base.config.use_cache = False
    fused_moe.use_fused_experts(base, decoder_layers(base), "fused", "torch", torch.device("cuda"))
    ids = torch.randint(0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def step(kernel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = copy.deepcopy(base).train()
        for layer in decoder_layers(model):
            layer.compile(fullgraph=True)
        saved, fused_moe.weighted_silu_mul_backward = fused_moe.weighted_silu_mul_backward, kernel
        try:
            torch._dynamo.reset()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            fused_moe.weighted_silu_mul_backward = saved
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    from torch._inductor.utils import run_and_get_code

    (loss, grads), code = run_and_get_code(step, fused_moe.weighted_silu_mul_backward)
    assert any("_weighted_silu_mul_backward_kernel" in source for source in code)
    expected_loss, expected = step(None)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=0)
    assert grads.keys() == expected.keys()
    for name, value in expected.items():
        scale = value.float().abs().max().item()
        off = (grads[name].float() - value.float()).abs().max().item()
        assert off <= 0.05 * scale + 1e-6, f"{name}: off by {off} of {scale}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
# Qwen3-30B-A3B's, GLM-4.5-Air's, and one the backward takes in two passes
@pytest.mark.parametrize("width", [768, 1408, 2100])
def test_the_float8_kernels_on_a_gpu_quantize_as_rowwise_float8(width):
    """On a GPU the float8 kernels write ``rowwise_float8`` of what they quantize, as torch computes it there: the
    backward's of the bf16 kernel's gate/up gradient bit for bit (the weight gradient to fp32's summation order);
    the forward's (rows it holds) of the weighted SiLU computed in fp32 and rounded to bf16, where Triton's sigmoid
    is not torch's:
    scales to bf16's rounding of the largest value, e4m3 values at equal scales equal but for a rare one-step
    difference."""
    from shardtune.model.float8 import rowwise_float8
    from shardtune.model.weighted_silu_kernel import (
        FLOAT8_ROW_TILE,
        weighted_silu_mul_backward_float8,
        weighted_silu_mul_float8,
    )

    generator = torch.Generator("cuda").manual_seed(2)
    rows = 4096
    gate_up = (torch.randn(rows, 2 * width, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    gate_up[0] = 0
    row_weights = torch.rand(rows, device="cuda", generator=generator)
    grad = torch.randn(rows, width, device="cuda", generator=generator).to(torch.bfloat16)

    values, scales, grad_weights = weighted_silu_mul_backward_float8(gate_up, row_weights, grad)
    expected, expected_weights = fused_moe.weighted_silu_mul_backward(gate_up, row_weights, grad)
    expected_values, expected_scales = rowwise_float8(expected)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert scales[0] < 1e-30 and values[0].float().abs().max() == 0  # the row of zeros
    torch.testing.assert_close(
        grad_weights, expected_weights, rtol=1e-5, atol=1e-5 * expected_weights.abs().max().item()
    )

    if width > FLOAT8_ROW_TILE:  # the forward leaves rows this wide to inductor
        return
    values, scales = weighted_silu_mul_float8(gate_up, row_weights)
    gate, up = gate_up.float().chunk(2, dim=-1)
    hidden = (gate * torch.sigmoid(gate) * up * row_weights.unsqueeze(-1)).to(torch.bfloat16)
    expected_values, expected_scales = rowwise_float8(hidden)
    assert values.shape == expected_values.shape and values.dtype == expected_values.dtype
    torch.testing.assert_close(scales, expected_scales, rtol=2**-8, atol=0)
    assert scales[0] < 1e-30 and values[0].float().abs().max() == 0  # the row of zeros
    same_scale = scales == expected_scales
    assert same_scale.float().mean() > 0.25
    got, wanted = values[same_scale].float(), expected_values[same_scale].float()
    assert ((got - wanted).abs() <= wanted.abs() / 8 + 2**-9).all()
    assert (got != wanted).float().mean().item() < 2e-3

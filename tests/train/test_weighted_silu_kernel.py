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

"""The float8 experts' grouped GEMM as shardtune's Triton kernel (``float8_grouped_kernel.py``): on CPU under
Triton's interpreter (a child process, because TRITON_INTERPRET must be set before Triton is imported) against
the fp32 emulation, kernel and model; on a Hopper GPU (``SHARDTUNE_TEST_GPU=1 python -m pytest -m gpu``) bit for
bit against ``torch._scaled_grouped_mm``, and a compiled model trains through it as through torch's kernel."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.float8 import (
    float8_grouped_mm,
    quantize_expert_weight,
    resolve_float8_grouped_gemm,
    rowwise_float8,
)

pytest.importorskip("triton")  # CUDA builds of torch ship it; the dev extra installs it on Linux x86-64

CHECK = Path(__file__).with_name("float8_grouped_interpreted.py")


def test_the_kernel_equals_the_emulation_and_serves_the_float8_experts():
    """Interpreted on CPU: the kernel's product is the fp32 emulation's to bf16's rounding, with experts of no row,
    one row and several row tiles, and N and K off the tiles; a bf16 model with float8 experts has the same loss and
    gradient through it, and its two MoE layers call it for both projections, forward and backward."""
    tests = str(CHECK.parent.parent)  # for tiny_models
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "kernel calls: 8"


def test_model_grouped_gemm_picks_the_float8_kernel():
    """``model.grouped_gemm: torch`` keeps torch's float8 grouped GEMM; elsewhere the kernel runs where it was
    measured (Hopper GPUs), and not on a CPU outside the interpreter."""
    assert resolve_float8_grouped_gemm("auto", torch.device("cpu")) == "torch"
    assert resolve_float8_grouped_gemm("torch", torch.device("cpu")) == "torch"
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert resolve_float8_grouped_gemm("auto", torch.device("cuda")) == ("triton" if hopper else "torch")
        assert resolve_float8_grouped_gemm("quack", torch.device("cuda")) == ("triton" if hopper else "torch")
        assert resolve_float8_grouped_gemm("torch", torch.device("cuda")) == "torch"


def test_a_kernel_that_fails_hands_the_experts_to_torchs_once(monkeypatch, caplog):
    """A kernel that does not build or launch (here: a stand-in that raises, as a Triton without this GPU's
    kernels would): the op returns torch's product, says so once, and does not try the kernel again."""
    from shardtune.model import float8_grouped_kernel

    launches = []

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise RuntimeError("no kernel image is available for execution on the device")

            return launch

    monkeypatch.setattr(float8_grouped_kernel, "_grouped_float8_gemm_kernel", Failing())
    monkeypatch.setattr(float8_grouped_kernel._Kernel, "compiled", {})
    monkeypatch.setattr(float8_grouped_kernel._Kernel, "failure", None)
    caplog.set_level("WARNING", logger="shardtune")
    generator = torch.Generator().manual_seed(1)
    counts = [3, 0, 20]
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    values, scales, _, _ = quantize_expert_weight(torch.randn(len(counts), 32, 48, generator=generator) * 0.05)
    rows = rowwise_float8(torch.randn(sum(counts), 48, generator=generator))
    got = [torch.ops.shardtune.float8_grouped_mm(*rows, values, scales, bounds) for _ in range(2)]
    expected = float8_grouped_mm(*rows, values, scales, bounds, torch.bfloat16, "torch")
    assert all(torch.equal(result, expected) for result in got)
    assert len(launches) == 1
    line = (
        "model.grouped_gemm: shardtune's float8 grouped GEMM failed (RuntimeError: no kernel image is available "
        "for execution on the device); torch's computes the float8 experts from here on"
    )
    assert caplog.text.count(line) == 1


def hopper() -> torch.device:
    cuda = torch.device("cuda")
    if torch.cuda.get_device_capability(cuda)[0] != 9:
        pytest.skip("the kernel runs on Hopper GPUs")
    return cuda


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize(
    "experts, columns, depth",
    [(32, 1536, 2048), (32, 2048, 768), (16, 1408, 4096), (8, 4096, 1408), (5, 80, 48)],
)
def test_the_kernel_equals_torchs_scaled_grouped_mm_bit_for_bit(experts, columns, depth):
    """At the expert GEMMs' shapes of Qwen3-30B-A3B and GLM-4.5-Air (fewer experts) and a tiny one: a long-tailed
    load with experts of no row and row counts off the tiles; the same bf16 output as torch._scaled_grouped_mm with
    fast accumulation, bit for bit."""
    cuda = hopper()
    generator = torch.Generator().manual_seed(experts)
    shares = torch._sample_dirichlet(torch.full((experts,), 0.5), generator)
    counts = torch.multinomial(shares, 64 * experts + 7, replacement=True, generator=generator).bincount(
        minlength=experts
    )
    counts[1] = 0
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device=cuda, dtype=torch.int32)
    weight = torch.randn(experts, columns, depth, generator=generator).to(cuda) * 0.02
    values, scales, _, _ = quantize_expert_weight(weight)
    rows = rowwise_float8(torch.randn(int(counts.sum()), depth, generator=generator).to(cuda, torch.bfloat16))
    got = float8_grouped_mm(*rows, values, scales, bounds, torch.bfloat16, "triton")
    expected = float8_grouped_mm(*rows, values, scales, bounds, torch.bfloat16, "torch")
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_a_compiled_model_trains_through_the_kernel_as_through_torchs():
    """A compiled bf16 Qwen3-MoE model with float8 experts: the loss and the gradient through every layer are those
    through torch._scaled_grouped_mm to bf16's precision (inductor compiles the ops around each GEMM apart, so
    their sums may round otherwise), and the compiled graphs call the kernel."""
    from tiny_models import kernel_sized_qwen3_moe
    from torch._inductor.utils import run_and_get_code
    from transformers import AutoModelForCausalLM

    from shardtune.model import fused_moe

    cuda = hopper()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(kernel_sized_qwen3_moe(), dtype=torch.bfloat16).cuda()
    base.config.use_cache = False
    layers = decoder_layers(base)
    fused_moe.use_fused_experts(base, layers, "fused", "torch", cuda)
    base.requires_grad_(False)
    base.get_input_embeddings().requires_grad_(True)  # a gradient through every layer, as LoRA's needs
    assert fused_moe.use_float8_experts(base, "auto") == (len(layers), "triton")
    ids = torch.randint(0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def step(backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        model = copy.deepcopy(base).train()
        for block in fused_moe.find_moe_blocks(model, decoder_layers(model)):
            block.block.experts.float8_grouped_gemm = backend
        for layer in decoder_layers(model):
            layer.compile(fullgraph=True)
        torch._dynamo.reset()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), model.get_input_embeddings().weight.grad

    (loss, grad), code = run_and_get_code(step, "triton")
    assert any("torch.ops.shardtune.float8_grouped_mm.default" in source for source in code)
    expected_loss, expected_grad = step("torch")
    torch.testing.assert_close(loss, expected_loss, rtol=2e-3, atol=0)
    assert ((grad.float() - expected_grad.float()).norm() / expected_grad.float().norm()).item() < 1e-2

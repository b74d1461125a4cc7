"""The fused MoE block's routing kernels (``routing_kernels.py``: top-k experts, the pairs in expert order): on
CPU under Triton's interpreter (a child process, because TRITON_INTERPRET must be set before Triton is
imported), and on a GPU (``SHARDTUNE_TEST_GPU=1 python -m pytest -m gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # CUDA builds of torch ship it; the dev extra installs it on Linux x86-64

CHECK = Path(__file__).with_name("routing_kernels_interpreted.py")


def test_the_kernels_equal_the_torch_ops_and_serve_every_routing_rule():
    """Interpreted on CPU: the expert order is torch.sort's stable one (with its inverse and bounds) for
    partial and many chunks, empty experts and one expert taking every pair; the top-k is torch.topk's, the lower
    index first among ties and NaN first; for an architecture of each routing rule, the loss and gradients through
    the kernels are those through the torch ops, and every MoE layer calls both kernels."""
    tests = str(CHECK.parent.parent)  # for tiny_models
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "top_k_experts: 8 expert_order: 8"  # 4 models x 2 MoE layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize("experts, top_k, tokens", [(128, 8, 8192), (8, 2, 4096), (160, 8, 3000)])
def test_on_a_gpu_the_kernels_equal_the_torch_ops_compiled_and_eager(experts, top_k, tokens):
    """On a GPU, eager and compiled, at Qwen3-30B-A3B's, Mixtral's and an odd shape: the top-k of softmax scores
    is torch.topk's, and the expert order of a skewed load torch.sort's, with its inverse and each expert's bounds."""
    from shardtune.model.routing_kernels import expert_order, top_k_experts

    generator = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=generator)
    logits[:, 3] += 2.0  # a skewed load: expert 3 in almost every token's choice
    scores = logits.softmax(dim=-1)

    def route(scores: torch.Tensor) -> tuple[torch.Tensor, ...]:
        chosen = top_k_experts(scores, top_k)
        return (chosen, *expert_order(chosen.reshape(-1), experts))

    expected_chosen = scores.topk(top_k, dim=-1).indices
    expected_ids, expected_order = torch.sort(expected_chosen.reshape(-1), stable=True)
    expected_inverse = torch.empty_like(expected_order).scatter_(
        0, expected_order, torch.arange(expected_order.numel(), device="cuda")
    )
    counts = torch.bincount(expected_ids, minlength=experts)
    expected_bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    expected = (expected_chosen, expected_order, expected_inverse, expected_bounds)
    for run in (route, torch.compile(route, fullgraph=True)):
        for got, want in zip(run(scores), expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)

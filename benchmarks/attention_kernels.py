"""Causal bf16 attention on one GPU: sdpa (as transformers calls it: default backend choice, and cuDNN forced)
against FlashAttention-4 (the flash-attn-4 package, CuTe DSL kernels), forward and backward timed apart, and
how far each lands from fp32 attention.

    python benchmarks/attention_kernels.py          (needs flash-attn-4; results/attention_h200.txt)
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from flash_attn.cute import flash_attn_func
from torch.nn.attention import SDPBackend, sdpa_kernel

# (batch, sequence, query heads, key/value heads, head dim)
SHAPES = {
    "qwen3-30b-a3b": (2, 4096, 32, 4, 128),
    "glm-4.5-air": (2, 4096, 96, 8, 128),
    "llama/mixtral": (2, 4096, 32, 8, 128),
    "qwen3 seq 8192 b1": (1, 8192, 32, 4, 128),
}


def device_us(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def sdpa(q, k, v, backend=None):
    with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
        bhsd = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(*bhsd, is_causal=True, enable_gqa=True).transpose(1, 2)


def flash4(q, k, v):
    out = flash_attn_func(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out


def compare(name: str, batch: int, seq: int, heads: int, kv_heads: int, dim: int) -> None:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, seq, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    forward_flops = 4 * batch * seq * seq / 2 * heads * dim  # causal: half the score matrix
    started = time.time()
    torch.autograd.grad(flash4(q, k, v), (q, k, v), grad)
    torch.cuda.synchronize()
    print(f"{name} {(batch, seq, heads, kv_heads, dim)}: FA4's first call (its compile) {time.time() - started:.1f} s")
    kernels = {
        "sdpa default": lambda: sdpa(q, k, v),
        "sdpa cudnn": lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
        "FA4": lambda: flash4(q, k, v),
    }
    for label, attend in kernels.items():
        forward = device_us(attend)
        both = device_us(lambda attend=attend: torch.autograd.grad(attend(), (q, k, v), grad))
        backward = both - forward
        print(
            f"  {label:13s} fwd {forward:8.1f} us ({forward_flops / forward / 1e6:5.0f} TFLOP/s)  "
            f"bwd {backward:8.1f} us ({2.5 * forward_flops / backward / 1e6:5.0f} TFLOP/s)  total {both:8.1f}"
        )
    exact = sdpa(q.float(), k.float(), v.float())
    cudnn, mine = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), flash4(q, k, v)
    pairs = zip(torch.autograd.grad(mine, (q, k, v), grad), torch.autograd.grad(cudnn, (q, k, v), grad), strict=True)
    relative = " ".join(f"{(a.float() - b.float()).norm() / b.float().norm():.2e}" for a, b in pairs)
    off_cudnn, off_mine = (cudnn.float() - exact).abs().max(), (mine.float() - exact).abs().max()
    print(f"  max |out - fp32|: cudnn {off_cudnn:.2e} FA4 {off_mine:.2e}; grads FA4 vs cudnn, relative: {relative}")


def main() -> None:
    for name, shape in SHAPES.items():
        compare(name, *shape)


if __name__ == "__main__":
    main()

"""FlexAttention's forward and backward under masks of equal sparsity: a plain causal mask function (transformers'
mask of full rows), the same with a sliding window as long as the rows (Gemma 2's sliding layers at seq 4,096), and
shardtune's mask of packed rows (``shardtune.model.packed_attention``) with one document a row; with and without
Gemma 2's cap on the scores. Milliseconds a call (compiled, synchronized, after three warm-up calls), and the
masks' block counts.

    python benchmarks/flex_masks.py          (a GPU; results/flex_masks_h100.txt)
"""

from __future__ import annotations

import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from shardtune.model.packed_attention import compiled_create_block_mask, packed_block_mask

# (name, rows, query heads, key/value heads, sequence, head width, cap on the scores or None)
SHAPES = [("gemma2-9b", 2, 16, 8, 4096, 256, 50.0), ("llama3-8b", 2, 32, 8, 4096, 128, None)]
CALLS = 10


def causal(batch, head, query, key):
    return query >= key


def sliding_4096(batch, head, query, key):
    return (query >= key) & (query - key < 4096)


def capped_at(cap: float):
    def capped(score, batch, head, query, key):
        return cap * torch.tanh(score / cap)

    return capped


def milliseconds(flex, q, k, v, score_mod, mask) -> float:
    """One forward and backward, timed over ``CALLS`` calls after three."""

    def call():
        out = flex(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        out.sum().backward()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    # One compiled FlexAttention serves every mask and score function below: one variant each.
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention)
    for name, rows, heads, kv_heads, length, width, cap in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(rows, heads, length, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(rows, kv_heads, length, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2)
        )
        positions = torch.arange(length, device="cuda").expand(rows, length).contiguous()
        masks = {
            "causal": compiled_create_block_mask()(causal, rows, None, length, length, device="cuda"),
            "sliding 4096": compiled_create_block_mask()(sliding_4096, rows, None, length, length, device="cuda"),
            "packed rows": packed_block_mask(positions),
        }
        for mask_name, mask in masks.items():
            for score_mod in [None, capped_at(cap)] if cap else [None]:
                ms = milliseconds(flex, q, k, v, score_mod, mask)
                blocks = f"{int(mask.kv_num_blocks.sum())} partial, {int(mask.full_kv_num_blocks.sum())} full blocks"
                print(f"{name:10s} {mask_name:13s} {'capped' if score_mod else 'uncapped':9s} {ms:7.3f} ms  {blocks}")


if __name__ == "__main__":
    main()

"""Run by ``test_routing_kernels.py`` with TRITON_INTERPRET=1 set (the Triton kernels then run on CPU tensors):
the routing kernels against the torch ops they replace, and fused MoE models whose loss and gradients are the
same through the kernels as through the torch ops (``tests`` on PYTHONPATH, for tiny_models). Exits non-zero,
with the reason, when one differs; prints the kernels' call counts on success."""

from __future__ import annotations

import sys

import torch
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.distributed.parallelize import decoder_layers
from shardtune.model import fused_moe, routing_kernels
from shardtune.model.triton_kernels import INTERPRETED


def sorted_by_expert(expert_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    """What the kernels replace: a stable sort, its inverse, and each expert's rows bounds[e]:bounds[e + 1]."""
    expert_of_row, order = torch.sort(expert_ids, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(expert_of_row, minlength=experts)
    return order, inverse, torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def check_expert_order() -> None:
    generator = torch.Generator().manual_seed(0)
    chunk = routing_kernels.CHUNK
    # (pairs, experts, how): a partial chunk, several chunks with a partial last one, experts not a power of
    # two, more chunks than the count table's rows a program reads at once, no pair at all
    cases = [(37, 5, "random"), (3 * chunk + 11, 8, "random"), (2 * chunk, 60, "random"),
             (17 * chunk + 1, 4, "random"), (0, 8, "random"), (chunk + 5, 16, "one expert"),
             (chunk + 5, 16, "all but two empty"), (1, 3, "random")]  # fmt: skip
    for pairs, experts, how in cases:
        ids = torch.randint(0, experts, (pairs,), generator=generator)
        if how == "one expert":
            ids.fill_(experts - 1)
        elif how == "all but two empty":
            ids = torch.where(ids < experts // 2, 3, 11)
        order, inverse, bounds = routing_kernels.expert_order(ids, experts)
        expected = sorted_by_expert(ids, experts)
        for name, got, want in zip(("order", "inverse", "bounds"), (order, inverse, bounds), expected, strict=True):
            if got.dtype != want.dtype or not torch.equal(got, want):
                sys.exit(f"expert_order, {pairs} pairs of {experts} experts ({how}): {name} differs: {got} != {want}")


def check_top_k() -> None:
    generator = torch.Generator().manual_seed(1)
    for tokens, experts, top_k in [(37, 128, 8), (5, 8, 2), (20, 60, 4), (3, 6, 6)]:
        scores = torch.rand(tokens, experts, generator=generator)
        chosen = routing_kernels.top_k_experts(scores, top_k)
        expected = scores.topk(top_k, dim=-1).indices
        if not torch.equal(chosen, expected):
            sys.exit(f"top_k_experts, {tokens}x{experts} top {top_k}: {chosen} != {expected}")
    nan, inf = float("nan"), float("inf")
    scores = torch.tensor(
        [[0.5, 0.5, 0.1, nan, 0.2], [-inf] * 5, [0.1, 0.3, 0.3, 0.3, 0.2], [-inf, -inf, 2.0, -inf, 1.0]]
    )
    expected = torch.tensor([[3, 0, 1], [0, 1, 2], [1, 2, 3], [2, 4, 0]])
    chosen = routing_kernels.top_k_experts(scores, 3)
    if not torch.equal(chosen, expected):
        sys.exit(f"top_k_experts with ties, NaN and -inf: {chosen.tolist()} != {expected.tolist()}")


def loss_and_gradients(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    gradients = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return loss.detach(), gradients


def check_blocks() -> dict[str, int]:
    """An architecture of each routing rule: its loss and every gradient through the kernels and through the
    torch ops (fp32): equal bit for bit where the kernel's top-k order is torch.topk's (softmax routing,
    sorted), and within fp32 rounding where the torch ops take an unsorted top-k (sigmoid routing: the k rows
    sum in another order). Returns the kernels' call counts."""
    calls = {"top_k_experts": 0, "expert_order": 0}

    class Counted:
        """routing_kernels, counting the calls of its kernels."""

        def __getattr__(self, name: str):
            kernel = getattr(routing_kernels, name)

            def call(*args):
                calls[name] += 1
                return kernel(*args)

            return call

    # One architecture of each routing rule (softmax with its top-k renormalized or not, sigmoid, sigmoid over
    # expert groups); the other fused architectures share these rules (test_fused_moe.py holds each to transformers).
    for architecture in ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(architecture), dtype=torch.float32)
        model.config.use_cache = False
        fused_moe.use_fused_experts(model, decoder_layers(model), "fused")
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
        fused_moe.routing_kernels = Counted()
        try:
            loss, gradients = loss_and_gradients(model, ids)
            fused_moe.routing_kernels = None  # the torch ops
            expected_loss, expected = loss_and_gradients(model, ids)
        finally:
            fused_moe.routing_kernels = routing_kernels
        exact = architecture in ("qwen3_moe", "mixtral")
        tolerance = 0.0 if exact else 1e-6
        if abs(loss.item() - expected_loss.item()) > tolerance * abs(expected_loss.item()):
            sys.exit(f"{architecture}: loss {loss.item()} through the kernels, {expected_loss.item()} through the ops")
        if gradients.keys() != expected.keys():
            sys.exit(f"{architecture}: different parameters took gradients")
        for name, want in expected.items():
            off = (gradients[name] - want).abs().max().item()
            if off > tolerance * want.abs().max().item():
                sys.exit(f"{architecture}: {name} off by {off}")
    return calls


if __name__ == "__main__":
    if not INTERPRETED:
        sys.exit("run with TRITON_INTERPRET=1")
    check_expert_order()
    check_top_k()
    calls = check_blocks()
    print(" ".join(f"{name}: {count}" for name, count in calls.items()))

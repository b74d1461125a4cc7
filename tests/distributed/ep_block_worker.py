"""One rank of the expert-parallel MoE block test (``test_expert_parallel.py``), started by torch's launcher:
a fused MoE block of the architecture ARCH (default Qwen3-MoE; Gemma 4's: its fused router and the experts beside
it; JetMoE's: its pair of expert modules) whose router sends every token to experts 0 and 1 (both on rank 0 of EP 2),
fed tokens on rank 0 only (rank 1 routes nothing: a rank of padding, whose experts also receive nothing). Each rank
compares the block's output and gradients with the same block unsharded, on its own tokens, and writes what it found
to ``OUT/rank-<r>.json``. With identity experts (LongCat-Flash's) both ranks have tokens: each chooses expert 0 and,
every other token, expert 1 (rank 0's GEMM experts) or else the last, an identity expert (whose pair stays on its
rank); rank 1's GEMM experts still receive nothing.
Usage: ``ep_block_worker.py OUT [ARCH]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.expert_parallel import expert_runs, shard_experts
from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.fused_moe import (
    SLAB_EXPERTS,
    FusedRouter,
    identity_experts,
    input_projection,
    parameter_adapters,
    use_fused_experts,
)

TOKENS = 12


def block_and_tokens(rank: int, arch: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    found = use_fused_experts(model, decoder_layers(model), "fused")[0]
    # The fused block, or the fused router of a block that is its decoder layer (Gemma 4's), whose experts it names.
    block = found.reporter.train()
    router = parameter_adapters(found.router)[0]  # the Linear with a row per expert
    hidden = router.weight.shape[1]
    with torch.no_grad():  # positive inputs; experts 0 and 1 score high, the others negative
        router.weight.copy_(-torch.ones_like(router.weight))
        router.weight[0] = 1.0
        router.weight[1] = 0.5
    identities = identity_experts(parameter_adapters(block.experts)[0])
    tokens = torch.rand(TOKENS if rank == 0 or identities else 0, hidden) + 0.1
    if identities:  # expert 0 first; expert 1 for the tokens with a large first feature, else the last (an identity)
        with torch.no_grad():
            router.weight[1] = 0.0
            router.weight[1, 0] = 3.0
            router.weight[-1] = 0.5
        tokens[1::2, 0] = 10.0
    return block, tokens.requires_grad_()


def output_of(block: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(block, FusedRouter):  # as Gemma 4's decoder layer calls its router, then its experts
        _, weights, chosen = block(tokens)
        return block.experts(tokens, chosen, weights)
    output = block(tokens.unsqueeze(0))
    return output[0] if isinstance(output, tuple) else output  # Llama 4's block returns its router logits too


def expert_weights(block: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """The routed experts' weights (gate_up_proj or, ungated, up_proj; down_proj; DBRX's three 2-D slabs)."""
    if (slabs := SLAB_EXPERTS.get(type(block.experts).__name__)) is not None:
        holder, *names = slabs
        return tuple(getattr(getattr(block.experts, holder), name) for name in names)
    return getattr(block.experts, input_projection(block.experts.activation)), block.experts.down_proj


def chosen_experts(block: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The experts ``block`` routes ``tokens`` to (tokens, top_k)."""
    with torch.no_grad():
        return block.routed(tokens.detach())[2]


def per_expert(tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """``tensor`` with a first dimension per expert: a 3-D weight as it is, a 2-D slab's rows (E*I, H) as (E, I, H)."""
    return tensor.reshape(experts, -1, tensor.shape[-1])


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else param.grad


def run(out: Path, arch: str) -> None:
    env = DistributedEnv.from_environment(timeout_s=60, expert_parallel_size=2)
    dims = env.mesh
    reference, tokens = block_and_tokens(env.rank, arch)
    expected = output_of(reference, tokens)
    expected.sum().backward()
    whole_grads = [_grad(param) for param in expert_weights(reference)]
    for grad in whole_grads:  # an expert's gradient sums over the tokens of every rank (all of them rank 0's but here
        dist.all_reduce(grad)  # with identity experts)

    block, same_tokens = block_and_tokens(env.rank, arch)
    shard_experts(block, dims)  # the block is the model here: its experts keep this rank's run
    output = output_of(block, same_tokens)
    output.sum().backward()
    identities = block.experts.identity_experts
    gemm_experts = block.num_routed_experts - identities
    mine = dims.local_experts(gemm_experts)
    local_grads = [_grad(param) for param in expert_weights(block)]
    # Each weight's experts on this rank (LongCat-Flash's gate_up_proj: its GEMM experts', then its identity experts')
    counts = [whole.shape[0] if whole.dim() == 3 else block.num_routed_experts for whole in whole_grads]
    runs = [expert_runs(count, count - gemm_experts, dims.ep_rank, dims.ep_size) for count in counts]
    report = {
        "rank": env.rank,
        "tokens": tokens.shape[0],
        "local_experts": [mine.start, mine.stop],
        "experts": gemm_experts,
        "identity_pairs": int((chosen_experts(reference, tokens) >= gemm_experts).sum()) if identities else 0,
        "output_matches": bool(torch.allclose(output, expected, rtol=1e-5, atol=1e-6)),
        "input_grad_matches": bool(torch.allclose(same_tokens.grad, tokens.grad, rtol=1e-5, atol=1e-6)),
        "expert_grads_match": all(
            torch.allclose(
                per_expert(local, len(run)),
                per_expert(whole, count)[run],
                rtol=1e-5,
                atol=1e-6,
            )
            for local, whole, count, run in zip(local_grads, whole_grads, counts, runs, strict=True)
        ),
        "expert_grad_abs_sum": float(sum(grad.abs().sum() for grad in local_grads)),
    }
    (out / f"rank-{env.rank}.json").write_text(json.dumps(report))
    dist.barrier()
    env.close()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "qwen3_moe")

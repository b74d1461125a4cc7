"""Evaluation: token-weighted loss and perplexity over the held-out examples, one all-reduce."""

from __future__ import annotations

import math

import torch

from shardtune.data.collate import collate
from shardtune.data.store import SequenceArrays
from shardtune.distributed.env import DistributedEnv
from shardtune.train.loss import summed_token_loss


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    examples: SequenceArrays,
    batch_size: int,
    pad_token_id: int,
    env: DistributedEnv,
    autocast_dtype: torch.dtype | None,
    loss_chunk_tokens: int = 0,
    fused_loss: bool = False,
) -> dict[str, float]:
    """Loss = sum of token losses / number of target tokens, over all ranks' shares of ``examples``."""
    was_training = model.training
    model.eval()
    # Each rank takes a strided share; sorting by length first keeps padding per batch small.
    lengths = examples.lengths()
    mine = sorted(range(env.rank, len(examples), env.world_size), key=lambda i: (lengths[i], i))
    # Sums stay on the device and are reduced once at the end: no host sync per batch.
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    for start in range(0, len(mine), batch_size):
        sequences = [examples.sequence(i) for i in mine[start : start + batch_size]]
        batch = collate(sequences, pad_token_id, packed=False).to(env.device)
        totals[0] += summed_token_loss(model, batch, autocast_dtype, loss_chunk_tokens, fused_loss).double()
        totals[1] += batch.num_targets
    env.all_reduce_sum(totals)
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(min(loss, 700.0)),
        "eval_tokens": int(totals[1].item()),
    }

"""Evaluation: token-weighted loss and perplexity over the held-out examples, one all-reduce.

Every rank runs the same number of forward passes, however the examples split over the ranks: under
FSDP each forward pass is a sequence of collectives (the parameter all-gathers), so a rank that ran
one pass fewer would leave the others waiting in an all-gather until the collective timeout. A rank
short of examples runs its missing passes on a padding batch, one example whose targets are all
ignored: it counts zero tokens and adds zero loss, so the token-weighted loss stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from shardtune.data.collate import collate
from shardtune.data.store import SequenceArrays
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.distributed.env import DistributedEnv
from shardtune.train.loss import summed_token_loss


def batches_per_rank(num_examples: int, batch_size: int, world_size: int) -> int:
    """Forward passes every rank runs: those of the rank with the most examples (rank 0's share)."""
    return math.ceil(math.ceil(num_examples / world_size) / batch_size)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    examples: SequenceArrays,
    batch_size: int,
    pad_token_id: int,
    env: DistributedEnv,
    autocast_dtype: torch.dtype | None,
    loss_chunk_tokens: int | str = 0,
    fused_loss: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Loss = sum of token losses / number of target tokens, over all ranks' shares of ``examples``.

    ``on_batch`` is called after every forward pass with the passes done and the passes in all (the heartbeat:
    a long evaluation is progress; and the progress line)."""
    was_training = model.training
    model.eval()
    # Each rank takes a strided share; sorting by length first keeps padding per batch small.
    lengths = examples.lengths()
    mesh = env.mesh
    mine = sorted(range(mesh.dp_rank, len(examples), mesh.dp_size), key=lambda i: (lengths[i], i))
    # Sums stay on the device and are reduced once at the end: no host sync per batch.
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    passes = batches_per_rank(len(examples), batch_size, mesh.dp_size)
    for index in range(passes):
        share = mine[index * batch_size : (index + 1) * batch_size]
        sequences = [examples.sequence(i) for i in share] if share else _padding(examples, lengths)
        batch = collate(sequences, pad_token_id, packed=False).to(env.device)
        totals[0] += summed_token_loss(model, batch, autocast_dtype, loss_chunk_tokens, fused_loss).double()
        totals[1] += batch.num_targets
        if on_batch is not None:
            on_batch(index + 1, passes)
    env.all_reduce_sum(totals)
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(min(loss, 700.0)),
        "eval_tokens": int(totals[1].item()),
    }


def _padding(examples: SequenceArrays, lengths: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A batch that costs a forward pass and counts nothing: the shortest example, no target kept."""
    ids, targets, positions = examples.sequence(int(np.argmin(lengths)))
    return [(ids, np.full_like(targets, IGNORE_INDEX), positions)]

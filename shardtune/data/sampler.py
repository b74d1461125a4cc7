"""One global, seeded order of examples per epoch, cut into global batches; each rank takes a slice.

The order depends only on (seed, epoch, number of examples), never on the world size, so a run on
one process and a run on eight see the same global batches, and the whole state is a cursor
(epoch, examples consumed) that a checkpoint can store and any world size can resume from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shardtune.distributed.mesh import ParallelDims
from shardtune.errors import ConfigError


@dataclass
class SamplerCursor:
    epoch: int = 0
    consumed: int = 0  # examples of this epoch already handed out


class GlobalBatchSampler:
    def __init__(self, num_examples: int, global_batch_size: int, seed: int):
        if num_examples < global_batch_size:
            raise ConfigError(
                f"training.per_device_train_batch_size: the training set has {num_examples:,} examples, "
                f"fewer than one global batch of {global_batch_size:,} "
                "(per-device batch size x gradient accumulation x world size); lower "
                "training.per_device_train_batch_size or training.gradient_accumulation_steps, or add examples"
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.cursor = SamplerCursor()
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        # The last incomplete global batch of an epoch is left out: every step then has the same
        # number of examples on every rank. The next epoch reshuffles, so no example is always skipped.
        return self.num_examples // self.global_batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_examples, generator=generator)
            self._order_epoch = epoch
        return self._order

    def next_global_batch(self) -> list[int]:
        """The example indices of the next global batch; advances the cursor."""
        if self.cursor.consumed + self.global_batch_size > self.num_examples:
            self.cursor = SamplerCursor(self.cursor.epoch + 1, 0)
        start = self.cursor.consumed
        indices = self.epoch_order(self.cursor.epoch)[start : start + self.global_batch_size].tolist()
        self.cursor.consumed += self.global_batch_size
        return indices

    @property
    def epoch_progress(self) -> float:
        """Fractional epochs completed, for logs."""
        return self.cursor.epoch + self.cursor.consumed / (self.batches_per_epoch * self.global_batch_size)

    def state_dict(self) -> dict[str, int]:
        return {**asdict(self.cursor), "num_examples": self.num_examples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_examples"] != self.num_examples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_examples']} examples with seed {state['seed']}, "
                f"this run has {self.num_examples} examples with seed {self.seed}"
            )
        self.cursor = SamplerCursor(state["epoch"], state["consumed"])


def rank_micro_batches(global_batch: list[int], mesh: ParallelDims, micro_batch_size: int) -> list[list[int]]:
    """This data-parallel rank's contiguous slice of a global batch, split into micro-batches."""
    per_rank = len(global_batch) // mesh.dp_size
    mine = global_batch[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]

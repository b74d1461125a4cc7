"""Examples -> a padded batch of tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.data.tokenize import IGNORE_INDEX, TokenizedExample


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    num_targets: int
    num_tokens: int

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.attention_mask.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            self.num_targets,
            self.num_tokens,
        )


def pad_to_longest(examples: list[TokenizedExample], pad_token_id: int) -> Batch:
    """Right-pad to the longest example in the batch; padded positions are masked and carry no target."""
    length = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    targets = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        targets[row, :n] = torch.tensor(example.targets)
        attention_mask[row, :n] = 1
    return Batch(
        input_ids,
        attention_mask,
        targets,
        num_targets=int((targets != IGNORE_INDEX).sum()),
        num_tokens=int(attention_mask.sum()),
    )

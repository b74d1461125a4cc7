"""Sequences -> a batch of tensors: padded examples with an attention mask, or packed sequences."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardtune.data.tokenize import IGNORE_INDEX

SequenceView = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, targets, position_ids


@dataclass
class Batch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None  # padded examples
    position_ids: torch.Tensor | None  # packed sequences: restart at 0 for every example
    num_targets: int
    num_tokens: int  # real (non-padding) tokens
    real_tokens: torch.Tensor  # bool (batch, seq): which positions hold a token, not padding

    def to(self, device: torch.device) -> Batch:
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            # From pageable memory a copy to the GPU waits for the copy engine; from pinned memory it is
            # queued, and the host goes on preparing the next micro-batch.
            return (tensor.pin_memory() if device.type == "cuda" else tensor).to(device, non_blocking=True)

        return Batch(
            move(self.input_ids),
            move(self.targets),
            move(self.attention_mask),
            move(self.position_ids),
            self.num_targets,
            self.num_tokens,
            move(self.real_tokens),
        )

    def model_inputs(self, one_row: bool = False) -> dict[str, torch.Tensor]:
        """The model's keyword arguments. ``one_row``: packed rows laid end to end as a batch of one row, the
        only batch in which transformers' flash attention finds the examples' boundaries
        (from the position ids; the loss flattens rows in the same order)."""
        inputs = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
            if one_row:
                return {key: value.reshape(1, -1) for key, value in inputs.items()}
        return inputs


def collate(sequences: list[SequenceView], pad_token_id: int, packed: bool, pad_to_length: int | None = None) -> Batch:
    """Right-pad to the longest sequence (or to ``pad_to_length``); padding never carries a target.

    Padded examples get an attention mask. Packed sequences get position ids and no mask (the mask
    would hide the example boundaries); their padding tail gets positions of its own from 0, so it
    is one more isolated pseudo-example that nothing attends to.
    """
    length = max(len(ids) for ids, _, _ in sequences)
    if pad_to_length is not None:
        length = max(length, pad_to_length)
    input_ids = np.full((len(sequences), length), pad_token_id, dtype=np.int64)
    targets = np.full((len(sequences), length), IGNORE_INDEX, dtype=np.int64)
    real = np.zeros((len(sequences), length), dtype=np.int64)
    positions = np.zeros((len(sequences), length), dtype=np.int64) if packed else None
    for row, (ids, row_targets, row_positions) in enumerate(sequences):
        n = len(ids)
        input_ids[row, :n] = ids
        targets[row, :n] = row_targets
        real[row, :n] = 1
        if positions is not None:
            positions[row, :n] = row_positions
            positions[row, n:] = np.arange(length - n)
    return Batch(
        torch.from_numpy(input_ids),
        torch.from_numpy(targets),
        None if packed else torch.from_numpy(real),
        None if positions is None else torch.from_numpy(positions),
        num_targets=int((targets != IGNORE_INDEX).sum()),
        num_tokens=int(real.sum()),
        real_tokens=torch.from_numpy(real.astype(bool)),
    )

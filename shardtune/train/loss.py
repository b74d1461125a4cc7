"""Token-level cross entropy, summed, so a step can divide by its global target-token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardtune.data.collate import Batch
from shardtune.data.tokenize import IGNORE_INDEX


def summed_token_loss(model: torch.nn.Module, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Sum of next-token cross entropies over the batch's target tokens (targets are pre-shifted)."""
    with torch.autocast(
        batch.input_ids.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        logits = model(**batch.model_inputs(), use_cache=False).logits
    # Softmax in fp32: bf16 logits lose the small probabilities that dominate the loss.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )

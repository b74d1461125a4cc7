"""Token-level cross entropy, summed, so a step can divide by its global target-token count.

Two ways to the same number. The standard one takes the model's logits for every position. The chunked
one (``training.loss_chunk_tokens``) never holds more than one chunk of logits: during the forward pass
the LM head is stood in for by a module that computes the summed loss of the target positions chunk by
chunk, each chunk under activation checkpointing, so backward recomputes that chunk's logits instead of
keeping all of them. At 32k-256k vocabularies the full logits (plus their fp32 copy and gradient) are
gigabytes per sequence; the price is one more LM-head matmul per chunk in backward. It runs inside the
model's forward, so DDP's and FSDP's hooks see the LM head used as usual.

With ``model.liger_kernel`` the same stand-in head computes the loss with liger-kernel's fused linear
cross-entropy, a Triton kernel that computes each block's logits, loss and gradients in one pass during
the forward (so backward has nothing to recompute): no full logits either, and no extra matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardtune.data.collate import Batch
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.distributed.parallelize import unwrap
from shardtune.errors import ConfigError

# Models that change the logits after the LM head: a head that returns a loss would skip that.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")


def logit_transforms(text_config) -> list[str]:
    """The keys of a model's config that change its logits after the LM head (the preflight refuses a chunked
    or fused loss for such a model before anything loads; ``_loss_head`` checks again on the model itself)."""
    return [key for key in LOGIT_TRANSFORMS if getattr(text_config, key, None) not in (None, 1, 1.0)]


def summed_token_loss(
    model: torch.nn.Module,
    batch: Batch,
    autocast_dtype: torch.dtype | None,
    chunk_tokens: int = 0,
    fused: bool = False,
) -> torch.Tensor:
    """Sum of next-token cross entropies over the batch's target tokens (targets are pre-shifted).

    ``chunk_tokens``: at most this many target tokens' logits at a time; ``fused``: liger-kernel's
    fused linear cross-entropy (needs CUDA and liger-kernel).
    """
    with torch.autocast(
        batch.input_ids.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        if chunk_tokens or fused:
            with _loss_head(model, batch.targets, chunk_tokens, fused):
                return model(**batch.model_inputs(), use_cache=False).logits
        logits = model(**batch.model_inputs(), use_cache=False).logits
    # Softmax in fp32: bf16 logits lose the small probabilities that dominate the loss.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class _ChunkedLossHead(torch.nn.Module):
    def __init__(self, head: torch.nn.Linear, targets: torch.Tensor, chunk_tokens: int, fused: bool):
        super().__init__()
        self.head = head
        self.targets = targets
        self.chunk_tokens = chunk_tokens
        self.fused_loss = _liger_loss() if fused else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        keep = self.targets != IGNORE_INDEX
        hidden, targets = hidden[keep], self.targets[keep]
        total = hidden.new_zeros((), dtype=torch.float32)
        step = self.chunk_tokens or max(hidden.shape[0], 1)
        for start in range(0, hidden.shape[0], step):
            end = start + step
            if self.fused_loss is not None:
                # liger's kernel works block by block already and keeps no logits for backward.
                loss = self.fused_loss(self.head.weight, hidden[start:end], targets[start:end], self.head.bias)
            else:
                loss = checkpoint(
                    _chunk_loss, hidden[start:end], targets[start:end], self.head.weight, self.head.bias,
                    use_reentrant=False,
                )  # fmt: skip
            total = total + loss.float()
        return total


def _liger_loss() -> torch.nn.Module:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise ConfigError(
            f"model.liger_kernel: liger-kernel is not installed ({error}); pip install 'shardtune[liger]'"
        ) from error
    return LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


@contextlib.contextmanager
def _loss_head(model: torch.nn.Module, targets: torch.Tensor, chunk_tokens: int, fused: bool) -> Iterator[None]:
    causal_lm = _causal_lm(model)
    head = causal_lm.get_output_embeddings()
    transforms = logit_transforms(causal_lm.config.get_text_config())
    if transforms or not isinstance(head, torch.nn.Linear):
        why = f"it transforms logits after the head ({', '.join(transforms)})" if transforms else "no linear head"
        key = "model.liger_kernel" if fused else "training.loss_chunk_tokens"
        raise ConfigError(f"{key}: not for {type(causal_lm).__name__}: {why}; turn it off")
    causal_lm.set_output_embeddings(_ChunkedLossHead(head, targets, chunk_tokens, fused))
    try:
        yield
    finally:
        causal_lm.set_output_embeddings(head)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP's and PEFT's wrappers."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model

"""Token-level cross entropy, summed, so a step can divide by its global target-token count.

Two ways to the same number, up to rounding. The standard one takes the model's logits for every position.
The chunked one (``training.loss_chunk_tokens``) never holds more than one chunk of logits: during the
forward pass the LM head is stood in for by a module that works through the positions chunk by chunk, and
for each chunk computes the logits, the summed loss and the gradients of the head's input and weights
(``LinearCrossEntropy``); backward only scales what forward kept. At 128k-152k vocabularies the full
logits, their fp32 copy and gradient are 14 GiB at 8,192 tokens; a chunk of 1,024 tokens is 1.7 GiB (12
bytes a logit at the peak, at most 2**28 logits under ``auto``), and nothing is recomputed: the head's two
GEMMs run once each, as in the standard loss. It runs inside the model's forward, so DDP's and FSDP's
hooks see the LM head used as usual. ``auto`` (the default) chunks a batch whose logits are more than one
chunk, for models whose logits come straight from a linear head.

With ``model.liger_kernel`` the same stand-in head computes the loss with liger-kernel's fused linear
cross-entropy, a Triton kernel that does the same block by block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

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


# auto: the logits one chunk may hold (tokens x vocabulary): 1 GiB in fp32, 1,024 tokens of a 152k vocabulary.
AUTO_CHUNK_LOGITS = 2**28


def auto_chunk_tokens(vocab: int) -> int:
    """Tokens of one chunk under ``loss_chunk_tokens: auto``: the largest power of two whose logits are at
    most ``AUTO_CHUNK_LOGITS`` (at least 128: a GEMM of fewer rows wastes the GPU)."""
    return max(128, 2 ** math.floor(math.log2(max(AUTO_CHUNK_LOGITS // vocab, 1))))


def head_vocab(model: torch.nn.Module) -> int | None:
    """The vocabulary of ``model``'s LM head when its logits come straight from a linear layer, else None
    (no chunked loss can stand in for such a head)."""
    causal_lm = _causal_lm(model)
    head = causal_lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or logit_transforms(causal_lm.config.get_text_config()):
        return None
    return head.out_features


def chunk_tokens_for(setting: int | str, vocab: int | None, tokens: int) -> int:
    """Positions the loss takes at a time for a batch of ``tokens`` positions (0: all at once, the standard
    loss), for a head of ``vocab`` (``head_vocab``): the one decision training and the memory estimate share."""
    if setting != "auto":
        return int(setting)
    if vocab is None:
        return 0
    chunk = auto_chunk_tokens(vocab)
    return chunk if tokens > chunk else 0


def describe_loss(setting: int | str, vocab: int | None, tokens: int, fused: bool) -> str:
    """The loss a run of micro-batches of ``tokens`` positions computes, for its log."""
    if fused:
        return "loss: liger-kernel's fused linear cross-entropy (model.liger_kernel)"
    chunk = chunk_tokens_for(setting, vocab, tokens)
    key = f"training.loss_chunk_tokens: {setting}"
    if not chunk:
        return f"loss: cross-entropy over all logits at once ({key})"
    return f"loss: cross-entropy and its gradients {chunk:,} tokens at a time in the forward pass ({key})"


def summed_token_loss(
    model: torch.nn.Module,
    batch: Batch,
    autocast_dtype: torch.dtype | None,
    chunk_tokens: int | str = 0,
    fused: bool = False,
) -> torch.Tensor:
    """Sum of next-token cross entropies over the batch's target tokens (targets are pre-shifted).

    ``chunk_tokens``: at most this many positions' logits at a time (``auto``: see ``chunk_tokens_for``);
    ``fused``: liger-kernel's fused linear cross-entropy (needs CUDA and liger-kernel).
    """
    with torch.autocast(
        batch.input_ids.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        if chunk_tokens == "auto":
            chunk_tokens = chunk_tokens_for("auto", head_vocab(model), batch.targets.numel())
        if chunk_tokens or fused:
            with _loss_head(model, batch.targets, chunk_tokens, fused):
                return model(**batch.model_inputs(), use_cache=False).logits
        logits = model(**batch.model_inputs(), use_cache=False).logits
    # Softmax in fp32: bf16 logits lose the small probabilities that dominate the loss.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of ``hidden @ weight.T + bias`` against ``targets`` (``IGNORE_INDEX``: no
    loss), ``chunk`` rows at a time, with the gradients of ``hidden``, ``weight`` and ``bias`` computed in
    the forward pass from each chunk's softmax, so no chunk's logits outlive it and backward recomputes
    nothing (it scales the kept gradients by the loss's incoming gradient).

    Written here rather than taken from liger-kernel (``model.liger_kernel``) so that it runs wherever torch
    does (CPU included, so CI tests the path GPUs run) and follows autocast as the standard loss does: bf16
    GEMMs, softmax in fp32. Ignored positions are masked, not filtered out: no host sync."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, grad_enabled):
        device = hidden.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        # Under no_grad (evaluation) needs_input_grad still says which inputs require grad: nothing to compute.
        needs_hidden, needs_weight, needs_bias = (grad_enabled and needed for needed in ctx.needs_input_grad[:3])
        rows = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        with torch.autocast(device, enabled=False):
            weight_c = weight.to(compute)
            bias_c = bias.to(compute) if bias is not None else None
            grad_rows = torch.empty_like(rows) if needs_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs_bias else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, rows.shape[0], chunk):
                part = rows[start : start + chunk].to(compute)
                wanted = targets[start : start + chunk]
                kept = wanted != IGNORE_INDEX
                picked = wanted.clamp_min(0)[:, None]
                log_probs = torch.log_softmax(F.linear(part, weight_c, bias_c), -1, dtype=torch.float32)
                total += (log_probs.gather(1, picked).squeeze(1) * kept).sum().neg()
                if not (needs_hidden or needs_weight or needs_bias):
                    continue
                # d(loss)/d(logits) = softmax - one-hot of the target, on kept rows only.
                probs = log_probs.exp_()
                probs.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=probs.dtype))
                grad_logits = probs.to(compute)
                del log_probs, probs
                mask = kept[:, None].to(compute)
                if needs_hidden:
                    grad_rows[start : start + chunk] = (grad_logits @ weight_c) * mask
                if needs_weight:
                    grad_weight.add_(grad_logits.t() @ (part * mask))  # promoted as it adds: no fp32 copy
                if needs_bias:
                    grad_bias += (grad_logits * mask).float().sum(0)
        ctx.save_for_backward(
            grad_rows.view_as(hidden) if needs_hidden else None,
            grad_weight.to(weight.dtype) if needs_weight else None,
            grad_bias.to(bias.dtype) if needs_bias else None,
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # In fp32: the incoming gradient (1 / the step's target tokens) rounded to bf16 would scale by up to 0.4%.
        grads = [None if grad is None else (grad.float() * grad_total).to(grad.dtype) for grad in ctx.saved_tensors]
        return *grads, None, None, None


class _ChunkedLossHead(torch.nn.Module):
    def __init__(self, head: torch.nn.Linear, targets: torch.Tensor, chunk_tokens: int, fused: bool):
        super().__init__()
        self.head = head
        self.targets = targets
        self.chunk_tokens = chunk_tokens
        self.fused_loss = _liger_loss() if fused else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused_loss is None:
            chunk = self.chunk_tokens or max(self.targets.numel(), 1)
            head, grad_enabled = self.head, torch.is_grad_enabled()
            return LinearCrossEntropy.apply(hidden, head.weight, head.bias, self.targets, chunk, grad_enabled)
        keep = self.targets != IGNORE_INDEX
        hidden, targets = hidden[keep], self.targets[keep]
        total = hidden.new_zeros((), dtype=torch.float32)
        step = self.chunk_tokens or max(hidden.shape[0], 1)
        for start in range(0, hidden.shape[0], step):
            end = start + step
            # liger's kernel works block by block already and keeps no logits for backward.
            loss = self.fused_loss(self.head.weight, hidden[start:end], targets[start:end], self.head.bias)
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

"""Token-level cross entropy, summed, so a step can divide by its global target-token count.

Two ways to the same number, up to rounding. The standard one takes the model's logits for every position. The
chunked one (``training.loss_chunk_tokens``) never holds more than one chunk of logits: during the forward
pass the LM head is stood in for by a module that works through the positions chunk by chunk, and for each
chunk computes the logits, the summed loss and the gradients of the head's input and weights
(``LinearCrossEntropy``); backward only scales what forward kept. At 128k-152k vocabularies the full logits,
their fp32 copy and gradient are 14 GiB at 8,192 tokens; a chunk of 1,024 tokens is 1.5 GiB (10 bytes a logit
at the peak, at most 2**28 logits under ``auto``), and nothing is recomputed: the head's two GEMMs run once
each, as in the standard loss. Under ``parallel.compile`` each chunk's softmax and gradient is one inductor
kernel pair that writes the gradient over the logits (``compiled_softmax_gradient``): 2 bytes a logit, and the
logits read twice instead of the eager ops' six passes over fp32 copies. It runs inside the model's forward,
so DDP's and FSDP's hooks see the LM head used as usual. ``auto`` (the default) chunks a batch whose logits
are more than one chunk, for models whose logits come straight from a linear head.

With ``model.liger_kernel`` the same stand-in head computes the loss with liger-kernel's fused linear
cross-entropy, a Triton kernel that does the same block by block.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from shardtune.data.collate import Batch
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.distributed.parallelize import unwrap
from shardtune.errors import ConfigError
from shardtune.model.packed_attention import packed_block_mask

# (logits, targets) -> the summed loss, with the logits overwritten by their gradient: ``softmax_gradient_``.
SoftmaxGradient = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Models that change the logits after the LM head: a head that returns a loss would skip that.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")
# The transform the chunked loss applies itself (Gemma 2's and Gemma 4's cap * tanh(logits / cap)), the model's own
# turned off while the chunked head stands in for its LM head.
SOFTCAP = "final_logit_softcapping"


def logit_transforms(text_config, chunked: bool = False) -> list[str]:
    """The keys of a model's config that change its logits after the LM head, all of them or (``chunked``) those
    the chunked loss does not apply itself (the preflight refuses a chunked or fused loss for such a model before
    anything loads; ``_loss_head`` checks again on the model itself)."""
    return [
        key
        for key in LOGIT_TRANSFORMS
        if getattr(text_config, key, None) not in (None, 1, 1.0) and not (chunked and key == SOFTCAP)
    ]


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
    if not isinstance(head, torch.nn.Linear) or logit_transforms(causal_lm.config.get_text_config(), chunked=True):
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


def describe_loss(setting: int | str, vocab: int | None, tokens: int, fused: bool, compiled: bool) -> str:
    """The loss a run of micro-batches of ``tokens`` positions computes (its chunks' softmax ``compiled`` or
    not), for its log and metrics.json."""
    if fused:
        return "loss: liger-kernel's fused linear cross-entropy (model.liger_kernel)"
    chunk = chunk_tokens_for(setting, vocab, tokens)
    key = f"training.loss_chunk_tokens: {setting}"
    if not chunk:
        return f"loss: cross-entropy over all logits at once ({key})"
    softmax = "compiled" if compiled else "eager"
    return (
        f"loss: cross-entropy and its gradients {chunk:,} tokens at a time in the forward pass, the softmax "
        f"{softmax} ({key})"
    )


def summed_token_loss(
    model: torch.nn.Module,
    batch: Batch,
    autocast_dtype: torch.dtype | None,
    chunk_tokens: int | str = 0,
    fused: bool = False,
    softmax_gradient: SoftmaxGradient | None = None,
) -> torch.Tensor:
    """Sum of next-token cross entropies over the batch's target tokens (targets are pre-shifted).

    ``chunk_tokens``: at most this many positions' logits at a time (``auto``: see ``chunk_tokens_for``);
    ``fused``: liger-kernel's fused linear cross-entropy (needs CUDA and liger-kernel);
    ``softmax_gradient``: what turns a chunk's logits into its loss and gradient (default the eager
    ``softmax_gradient_``; training under ``parallel.compile`` passes ``compiled_softmax_gradient``'s).
    """
    with torch.autocast(
        batch.input_ids.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        if chunk_tokens == "auto":
            chunk_tokens = chunk_tokens_for("auto", head_vocab(model), batch.targets.numel())
        inputs = batch.model_inputs(one_row=packs_in_one_row(model))
        packed = inputs.get("position_ids")
        if (
            packed is not None
            and attention_of(model) == "flex_attention"
            and plain_causal_attention(model, packed.shape[-1])
        ):
            inputs["attention_mask"] = packed_block_mask(packed)
        if chunk_tokens or fused:
            with _loss_head(model, batch.targets, chunk_tokens, fused, softmax_gradient or softmax_gradient_):
                return model(**inputs, use_cache=False).logits
        logits = model(**inputs, use_cache=False).logits
    # Softmax in fp32: bf16 logits lose the small probabilities that dominate the loss.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def attention_of(model: torch.nn.Module) -> str | None:
    """The attention implementation ``model`` (wrapped or not) runs."""
    return getattr(_causal_lm(model).config, "_attn_implementation", None)


def plain_causal_attention(model: torch.nn.Module, length: int) -> bool:
    """Whether every layer of ``model`` attends causally over a whole sequence of ``length`` tokens: no sliding
    window shorter than it (Mistral-7B-v0.1's 4,096, Gemma's and gpt-oss's sliding layers) and no attention chunks
    (Llama 4). transformers takes a BlockMask handed to the model as every layer's mask, so shardtune's mask of packed
    rows (``packed_block_mask``, causal and nothing more) stands in for transformers' only here."""
    text = _causal_lm(model).config.get_text_config()
    window = getattr(text, "sliding_window", None)
    return (window is None or window >= length) and getattr(text, "attention_chunk_size", None) is None


def packs_in_one_row(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps packed examples apart only within a batch of one row: transformers' flash
    attention takes the examples' boundaries from the position ids of a single row (``_is_packed_sequence``);
    with several rows they would attend across them (sdpa, eager and FlexAttention isolate them in any batch)."""
    return attention_of(model) == "flash_attention_2"


def _log_softmax_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 log-probabilities of ``logits`` (rows x vocabulary) and their summed cross entropy against
    ``targets`` (``IGNORE_INDEX``: no loss)."""
    log_probs = torch.log_softmax(logits, -1, dtype=torch.float32)
    picked = log_probs.gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    return log_probs, (picked * (targets != IGNORE_INDEX)).sum().neg()


def softmax_gradient_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross entropy (fp32) of ``logits`` (rows x vocabulary) against ``targets`` (``IGNORE_INDEX``:
    no loss), with ``logits`` overwritten by its gradient: softmax - one-hot of the target, 0 on ignored
    rows. Eager: the softmax in an fp32 copy of the logits (10 bytes a logit at the peak)."""
    log_probs, loss = _log_softmax_loss(logits, targets)
    picked = targets.clamp_min(0)[:, None]
    probs = log_probs.exp_()
    probs.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=probs.dtype))
    logits.copy_(probs.mul_((targets != IGNORE_INDEX)[:, None]))
    return loss


def _fused_softmax_gradient_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # The form inductor fuses: one reduction kernel (logsumexp and the target's logit) and one pointwise
    # kernel that writes the gradient over the logits, in fp32 registers only. The one-hot is a comparison
    # with the column index, not a scatter (a scatter would need the fp32 probabilities in memory first).
    kept = targets != IGNORE_INDEX
    values = logits.float()
    log_total = torch.logsumexp(values, -1, keepdim=True)
    picked = values.gather(1, targets.clamp_min(0)[:, None])
    loss = ((log_total - picked).squeeze(1) * kept).sum()
    hit = torch.arange(values.shape[1], device=values.device)[None, :] == targets[:, None]
    logits.copy_((torch.exp(values - log_total) - hit.float()) * kept[:, None])
    return loss


def softmax_compiles_right_on(device_type: str) -> bool:
    """Whether the chunked loss's softmax is compiled with the layers on this device: on GPUs (its loss and
    gradient equal the eager ops', measured with torch 2.11: benchmarks/results/loss_kernels_h200.txt), and on
    CPUs from torch 2.12. Inductor's C++ code in torch 2.11 computed the loss from the logits after overwriting
    them with their gradient (8.42 for 7.52 at the quickstart's first step, the gradient right); the eager
    softmax serves there."""
    return device_type != "cpu" or TorchVersion(torch.__version__) >= (2, 12)


def compiled_softmax_gradient(backend: Callable) -> SoftmaxGradient:
    """``softmax_gradient_`` as inductor kernels compiled by ``backend`` (the run's ``LayerCompiler``, which
    falls back to eager where inductor fails). Rows are dynamic after the first shape: a batch's last,
    shorter chunk and batches padded to their longest do not compile again."""
    return torch.compile(_fused_softmax_gradient_, backend=backend, fullgraph=True)


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of ``hidden @ weight.T + bias`` (capped at ``softcap`` by ``softcap * tanh(x /
    softcap)`` where given, in fp32) against ``targets`` (``IGNORE_INDEX``: no loss), ``chunk`` rows at a time,
    with the gradients of ``hidden``, ``weight`` and ``bias`` computed in the forward pass from each chunk's softmax
    (``softmax_gradient``), so no chunk's logits outlive it and backward recomputes nothing (it scales the kept
    gradients by the loss's incoming gradient).

    Written here rather than taken from liger-kernel (``model.liger_kernel``) so that it runs wherever torch
    does (CPU included, so CI tests the path GPUs run) and follows autocast as the standard loss does: bf16
    GEMMs, softmax in fp32. Ignored positions are masked, not filtered out: no host sync."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, chunk, grad_enabled, softmax_gradient=softmax_gradient_, softcap=None
    ):
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
                logits = F.linear(part, weight_c, bias_c)
                if softcap:
                    capped = torch.tanh(logits.float() / softcap)
                    logits = capped * softcap
                if not (needs_hidden or needs_weight or needs_bias):
                    total += _log_softmax_loss(logits, wanted)[1]
                    del logits  # before the next chunk's logits are allocated, not after
                    continue
                total += softmax_gradient(logits, wanted)  # logits now hold d(loss)/d(logits), 0 on ignored rows
                if softcap:  # through the cap: d tanh(u) = 1 - tanh(u)^2
                    logits = logits.mul_(capped.square_().neg_().add_(1)).to(compute)
                    del capped
                if needs_hidden:
                    grad_rows[start : start + chunk] = logits @ weight_c
                if needs_weight:
                    grad_weight.add_(logits.t() @ part)  # promoted as it adds: no fp32 copy
                if needs_bias:
                    grad_bias += logits.float().sum(0)
                # Freed before the next chunk's logits are allocated: one chunk's at a time, not two.
                del logits
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
        return *grads, None, None, None, None, None


class _ChunkedLossHead(torch.nn.Module):
    def __init__(
        self,
        head: torch.nn.Linear,
        targets: torch.Tensor,
        chunk_tokens: int,
        fused: bool,
        softmax_gradient: SoftmaxGradient,
        softcap: float | None = None,
    ):
        super().__init__()
        self.head = head
        self.softcap = softcap
        self.targets = targets
        self.chunk_tokens = chunk_tokens
        self.fused_loss = _liger_loss() if fused else None
        self.softmax_gradient = softmax_gradient

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused_loss is None:
            chunk = self.chunk_tokens or max(self.targets.numel(), 1)
            head, grad_enabled = self.head, torch.is_grad_enabled()
            return LinearCrossEntropy.apply(
                hidden, head.weight, head.bias, self.targets, chunk, grad_enabled, self.softmax_gradient, self.softcap
            )
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
def _loss_head(
    model: torch.nn.Module, targets: torch.Tensor, chunk_tokens: int, fused: bool, softmax_gradient: SoftmaxGradient
) -> Iterator[None]:
    causal_lm = _causal_lm(model)
    head = causal_lm.get_output_embeddings()
    text_config = causal_lm.config.get_text_config()
    transforms = logit_transforms(text_config, chunked=not fused)
    if transforms or not isinstance(head, torch.nn.Linear):
        why = f"it transforms logits after the head ({', '.join(transforms)})" if transforms else "no linear head"
        key = "model.liger_kernel" if fused else "training.loss_chunk_tokens"
        raise ConfigError(f"{key}: not for {type(causal_lm).__name__}: {why}; turn it off")
    # The chunked head caps its logits itself where the model's forward caps them (a config may carry the key for a
    # model that never reads it); that forward would cap the loss the head returns in their place.
    softcap = getattr(text_config, SOFTCAP, None) if _reads_softcap(type(causal_lm)) else None
    configs = [
        config for config in {id(c): c for c in (causal_lm.config, text_config)}.values() if hasattr(config, SOFTCAP)
    ]
    causal_lm.set_output_embeddings(_ChunkedLossHead(head, targets, chunk_tokens, fused, softmax_gradient, softcap))
    for config in configs:
        setattr(config, SOFTCAP, None)
    try:
        yield
    finally:
        causal_lm.set_output_embeddings(head)
        for config in configs:
            setattr(config, SOFTCAP, softcap)


@functools.cache
def _reads_softcap(causal_lm_class: type) -> bool:
    """Whether the forward of ``causal_lm_class`` applies ``final_logit_softcapping`` (Gemma 2's, Gemma 4's)."""
    try:
        return SOFTCAP in inspect.getsource(causal_lm_class.forward)
    except (OSError, TypeError):  # no source to read: taken as capping, as its config says
        return True


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP's and PEFT's wrappers."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model

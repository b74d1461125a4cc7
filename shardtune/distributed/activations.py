"""Activation memory: what a decoder layer keeps between its forward and its backward.

Three tools, applied to the decoder layers before compile and data parallelism:

- activation checkpointing: a checkpointed layer recomputes in backward its attention, its MLP or both
  (each keeps only its input), or all of it (only the layer's input is kept): ``plan.memory.Checkpointing``;
- activation offloading: that input waits in host memory instead (long sequences: at 256k tokens a
  Mistral-7B layer input is 2 GiB, 64 GiB for the 32 layers);
- tiled MLPs: a dense MLP runs over a slice of the tokens at a time, each slice recomputed in its backward,
  so the 3.5x-wider intermediate activations exist for one slice only (at 256k tokens each of them is
  7 GiB for Mistral-7B; they, not attention, set the peak of a long-sequence step).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardtune.model.moe import find_moe_blocks
from shardtune.plan.memory import Checkpointing


def layer_sublayers(layer: torch.nn.Module) -> tuple[str, str] | None:
    """The names of ``layer``'s attention and MLP children (the MLP may be an MoE block), or None where the
    layer has no such pair (OPT computes its MLP with two linear layers of the decoder layer itself; Gemma 4's
    routed experts are children of the decoder layer beside its ``mlp``, so that child is not all of its MLP).

    Attention is the child whose class is an ``...Attention`` of transformers (``self_attn``, GPT-2's
    ``attn``, GPT-NeoX's ``attention``, Falcon's ``self_attention``); the MLP is the child named ``mlp``,
    the name every supported architecture gives its MLP or MoE block."""
    children = dict(layer.named_children())
    attention = [name for name, child in children.items() if type(child).__name__.endswith("Attention")]
    if len(attention) != 1 or "mlp" not in children or "experts" in children:
        return None
    return attention[0], "mlp"


def apply_activation_checkpointing(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    checkpointing: Checkpointing | None = None,
    offload: bool = False,
    compiled: bool = False,
) -> int:
    """Make each of ``layers`` recompute in backward what ``checkpointing`` says (a part of ``PARTS`` per
    layer, chosen by ``plan.memory.choose_checkpointing``; default: each whole layer); returns how many
    layers recompute something.

    Non-reentrant checkpointing: it works with frozen inputs (LoRA) and with DDP, where the
    reentrant kind marks parameters ready twice and crashes (the seed's DDP + LoRA failure).
    ``offload``: the input a whole checkpointed layer keeps lives in (pinned) host memory until the
    recomputation. ``compiled``: the layers will be compiled (``parallelize``).
    """
    checkpointing = checkpointing or Checkpointing.uniform(len(layers), "layer")
    whole, sublayers = [], []
    for layer, part in zip(layers, checkpointing.parts, strict=True):
        if part == "layer":
            whole.append(layer)
        elif part is not None:
            attention, mlp = layer_sublayers(layer)  # plan.memory.checkpoint_parts checked there are both
            names = {"attention": [attention], "mlp": [mlp], "sublayers": [attention, mlp]}[part]
            sublayers += [layer.get_submodule(name) for name in names]
    options = {id(module): {} for module in whole}
    # A sublayer's checkpoint is traced into its compiled layer's graph: told to recompute every op of it.
    # Left to choose, torch 2.11's partitioner kept an MoE block's routed rows (pairs x hidden: 33 kB a token
    # on Qwen3-30B-A3B) instead of the block's input, more than the block keeps uncheckpointed (one H100).
    # Eager, plain checkpointing recomputes everything anyway, without a dispatch mode on every op.
    options.update({id(module): {"context_fn": _recompute_every_op} if compiled else {} for module in sublayers})
    checkpoint_fn = _offloading_checkpoint if offload else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in options:
                wrapper = checkpoint_wrapper(
                    child,
                    checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                    checkpoint_fn=checkpoint_fn,
                    **options[id(child)],
                )
                parent.register_module(name, wrapper)
    return checkpointing.count


def _recompute_every_op() -> tuple:
    return create_selective_checkpoint_contexts(_must_recompute)


def _must_recompute(context, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


class _RecomputeEveryOpNotice(logging.Filter):
    """Drops torch's warning that a checkpoint with a ``context_fn`` under torch.compile must hold no in-place
    op: the only in-place ops in the sublayers shardtune checkpoints write tensors made just before (the
    MoE block's inverse permutation, a group mask), which functionalization makes out of place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_RecomputeEveryOpNotice())


def _offloading_checkpoint(layer: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
    """Checkpoint ``layer`` with its hidden-states input copied to host memory.

    A non-reentrant checkpoint keeps its inputs alive (by reference) for the recomputation. Here that
    input is a host copy: the device tensor is freed once the layer has run, and the recomputation in
    backward copies it back first. The copies are differentiable, so gradients flow as before.
    """
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, *args = args
    device = hidden.device
    if device.type == "cuda":
        # Pinned memory makes both copies asynchronous on the compute stream: the allocator reuses the
        # device tensor only for work queued after the copy, so the copy always reads valid data.
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        host = host.copy_(hidden, non_blocking=True)
    else:
        host = hidden.to("cpu", copy=True)

    def run(host_hidden: torch.Tensor, *inner_args, **inner_kwargs) -> torch.Tensor:
        return layer(host_hidden.to(device, non_blocking=True), *inner_args, **inner_kwargs)

    return checkpoint(run, host, *args, use_reentrant=False, **kwargs)


def tile_mlps(model: torch.nn.Module, layers: list[torch.nn.Module], chunk_tokens: int) -> int:
    """Make each dense decoder MLP run over ``chunk_tokens`` tokens at a time; returns how many.

    The MLP module keeps its name and parameters (checkpoints, LoRA and export see no change): only its
    forward is replaced, by one that splits the flattened tokens and checkpoints each slice. MoE
    blocks are left alone (their router needs every token of the batch at once).
    """
    moe = {id(block.block) for block in find_moe_blocks(model, layers)}
    tiled = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or id(mlp) in moe:
            continue
        mlp.forward = functools.partial(_tiled_forward, mlp.forward, chunk_tokens)
        tiled += 1
    return tiled


def _tiled_forward(forward: Callable[[torch.Tensor], torch.Tensor], chunk_tokens: int, hidden: torch.Tensor):
    tokens = hidden.reshape(-1, hidden.shape[-1])
    if tokens.shape[0] <= chunk_tokens:
        return forward(hidden)
    slices = [
        checkpoint(forward, tokens[start : start + chunk_tokens], use_reentrant=False)
        for start in range(0, tokens.shape[0], chunk_tokens)
    ]
    return torch.cat(slices).reshape(*hidden.shape[:-1], -1)

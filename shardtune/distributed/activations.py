"""Activation memory: what a decoder layer keeps between its forward and its backward.

Three tools, applied to the decoder layers before compile and data parallelism:

- activation checkpointing: a checkpointed layer keeps only its input and recomputes the rest in backward;
- activation offloading: that input waits in host memory instead (long sequences: at 256k tokens a
  Mistral-7B layer input is 2 GiB, 64 GiB for the 32 layers);
- tiled MLPs: a dense MLP runs over a slice of the tokens at a time, each slice recomputed in its backward,
  so the 3.5x-wider intermediate activations exist for one slice only (at 256k tokens each of them is
  7 GiB for Mistral-7B; they, not attention, set the peak of a long-sequence step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from shardtune.model.moe import find_moe_blocks


def apply_activation_checkpointing(model: torch.nn.Module, layers: list[torch.nn.Module], offload: bool = False) -> int:
    """Recompute ``layers``' activations in backward (which layers: ``plan.memory.checkpointed_layers``);
    returns how many were wrapped.

    Non-reentrant checkpointing: it works with frozen inputs (LoRA) and with DDP, where the
    reentrant kind marks parameters ready twice and crashes (the seed's DDP + LoRA failure).
    ``offload``: the layer input it keeps lives in (pinned) host memory until the recomputation.
    """
    chosen = {id(layer) for layer in layers}
    checkpoint_fn = _offloading_checkpoint if offload else None
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in chosen:
                wrapper = checkpoint_wrapper(
                    child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint_fn
                )
                parent.register_module(name, wrapper)
                wrapped += 1
    return wrapped


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

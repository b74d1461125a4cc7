"""Dtype casts of what autograd.Functions return, kept differentiable under torch.compile."""

from __future__ import annotations

import torch


def in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself where it is in it already. For what an autograd.Function's forward returns: on
    torch 2.11 a ``.to`` to the dtype the tensor already has (fp32 runs) made dynamo drop the function's backward, so
    every gradient through it was 0 in compiled layers (torch 2.13 keeps it)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)

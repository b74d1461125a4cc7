"""Packing: several examples in one sequence of at most ``max_length`` tokens, never attending across.

Each example's ``position_ids`` restart at 0. Given position ids like these and no attention mask
(and no KV cache), transformers builds attention that stays within each example for the sdpa,
eager and flex_attention implementations, and uses the variable-length kernels for flash attention in a
batch of one row (``Batch.model_inputs(one_row=True)``: the loss lays packed rows end to end for it);
targets were shifted per example, so no example predicts the next one's first token.
"""

from __future__ import annotations

import bisect

import numpy as np

from shardtune.data.tokenize import TokenizedExample

Sequence = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, targets, position_ids (int32)


def pack_examples(examples: list[TokenizedExample], max_length: int) -> list[Sequence]:
    """Best-fit decreasing bin packing: fewer, fuller sequences than packing in arrival order.

    Deterministic: ties are broken by the examples' order. The sampler shuffles the packed
    sequences, so their order here does not matter for training.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]), i))
    bins: list[list[int]] = []
    # Free space of the open bins, kept sorted alongside their bin numbers, for a binary search.
    free: list[tuple[int, int]] = []
    for index in order:
        length = len(examples[index])
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, number = free.pop(slot)
            bins[number].append(index)
            bisect.insort(free, (space - length, number))
        else:
            bins.append([index])
            bisect.insort(free, (max_length - length, len(bins) - 1))
    return [_concatenate([examples[i] for i in members]) for members in bins]


def _concatenate(examples: list[TokenizedExample]) -> Sequence:
    return (
        np.concatenate([example.input_ids for example in examples]),
        np.concatenate([example.targets for example in examples]),
        np.concatenate([np.arange(len(example), dtype=np.int32) for example in examples]),
    )


def unpacked(example: TokenizedExample) -> Sequence:
    return example.input_ids, example.targets, np.arange(len(example), dtype=np.int32)

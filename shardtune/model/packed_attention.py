"""FlexAttention's mask for packed rows, made by shardtune with its mask function and document ids at fixed
addresses.

Why not transformers' own: given packed rows (position ids restarting at 0, no attention mask), transformers
builds a new mask function each forward, closing over a new tensor of document ids. The compiled attention
kernel reads that tensor wherever it lies, so a CUDA graph captured over a layer (``parallel.cuda_graphs``) would
read the captured batch's documents on every replay. Here one mask function per batch shape reads one buffer,
which each forward refills: the graphs replay with the new batch's documents, and the BlockMask's own block
tensors reach the graphs as tensor arguments like any other. The mask is the same as transformers': causal, and
no token attends across a document boundary (a position id that does not follow the one before starts one).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import torch

# Batch shapes whose document buffers are kept: a run meets one for training and one or two for evaluation.
KEPT_SHAPES = 4


class PackedBlockMasks:
    def __init__(self) -> None:
        self._by_shape: OrderedDict[tuple, tuple[torch.Tensor, Callable]] = OrderedDict()

    def __call__(self, position_ids: torch.Tensor):
        """The BlockMask of the packed rows whose position ids are ``position_ids`` (batch x sequence)."""
        key = (tuple(position_ids.shape), position_ids.device)
        if key not in self._by_shape:
            documents = torch.zeros(position_ids.shape, dtype=torch.int32, device=position_ids.device)

            def same_document_causal(batch, head, query, key_index):
                return (query >= key_index) & (documents[batch, query] == documents[batch, key_index])

            self._by_shape[key] = (documents, same_document_causal)
            while len(self._by_shape) > KEPT_SHAPES:
                self._by_shape.popitem(last=False)
        self._by_shape.move_to_end(key)
        documents, mask_function = self._by_shape[key]
        before_first = position_ids[:, :1] - 1
        documents.copy_((torch.diff(position_ids, prepend=before_first, dim=-1) != 1).cumsum(-1))
        rows, length = position_ids.shape
        return compiled_create_block_mask()(mask_function, rows, None, length, length, device=position_ids.device)


@functools.cache
def compiled_create_block_mask() -> Callable:
    """``create_block_mask`` compiled: built eagerly it materializes the whole rows x length x length mask, compiled
    it works block by block. torch.compile of the function itself is how torch asks for it since ``_compile=True``
    was deprecated (the flag did the same, with a DeprecationWarning each call)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


packed_block_mask = PackedBlockMasks()

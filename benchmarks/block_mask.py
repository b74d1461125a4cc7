"""The BlockMask of packed rows (``shardtune.model.packed_attention``), made three ways: eagerly, with torch's
deprecated ``create_block_mask(..., _compile=True)``, and with ``torch.compile(create_block_mask)`` (shardtune's).
For each batch shape: the first call (compiling), then milliseconds a call (host and device, synchronized), and
whether the blocks equal the eager ones.

    python benchmarks/block_mask.py          (a GPU; results/block_mask_h200.txt)
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask

from shardtune.model.packed_attention import compiled_create_block_mask, packed_block_mask

# (rows, sequence): the seed's setting (seq 512, batch 1), seq 4096 batch 2, and seq 2048 batch 4.
SHAPES = [(1, 512), (2, 4096), (4, 2048)]


def packed_positions(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Position ids of rows packed with documents of 20-600 tokens, the last one cut at the row's end."""
    out = torch.empty(rows, length, dtype=torch.long)
    for row in range(rows):
        positions = []
        while len(positions) < length:
            positions += range(int(torch.randint(20, 600, (1,), generator=generator)))
        out[row] = torch.tensor(positions[:length])
    return out


def timed(make, args: tuple, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        make(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    warnings.simplefilter("ignore", DeprecationWarning)
    makers = {
        "eager": lambda *args: create_block_mask(*args, device=device),
        "_compile=True": lambda *args: create_block_mask(*args, device=device, _compile=True),
        "torch.compile": lambda *args: compiled_create_block_mask()(*args, device=device),
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for rows, length in SHAPES:
        position_ids = packed_positions(rows, length, generator).to(device)
        packed_block_mask(position_ids)  # fills the documents buffer the mask function reads
        mask_function = packed_block_mask._by_shape[(tuple(position_ids.shape), position_ids.device)][1]
        args = (mask_function, rows, None, length, length)
        reference = makers["eager"](*args).to_dense()
        for name, make in makers.items():
            first = timed(make, args, 1)
            per_call = timed(make, args, 20)
            equal = torch.equal(make(*args).to_dense(), reference)
            print(f"rows {rows} x {length:5d} {name:14s} first {first:9.1f} ms  then {per_call:7.3f} ms  equal {equal}")


if __name__ == "__main__":
    main()

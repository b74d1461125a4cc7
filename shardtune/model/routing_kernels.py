"""The fused MoE block's routing bookkeeping as Triton kernels: each token's top-k experts, and the
(token, choice) pairs put in expert order.

Written here because torch runs them as many small kernels, each a launch and a gap in a step that is
otherwise long GEMMs: ``torch.topk`` over a router's 128 experts is a generic sort-based kernel (51 us a
layer at Qwen3-30B-A3B's 8,192 tokens on one H200), and the expert order took a stable radix sort (about 9
kernels, 47 us), a scatter for its inverse and a ``searchsorted`` for the per-expert offsets. Here the top-k is
one kernel and the order two, with the same results:

- :func:`top_k_experts`: the indices of each row's ``k`` largest scores, largest first and, among equal
  scores, the lower index first (NaN counts as the largest, as in ``torch.topk``);
- :func:`expert_order`: a counting sort. One kernel counts each chunk's pairs per expert; the second, one
  program per chunk and group of experts, places that chunk's pairs of each of those experts after every pair
  of a lower expert and every earlier chunk's pair of the same expert, in pair order, so the order is
  ``torch.sort``'s stable one.

Both are ``torch.library.triton_op``s, so a compiled graph calls the kernels itself. Importing this module
needs Triton; ``fused_moe`` uses the kernels on CUDA tensors (``triton_kernels.runs_on``) and torch ops
elsewhere. Under ``TRITON_INTERPRET=1`` they run on CPU tensors, which is how the CPU tests check them
(``tests/train/test_routing_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Pairs a program of expert_order handles, and the experts it places them for (each a masked pass over the chunk,
# which it loads once). Qwen3-30B-A3B's 65,536 pairs of 128 experts: 16 chunks x 16 groups = 256 programs.
CHUNK = 4096
EXPERT_GROUP = 8
# Rows of the (chunks, experts) count table a program of expert_order reads at once.
COUNT_ROWS = 16
# Rows (tokens) a program of top_k_experts handles.
TOKEN_BLOCK = 16


@triton.jit
def _top_k_kernel(
    scores_ptr, chosen_ptr, tokens, experts, top_k: tl.constexpr, experts_p2: tl.constexpr, block: tl.constexpr
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
    column = tl.arange(0, experts_p2)
    real = (token < tokens)[:, None] & (column < experts)[None, :]
    scores = tl.load(scores_ptr + token[:, None] * experts + column[None, :], mask=real, other=0.0).to(tl.float32)
    scores = tl.where(scores != scores, float("inf"), scores)  # NaN ranks first, as in torch.topk
    taken = ~real  # padding columns are never chosen
    for choice in tl.static_range(top_k):
        best = tl.max(tl.where(taken, float("-inf"), scores), axis=1)
        candidate = (scores == best[:, None]) & ~taken
        index = tl.min(tl.where(candidate, column[None, :], experts_p2), axis=1)  # the lowest index of the best
        tl.store(chosen_ptr + token * top_k + choice, index.to(tl.int64), mask=token < tokens)
        taken = taken | (column[None, :] == index[:, None])


@triton_op("shardtune::top_k_experts", mutates_args=())
def top_k_experts(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """(tokens, top_k) int64: the columns of each row's ``top_k`` largest ``scores`` (tokens, experts), largest
    first, the lower column first among equal scores; ``torch.topk(scores, top_k).indices`` wherever no two
    scores of a row tie."""
    tokens, experts = scores.shape
    chosen = torch.empty(tokens, top_k, device=scores.device, dtype=torch.int64)
    if tokens:
        grid = (triton.cdiv(tokens, TOKEN_BLOCK),)
        wrap_triton(_top_k_kernel)[grid](
            scores.contiguous(), chosen, tokens, experts, top_k, triton.next_power_of_2(experts), TOKEN_BLOCK
        )
    return chosen


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, pairs, experts_p2: tl.constexpr, chunk: tl.constexpr):
    """counts[c, e]: the pairs of chunk c whose expert is e."""
    c = tl.program_id(0)
    pair = c.to(tl.int64) * chunk + tl.arange(0, chunk)
    ids = tl.load(ids_ptr + pair, mask=pair < pairs, other=0).to(tl.int32)
    counts = tl.histogram(ids, experts_p2)
    padding = tl.maximum((c.to(tl.int64) + 1) * chunk - pairs, 0).to(tl.int32)  # loaded as expert 0 above
    column = tl.arange(0, experts_p2)
    tl.store(counts_ptr + c * experts_p2 + column, counts - tl.where(column == 0, padding, 0))


@triton.jit
def _place_kernel(
    ids_ptr, counts_ptr, order_ptr, inverse_ptr, bounds_ptr, pairs, chunks, experts,
    experts_p2: tl.constexpr, chunk: tl.constexpr, count_rows: tl.constexpr, group: tl.constexpr,
):  # fmt: skip
    """Program (c, g): chunk c's pairs of each expert e of the g-th group of ``group`` experts, to the rows after
    every pair of experts < e and every pair of expert e in chunks < c, in pair order; programs (0, g) also write
    the bounds after their experts' rows, program (0, 0) the first bound, 0."""
    c = tl.program_id(0)
    first = tl.program_id(1) * group
    column = tl.arange(0, experts_p2)
    total = tl.zeros([experts_p2], dtype=tl.int32)  # pairs of each expert
    earlier = tl.zeros([experts_p2], dtype=tl.int32)  # pairs of each expert in chunks before c
    for start in range(0, chunks, count_rows):
        row = start + tl.arange(0, count_rows)
        counts = tl.load(
            counts_ptr + row[:, None] * experts_p2 + column[None, :], mask=(row < chunks)[:, None], other=0
        )
        total += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where(row[:, None] < c, counts, 0), axis=0)
    ends = tl.cumsum(total, axis=0)  # the bound after each expert's rows
    base = ends - total + earlier  # each expert's first row for chunk c
    if c == 0:
        mine = (column >= first) & (column < first + group) & (column < experts)
        tl.store(bounds_ptr + 1 + column, ends, mask=mine)
        if first == 0:
            tl.store(bounds_ptr, 0)
    pair = c.to(tl.int64) * chunk + tl.arange(0, chunk)
    ids = tl.load(ids_ptr + pair, mask=pair < pairs, other=-1)
    for member in tl.static_range(group):
        e = first + member
        is_e = ids == e
        row_of_first = tl.sum(tl.where(column == e, base, 0), axis=0)
        destination = (row_of_first + tl.cumsum(is_e.to(tl.int32), axis=0) - 1).to(tl.int64)
        tl.store(order_ptr + destination, pair, mask=is_e)
        tl.store(inverse_ptr + pair, destination, mask=is_e)


@triton_op("shardtune::expert_order", mutates_args=())
def expert_order(expert_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs ``expert_ids`` (pairs,) (each in [0, experts)) in expert order: (``order`` int64, row p of the
    expert-sorted layout is pair order[p], as ``torch.sort(expert_ids, stable=True)`` orders them;
    ``inverse`` int64, pair q's row; ``bounds`` (experts + 1,) int32, expert e's rows are bounds[e]:bounds[e + 1])."""
    pairs = expert_ids.numel()
    order = torch.empty(pairs, device=expert_ids.device, dtype=torch.int64)
    inverse = torch.empty_like(order)
    bounds = torch.empty(experts + 1, device=expert_ids.device, dtype=torch.int32)
    chunks = torch.sym_max(triton.cdiv(pairs, CHUNK), 1)  # one chunk of padding writes zero bounds
    experts_p2 = triton.next_power_of_2(experts)
    counts = torch.empty(chunks, experts_p2, device=expert_ids.device, dtype=torch.int32)
    ids = expert_ids.contiguous()
    wrap_triton(_chunk_counts_kernel)[(chunks,)](ids, counts, pairs, experts_p2, CHUNK)
    wrap_triton(_place_kernel)[(chunks, triton.cdiv(experts, EXPERT_GROUP))](
        ids, counts, order, inverse, bounds, pairs, chunks, experts, experts_p2, CHUNK, COUNT_ROWS, EXPERT_GROUP
    )
    return order, inverse, bounds

"""The fused MoE block's kernels on the shapes of issue 20's models, one GPU:

    python benchmarks/moe_kernels.py [--out FILE]

- grouped GEMMs: ``torch._grouped_mm`` (CUTLASS) on the experts' gate/up and down projections, forward and
  input gradient, against one dense GEMM of the same FLOPs, and against inductor's autotuned Triton
  template for the same op (``max_autotune_gemm`` with the Triton backend), on a skewed expert load;
- the sum of each token's k expert-sorted rows back to token order, compiled, in the two forms inductor
  can be given: a reduction over a (tokens, k, H) view of the gathered rows, and a running sum over the k
  gathers (``shardtune/model/fused_moe.py:_sum_rows``, compiled); a copy of the rows is the bandwidth
  reference.

Times are the median of ``torch.utils.benchmark`` runs; TFLOP/s count 2 FLOPs per multiply-add.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch._inductor.config as inductor_config
from torch.utils.benchmark import Timer

from shardtune.model.fused_moe import _sum_rows as sum_rows

# (name, experts, hidden, expert width, routed rows: 8,192 tokens x top_k)
SHAPES = [("qwen3-30b-a3b", 128, 2048, 768, 8192 * 8), ("glm-4.5-air", 128, 4096, 1408, 8192 * 8),
          ("mixtral-8x7b", 8, 4096, 14336, 8192 * 2)]  # fmt: skip


def seconds(function, *args) -> float:
    for _ in range(3):
        function(*args)
    torch.cuda.synchronize()
    names = {"function": function, "args": args, "torch": torch}
    timer = Timer("function(*args); torch.cuda.synchronize()", globals=names)
    return timer.blocked_autorange(min_run_time=0.5).median


def skewed_offsets(rows: int, experts: int) -> torch.Tensor:
    """Cumulative row counts of a long-tailed load (Dirichlet(2) expert shares)."""
    generator = torch.Generator().manual_seed(0)
    shares = torch._sample_dirichlet(torch.full((experts,), 2.0), generator)
    counts = torch.multinomial(shares, rows, replacement=True, generator=generator).bincount(minlength=experts)
    return counts.cumsum(0).to(device="cuda", dtype=torch.int32)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(rows, weight, offs=offsets)


def grouped_gemms(report) -> None:
    report("grouped GEMMs (bf16): CUTLASS | one dense GEMM of the same FLOPs | inductor's Triton template")
    for name, experts, hidden, width, rows in SHAPES:
        offsets = skewed_offsets(rows, experts)
        gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        cases = [
            ("gate/up", hidden, gate_up),
            ("down", width, down),
            ("gate/up dX", 2 * width, gate_up.transpose(-2, -1)),
            ("down dX", hidden, down.transpose(-2, -1)),
        ]
        for what, fan_in, weight in cases:
            inputs = torch.randn(rows, fan_in, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * fan_in * weight.shape[-1]
            grouped = seconds(grouped_mm, inputs, weight, offsets)
            dense = seconds(torch.mm, inputs, weight[0].contiguous())
            torch._dynamo.reset()
            with inductor_config.patch(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON"):
                tuned = torch.compile(grouped_mm, dynamic=False)
                tuned(inputs, weight, offsets)
            triton = seconds(tuned, inputs, weight, offsets)
            rates = [f"{time * 1e6:7.0f} us {flops / time / 1e12:4.0f} TFLOP/s" for time in (grouped, dense, triton)]
            report(f"  {name:14s} {what:10s} " + " | ".join(rates))


def summed_by_reduction(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    per_choice = rows.index_select(0, inverse).view(-1, top_k, rows.shape[-1])
    return per_choice.sum(dim=1, dtype=torch.float32).to(rows.dtype)


def row_sums(report) -> None:
    report("sum of each token's k rows, compiled: reduction over a view | running sum | copy of the rows")
    for name, experts, hidden, _, rows in SHAPES:
        top_k = rows // 8192
        _, order = torch.sort(torch.randint(0, experts, (rows,), device="cuda"), stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device="cuda"))
        sorted_rows = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        times = []
        for form in (summed_by_reduction, sum_rows):  # compiled, sum_rows is the running sum
            torch._dynamo.reset()
            times.append(seconds(torch.compile(form), sorted_rows, inverse, top_k))
        copy = seconds(torch.clone, sorted_rows)
        report(f"  {name:14s} k={top_k}  {times[0] * 1e6:6.0f} us | {times[1] * 1e6:6.0f} us | {copy * 1e6:6.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernels.py: needs a CUDA GPU")
    lines = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    row_sums(report)
    grouped_gemms(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

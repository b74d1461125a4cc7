"""The fused MoE block's kernels on the shapes of issue 20's models, one GPU:

    python benchmarks/moe_kernels.py [--out FILE] [--no-triton]

- grouped GEMMs: ``torch._grouped_mm`` (CUTLASS) on the experts' gate/up and down projections, forward and
  input gradient, against one dense GEMM of the same FLOPs, against inductor's autotuned Triton template
  for the same op (``max_autotune_gemm`` with the Triton backend; ``--no-triton`` leaves it out), and
  against quack-kernels' varlen GEMM through shardtune's own op (``model.grouped_gemm: quack``, where
  quack imports on a Hopper GPU), on a skewed expert load; and the two GEMMs whose rows are gathered
  from the tokens (gate/up's forward, down's input gradient), gathered first against quack gathering them
  inside its GEMM (``gathered_grouped_mm``);
- the sum of each token's k expert-sorted rows back to token order, compiled, in the two forms inductor
  can be given: a reduction over a (tokens, k, H) view of the gathered rows, and a running sum over the k
  gathers (``shardtune/model/fused_moe.py:_sum_rows``, compiled); a copy of the rows is the bandwidth
  reference;
- the weighted SiLU (``WeightedSiluMul``): its backward as inductor compiles the torch ops against
  shardtune's Triton kernel (``shardtune/model/weighted_silu_kernel.py``), and its forward compiled with
  static shapes against ``dynamic=True``, with the bytes each must move.

A time is the device's time per call over 20 calls issued back to back (CUDA events; the median of 5
such runs), as in a training step, where the host issues work ahead of the device. For quack, whose
Python front end does more per call than torch's, the host's time to issue one call is reported too.
TFLOP/s count 2 FLOPs per multiply-add. (Until 2026-11-24 a time was that of one call with a
synchronization after it, host and device together: ``results/moe_kernels_h200.txt``.)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config

from shardtune.model.fused_moe import _sum_rows as sum_rows
from shardtune.model.fused_moe import _weighted_silu_mul, weighted_silu_mul_backward_ops
from shardtune.model.grouped_gemm import gathered_grouped_mm, quack_unavailable
from shardtune.model.grouped_gemm import grouped_mm as shardtune_grouped_mm
from shardtune.model.weighted_silu_kernel import weighted_silu_mul_backward

# (name, experts, hidden, expert width, routed rows: 8,192 tokens x top_k)
SHAPES = [("qwen3-30b-a3b", 128, 2048, 768, 8192 * 8), ("glm-4.5-air", 128, 4096, 1408, 8192 * 8),
          ("mixtral-8x7b", 8, 4096, 14336, 8192 * 2)]  # fmt: skip


def timed(function, *args, calls: int = 20, runs: int = 5) -> tuple[float, float]:
    """(device seconds per call, host seconds to issue one call) over ``calls`` calls issued back to back."""
    for _ in range(3):
        function(*args)
    torch.cuda.synchronize()
    device, host = [], []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issued = time.perf_counter()
        for _ in range(calls):
            function(*args)
        host.append((time.perf_counter() - issued) / calls)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(device), statistics.median(host)


def seconds(function, *args) -> float:
    return timed(function, *args)[0]


def skewed_offsets(rows: int, experts: int) -> torch.Tensor:
    """Cumulative row counts of a long-tailed load (Dirichlet(2) expert shares)."""
    generator = torch.Generator().manual_seed(0)
    shares = torch._sample_dirichlet(torch.full((experts,), 2.0), generator)
    counts = torch.multinomial(shares, rows, replacement=True, generator=generator).bincount(minlength=experts)
    return counts.cumsum(0).to(device="cuda", dtype=torch.int32)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(rows, weight, offs=offsets)


def quack_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return shardtune_grouped_mm(rows, weight, offsets, backend="quack")


def grouped_gemms(report, triton: bool) -> None:
    quack = quack_unavailable(torch.device("cuda")) is None
    columns = ["CUTLASS", "one dense GEMM of the same FLOPs"]
    columns += ["inductor's Triton template"] * triton
    columns += ["quack (bit for bit equal to CUTLASS?; host time to issue a call)"] * quack
    report("grouped GEMMs (bf16): " + " | ".join(columns))
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
            times = [seconds(grouped_mm, inputs, weight, offsets), seconds(torch.mm, inputs, weight[0].contiguous())]
            if triton:
                torch._dynamo.reset()
                with inductor_config.patch(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON"):
                    tuned = torch.compile(grouped_mm, dynamic=False)
                    tuned(inputs, weight, offsets)
                times.append(seconds(tuned, inputs, weight, offsets))
            equal = ""
            if quack:
                device, host = timed(quack_grouped_mm, inputs, weight, offsets)
                times.append(device)
                same = torch.equal(quack_grouped_mm(inputs, weight, offsets), grouped_mm(inputs, weight, offsets))
                equal = f" ({'equal' if same else 'DIFFERENT'}; host {host * 1e6:.0f} us a call)"
            rates = [f"{time * 1e6:7.0f} us {flops / time / 1e12:4.0f} TFLOP/s" for time in times]
            report(f"  {name:14s} {what:10s} " + " | ".join(rates) + equal)


def skewed_routing(tokens: int, top_k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each expert-sorted row (int32), cumulative row counts) of ``tokens`` tokens routed to ``top_k``
    distinct experts each, drawn from long-tailed (Dirichlet(2)) expert shares, sorted as the fused block sorts."""
    generator = torch.Generator().manual_seed(0)
    shares = torch._sample_dirichlet(torch.full((experts,), 2.0), generator)
    chosen = torch.multinomial(shares.expand(tokens, -1), top_k, generator=generator)
    expert_of_row, order = torch.sort(chosen.reshape(-1), stable=True)
    offsets = expert_of_row.bincount(minlength=experts).cumsum(0).to(device="cuda", dtype=torch.int32)
    return (order // top_k).to(device="cuda", dtype=torch.int32), offsets


def gathered_gemms(report) -> None:
    """The two GEMMs whose rows are each token's own row (gate/up's forward, down's input gradient): the rows
    gathered by index_select and then multiplied, against quack gathering them inside its GEMM."""
    if quack_unavailable(torch.device("cuda")) is not None:
        report("gathered GEMMs: quack-kernels is not available here")
        return
    report("gathered GEMMs (bf16, 8,192 tokens): gather + CUTLASS | gather + quack | quack gathering itself "
           "(bit for bit equal to gather + CUTLASS?)")  # fmt: skip
    for name, experts, hidden, width, rows in SHAPES:
        top_k = rows // 8192
        token_of_row, offsets = skewed_routing(8192, top_k, experts)
        tokens = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16)  # down dX's operand
        for what, weight in (("gate/up", gate_up), ("down dX", down)):
            operands = (tokens, token_of_row, weight, offsets)
            times = [seconds(gathered_first, gemm, *operands) for gemm in (grouped_mm, quack_grouped_mm)]
            times.append(seconds(gathered_grouped_mm, *operands, "quack"))
            same = torch.equal(gathered_grouped_mm(*operands, "quack"), gathered_first(grouped_mm, *operands))
            flops = 2 * rows * hidden * weight.shape[-1]
            rates = [f"{time * 1e6:7.0f} us {flops / time / 1e12:4.0f} TFLOP/s" for time in times]
            report(f"  {name:14s} {what:10s} " + " | ".join(rates) + f" ({'equal' if same else 'DIFFERENT'})")


def gathered_first(gemm, tokens, token_of_row, weight, offsets) -> torch.Tensor:
    return gemm(tokens.index_select(0, token_of_row), weight, offsets)


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


def weighted_silu(report) -> None:
    report("weighted SiLU backward: inductor's kernels for the torch ops | Triton kernel (same input gradient?)")
    for name, _, _, width, rows in SHAPES:
        gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
        row_weights = torch.rand(rows, device="cuda")
        grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        moved = (2 * gate_up.numel() + grad.numel()) * 2  # read gate/up and grad, write the gate/up gradient
        torch._dynamo.reset()
        # the torch ops it ran as before the Triton kernel, compiled (in fp32, as in a compiled layer)
        compiled = torch.compile(functools.partial(weighted_silu_mul_backward_ops, compute=torch.float32))
        operands = (gate_up, row_weights, grad)
        times = [seconds(compiled, *operands), seconds(weighted_silu_mul_backward, *operands)]
        same = torch.equal(compiled(*operands)[0], weighted_silu_mul_backward(*operands)[0])
        rates = [f"{time * 1e6:6.0f} us {moved / time / 1e12:4.2f} TB/s" for time in times]
        report(f"  {name:14s} {' | '.join(rates)} ({'equal' if same else 'DIFFERENT'})")
    report("weighted SiLU forward, compiled: static shapes | dynamic=True")
    for name, _, _, width, rows in SHAPES:
        gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
        row_weights = torch.rand(rows, device="cuda")
        moved = (gate_up.numel() + rows * width) * 2
        times = []
        for dynamic in (None, True):
            torch._dynamo.reset()
            forward = torch.compile(functools.partial(_weighted_silu_mul, compute=torch.float32), dynamic=dynamic)
            times.append(seconds(forward, gate_up, row_weights))
        rates = [f"{time * 1e6:6.0f} us {moved / time / 1e12:4.2f} TB/s" for time in times]
        report(f"  {name:14s} {' | '.join(rates)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--no-triton", action="store_true", help="leave out inductor's Triton template (slow to tune)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernels.py: needs a CUDA GPU")
    lines = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    weighted_silu(report)
    row_sums(report)
    grouped_gemms(report, triton=not args.no_triton)
    gathered_gemms(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

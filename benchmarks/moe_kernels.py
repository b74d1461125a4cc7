"""The fused MoE block's kernels on the shapes of issue 20's models, one GPU:

    python benchmarks/moe_kernels.py [--out FILE] [--no-triton] [--quack-configs | --routing | --float8 | --float8-silu]
        [--shapes NAME ...]

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
  static shapes against ``dynamic=True``, with the bytes each must move;
- the router's bookkeeping, compiled: the top-k experts of softmax scores and the pairs in expert order (with its
  inverse and bounds) as torch ops (``torch.topk``, a stable ``torch.sort``, a scatter, ``searchsorted``)
  against shardtune's Triton kernels (``shardtune/model/routing_kernels.py``); ``--routing``: only this table;
- ``--float8`` (only this table): the grouped GEMMs in bf16 against float8 e4m3 with rowwise scales
  (``model.float8_experts``), with and without fast accumulation, the time to quantize their rows, and each
  one's error against the fp32 product; the attention projections' dense GEMMs the same way; and the weighted
  SiLU writing its float8 rows (forward and backward), inductor's kernels against shardtune's float8 Triton kernels
  (``--float8-silu``: only this table);
- ``--quack-configs`` (only this table): every SM90 tile configuration quack-kernels has, on each of those
  GEMMs at a skewed and a uniform load, against CUTLASS, quack's default configuration and the one shardtune
  pins (``shardtune/model/grouped_gemm.py``).

A time is the device's time per call over 20 calls issued back to back (CUDA events; the median of 5
such runs), as in a training step, where the host issues work ahead of the device. For quack, whose
Python front end does more per call than torch's, the host's time to issue one call is reported too.
TFLOP/s count 2 FLOPs per multiply-add. (Until 2026-11-24 a time was that of one call with a
synchronization after it, host and device together: ``results/moe_kernels_h200.txt``.)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config

from shardtune.model import fused_moe
from shardtune.model.float8 import float8_grouped_mm, resolve_float8_grouped_gemm, rowwise_float8
from shardtune.model.fused_moe import _sum_rows as sum_rows
from shardtune.model.fused_moe import _weighted_silu_mul, weighted_silu_mul_backward_ops
from shardtune.model.grouped_gemm import gathered_grouped_mm, quack_unavailable
from shardtune.model.grouped_gemm import grouped_mm as shardtune_grouped_mm
from shardtune.model.weighted_silu_kernel import (
    weighted_silu_mul_backward,
    weighted_silu_mul_backward_float8,
)

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


def skewed_bounds(rows: int, experts: int) -> torch.Tensor:
    """Each expert's rows bounds[e]:bounds[e + 1] (int32) of a long-tailed load (Dirichlet(2) expert shares)."""
    generator = torch.Generator().manual_seed(0)
    shares = torch._sample_dirichlet(torch.full((experts,), 2.0), generator)
    counts = torch.multinomial(shares, rows, replacement=True, generator=generator).bincount(minlength=experts)
    return as_bounds(counts)


def as_bounds(counts: torch.Tensor) -> torch.Tensor:
    """Row counts per expert as the grouped GEMMs take them: 0, then the cumulative counts (int32, on the GPU)."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device="cuda", dtype=torch.int32)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(rows, weight, offs=bounds[1:])


def quack_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return shardtune_grouped_mm(rows, weight, bounds, backend="quack")


def grouped_gemms(report, triton: bool) -> None:
    quack = quack_unavailable(torch.device("cuda")) is None
    columns = ["CUTLASS", "one dense GEMM of the same FLOPs"]
    columns += ["inductor's Triton template"] * triton
    columns += ["quack (bit for bit equal to CUTLASS?; host time to issue a call)"] * quack
    report("grouped GEMMs (bf16): " + " | ".join(columns))
    for name, experts, hidden, width, rows in SHAPES:
        bounds = skewed_bounds(rows, experts)
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
            times = [seconds(grouped_mm, inputs, weight, bounds), seconds(torch.mm, inputs, weight[0].contiguous())]
            if triton:
                torch._dynamo.reset()
                with inductor_config.patch(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON"):
                    tuned = torch.compile(grouped_mm, dynamic=False)
                    tuned(inputs, weight, bounds)
                times.append(seconds(tuned, inputs, weight, bounds))
            equal = ""
            if quack:
                device, host = timed(quack_grouped_mm, inputs, weight, bounds)
                times.append(device)
                same = torch.equal(quack_grouped_mm(inputs, weight, bounds), grouped_mm(inputs, weight, bounds))
                equal = f" ({'equal' if same else 'DIFFERENT'}; host {host * 1e6:.0f} us a call)"
            rates = [f"{time * 1e6:7.0f} us {flops / time / 1e12:4.0f} TFLOP/s" for time in times]
            report(f"  {name:14s} {what:10s} " + " | ".join(rates) + equal)


def skewed_routing(tokens: int, top_k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_by_expert`` of ``tokens`` tokens routed to ``top_k`` distinct experts each, drawn from long-tailed
    (Dirichlet(2)) expert shares."""
    generator = torch.Generator().manual_seed(0)
    shares = torch._sample_dirichlet(torch.full((experts,), 2.0), generator)
    return sorted_by_expert(torch.multinomial(shares.expand(tokens, -1), top_k, generator=generator), experts)


def sorted_by_expert(chosen: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each expert-sorted row (int32), each expert's row bounds) for each token's chosen experts
    (tokens, top_k), sorted as the fused block sorts."""
    expert_of_row, order = torch.sort(chosen.reshape(-1), stable=True)
    bounds = as_bounds(expert_of_row.bincount(minlength=experts))
    return (order // chosen.shape[1]).to(device="cuda", dtype=torch.int32), bounds


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
        token_of_row, bounds = skewed_routing(8192, top_k, experts)
        tokens = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16)  # down dX's operand
        for what, weight in (("gate/up", gate_up), ("down dX", down)):
            operands = (tokens, token_of_row, weight, bounds)
            times = [seconds(gathered_first, gemm, *operands) for gemm in (grouped_mm, quack_grouped_mm)]
            times.append(seconds(gathered_grouped_mm, *operands, "quack"))
            same = torch.equal(gathered_grouped_mm(*operands, "quack"), gathered_first(grouped_mm, *operands))
            flops = 2 * rows * hidden * weight.shape[-1]
            rates = [f"{time * 1e6:7.0f} us {flops / time / 1e12:4.0f} TFLOP/s" for time in times]
            report(f"  {name:14s} {what:10s} " + " | ".join(rates) + f" ({'equal' if same else 'DIFFERENT'})")


def uniform_routing(tokens: int, top_k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``skewed_routing``, each token's ``top_k`` experts drawn uniformly (a balanced load)."""
    generator = torch.Generator().manual_seed(1)
    return sorted_by_expert(torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices, experts)


def quack_configs(report) -> None:
    """Every SM90 tile configuration quack has, on each GEMM of the fused block (the rows gathered by the
    kernel where they are the tokens'), against CUTLASS, quack's default configuration (its untuned calls) and
    the one shardtune runs (``grouped_gemm._import_quack``)."""
    if quack_unavailable(torch.device("cuda")) is not None:
        report("quack configurations: quack-kernels is not available here")
        return
    from quack.gemm_config import config_supports, get_all_configs
    from quack.gemm_interface import gemm

    from shardtune.model.grouped_gemm import _Quack

    def named(config) -> str:
        kind = "pingpong" if config.pingpong else "cooperative"
        return f"{config.tile_m}x{config.tile_n} {kind} {config.cluster_m}x{config.cluster_n}"

    report("quack's SM90 tile configurations (bf16, 8,192 tokens; device time per call): CUTLASS (after a gather "
           "where the rows are gathered) | quack's default | shardtune's | the fastest of all (all bit for bit "
           "equal to quack's default?)")  # fmt: skip
    candidates = [config for config in get_all_configs() if config.device_capacity == 9 and not config.swap_ab]
    for name, experts, hidden, width, rows in SHAPES:
        top_k = rows // 8192
        gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16)
        down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16)
        tokens = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
        for load, routing in (("skewed", skewed_routing), ("uniform", uniform_routing)):
            token_of_row, bounds = routing(8192, top_k, experts)
            cases = [
                ("gate/up", torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16), gate_up.mT, None),
                ("down", torch.randn(rows, width, device="cuda", dtype=torch.bfloat16), down.mT, None),
                ("gate/up dX", torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16), gate_up, None),
                ("gate/up gathered", tokens, gate_up.mT, token_of_row),
                ("down dX gathered", tokens, down, token_of_row),
            ]
            for what, a, weight, row_of_a in cases:
                flops = 2 * rows * a.shape[1] * weight.shape[-1]
                out = torch.empty(rows, weight.shape[-1], device="cuda", dtype=torch.bfloat16)
                default = gemm(a, weight, cu_seqlens_m=bounds, A_idx=row_of_a, tuned=False)
                if load == "skewed":  # quack's autotuner compiles every configuration, in parallel
                    gemm(a, weight, cu_seqlens_m=bounds, A_idx=row_of_a, tuned=True)
                mine = _Quack.config if row_of_a is None else _Quack.gathered_config
                times, equal = {}, True
                for config in candidates:
                    if config_supports(config, gather_A=row_of_a is not None, varlen_m=True):
                        run = functools.partial(_Quack.gemm, a, weight, out, cu_seqlens_m=bounds, A_idx=row_of_a,
                                                config=config)  # fmt: skip
                        times[named(config)] = seconds(run)
                        equal = equal and torch.equal(out, default)
                fastest = min(times, key=times.get)
                if row_of_a is None:
                    cutlass = seconds(grouped_mm, a, weight, bounds)
                else:
                    cutlass = seconds(gathered_first, grouped_mm, a, row_of_a, weight, bounds)
                quack = seconds(functools.partial(gemm, a, weight, cu_seqlens_m=bounds, A_idx=row_of_a, tuned=False))
                rates = [f"{time * 1e6:6.0f} us {flops / time / 1e12:3.0f} TF/s"
                         for time in (cutlass, quack, times[named(mine)], times[fastest])]  # fmt: skip
                report(f"  {name:14s} {load:7s} {what:16s} " + " | ".join(rates) + f" ({fastest}; "
                       f"{'equal' if equal else 'DIFFERENT'})")  # fmt: skip


def gathered_first(gemm, tokens, token_of_row, weight, bounds) -> torch.Tensor:
    return gemm(tokens.index_select(0, token_of_row), weight, bounds)


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


def routing_bookkeeping(probabilities: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """The fused block's routing after the router's softmax (as Qwen3-MoE and Mixtral route)."""
    chosen = fused_moe.top_k_experts(probabilities, top_k)
    return (probabilities.gather(1, chosen), *fused_moe.expert_order(chosen.reshape(-1), probabilities.shape[1]))


def routing(report) -> None:
    report("routing, compiled (top-k of softmax scores, expert order, its inverse and bounds): torch ops | Triton "
           "kernels (each equal to the torch ops run eagerly?)")  # fmt: skip
    kernels = fused_moe.routing_kernels
    for name, experts, _, _, rows in SHAPES:
        top_k = rows // 8192
        logits = torch.randn(8192, experts, device="cuda")
        logits[:, : experts // 8] += 1.0  # a skewed load: an eighth of the experts take most pairs
        probabilities = logits.softmax(dim=-1)
        fused_moe.routing_kernels = None
        expected = routing_bookkeeping(probabilities, top_k)
        cells = []
        for module in (None, kernels):
            fused_moe.routing_kernels = module
            torch._dynamo.reset()
            compiled = torch.compile(functools.partial(routing_bookkeeping, top_k=top_k), fullgraph=True)
            outputs = compiled(probabilities)
            if all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True)):
                same = "equal"
            elif torch.equal(outputs[0], expected[0]) and torch.equal(outputs[3], expected[3]):
                same = "equal but for the order of equal scores"  # the same weights and loads, tied experts swapped
            else:
                same = "DIFFERENT"
            cells.append(f"{seconds(compiled, probabilities) * 1e6:6.1f} us ({same})")
        fused_moe.routing_kernels = kernels
        report(f"  {name:14s} {' | '.join(cells)}")


def float8_gemms(report) -> None:
    """The experts' GEMMs in bf16 (CUTLASS) against float8 e4m3 with rowwise scales (torch._scaled_grouped_mm
    without and with fast accumulation, and shardtune's Triton kernel where it runs, as ``model.float8_experts``
    runs them: the weight quantized once, as a frozen one is; the rows each call, compiled), and each one's error
    against the fp32 product; then the attention projections' dense GEMMs the same way (torch._scaled_mm)."""
    quantize = torch.compile(rowwise_float8, dynamic=False)
    kernel = resolve_float8_grouped_gemm("auto", torch.device("cuda")) == "triton"
    report("float8 GEMMs: bf16 CUTLASS | float8 | float8 fast accumulation | "
           + "shardtune's Triton kernel (bit for bit equal to fast accumulation?) | " * kernel
           + "quantizing the rows (relative error against fp32: bf16 / float8 fast accumulation)")  # fmt: skip

    def scaled(rows, row_scales, values, scales, bounds, fast):
        return torch._scaled_grouped_mm(rows, values.transpose(-2, -1), row_scales, scales, offs=bounds[1:],
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip

    def scaled_dense(rows, row_scales, values, scales, fast):
        return torch._scaled_mm(rows, values.t(), row_scales[:, None], scales[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast)  # fmt: skip

    def error(result, reference):
        return ((result.float() - reference).norm() / reference.norm()).item()

    def line(name, flops, times, quantizing, errors=""):
        rates = [f"{seconds * 1e6:6.0f} us {flops / seconds / 1e12:5.0f} TFLOP/s" for seconds in times]
        report(f"  {name:25s} " + " | ".join(rates) + f" | {quantizing * 1e6:5.0f} us{errors}")

    for name, experts, hidden, width, rows in SHAPES:
        # quantize compiles once per row width: a shape's three, under dynamo's limit of 8 (else it runs eagerly)
        torch._dynamo.reset()
        bounds = skewed_bounds(rows, experts)
        gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        down = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16) * 0.02
        # Each weight as transformers stores it, (E, N outputs, K summed over); the input gradients' are W^T.
        cases = [("gate/up", gate_up), ("down", down), ("gate/up dX", gate_up.transpose(-2, -1).contiguous()),
                 ("down dX", down.transpose(-2, -1).contiguous())]  # fmt: skip
        for what, weight in cases:
            inputs = torch.randn(rows, weight.shape[-1], device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * weight.shape[-1] * weight.shape[-2]
            values, scales = rowwise_float8(weight)
            row_values, row_scales = quantize(inputs)
            operands = (row_values, row_scales, values, scales, bounds)
            times = [seconds(grouped_mm, inputs, weight.transpose(-2, -1), bounds)]
            times += [seconds(scaled, *operands, fast) for fast in (False, True)]
            equal = ""
            if kernel:
                # and the host time to issue one call (the op as the fused block calls it), against torch's
                device, host = timed(float8_grouped_mm, *operands, torch.bfloat16, "triton")
                times.append(device)
                torch_host = timed(float8_grouped_mm, *operands, torch.bfloat16, "torch")[1]
                same = torch.equal(float8_grouped_mm(*operands, torch.bfloat16, "triton"), scaled(*operands, True))
                equal = (
                    f" (kernel {'equal' if same else 'DIFFERENT'}; host a call: kernel {host * 1e6:.0f} us, torch's"
                    f" {torch_host * 1e6:.0f} us)"
                )
            reference = torch._grouped_mm(inputs.float(), weight.float().transpose(-2, -1), offs=bounds[1:])
            bf16_error = error(grouped_mm(inputs, weight.transpose(-2, -1), bounds), reference)
            float8_error = error(scaled(*operands, True), reference)
            errors = f" ({bf16_error:.1e} / {float8_error:.1e}){equal}"
            line(f"{name} {what}", flops, times, seconds(quantize, inputs), errors)
    projections = [("qwen3 q_proj", 2048, 4096), ("qwen3 o_proj", 4096, 2048), ("glm-air q_proj", 4096, 12288),
                   ("glm-air o_proj", 12288, 4096)]  # fmt: skip
    torch._dynamo.reset()
    for name, hidden, outputs in projections:
        inputs = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(outputs, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        operands = (*quantize(inputs), *rowwise_float8(weight))
        times = [seconds(torch.mm, inputs, weight.t())]
        times += [seconds(scaled_dense, *operands, fast) for fast in (False, True)]
        line(name, 2 * 8192 * hidden * outputs, times, seconds(quantize, inputs))
    float8_silu(report)


def float8_silu(report) -> None:
    """The weighted SiLU with its output (forward) and its gate/up gradient (backward) quantized for the float8 GEMMs
    that take them: compiled torch ops, then ``rowwise_float8`` compiled (the backward's first part being the bf16
    Triton kernel), against what ``Float8Experts`` runs: the float8 Triton kernels (the forward's for rows up to
    ``FLOAT8_ROW_TILE`` wide)."""
    report("weighted SiLU to float8 rows: inductor's kernels (backward: bf16 kernel, then quantized) | float8 "
           "Triton kernel (bytes the kernel must move at least)")  # fmt: skip
    compiled_forward = torch.compile(
        lambda gate_up, row_weights: rowwise_float8(_weighted_silu_mul(gate_up, row_weights, torch.float32)),
        dynamic=False,
    )
    quantize = torch.compile(rowwise_float8, dynamic=False)
    # as a compiled layer runs it: the kernel for rows it holds, inductor's kernels for wider ones (Mixtral's)
    shardtune_forward = torch.compile(fused_moe._weighted_activation_float8, dynamic=False)

    def backward_then_quantized(gate_up, row_weights, grad):
        grad_gate_up, grad_weights = weighted_silu_mul_backward(gate_up, row_weights, grad)
        return *quantize(grad_gate_up), grad_weights

    for name, _, _, width, rows in SHAPES:
        gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16)
        row_weights = torch.rand(rows, device="cuda")
        grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        for what, before, after, moved in (
            ("forward", compiled_forward, shardtune_forward, gate_up.numel() * 2 + rows * width),
            ("backward", backward_then_quantized, weighted_silu_mul_backward_float8,
             gate_up.numel() * 3 + grad.numel() * 2),
        ):  # fmt: skip
            operands = (gate_up, row_weights) if what == "forward" else (gate_up, row_weights, grad)
            times = [seconds(before, *operands), seconds(after, *operands)]
            rates = [f"{time * 1e6:6.0f} us {moved / time / 1e12:4.2f} TB/s" for time in times]
            report(f"  {name:14s} {what:9s} {' | '.join(rates)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--no-triton", action="store_true", help="leave out inductor's Triton template (slow to tune)")
    parser.add_argument("--quack-configs", action="store_true", help="only the table of quack's tile configurations")
    parser.add_argument("--routing", action="store_true", help="only the table of the routing bookkeeping")
    parser.add_argument("--float8", action="store_true", help="only the tables of bf16 against float8 GEMMs")
    parser.add_argument("--float8-silu", action="store_true", help="only the table of the weighted SiLU to float8")
    parser.add_argument("--shapes", nargs="+", choices=[shape[0] for shape in SHAPES], help="only these models")
    args = parser.parse_args()
    if args.shapes:
        SHAPES[:] = [shape for shape in SHAPES if shape[0] in args.shapes]
    if not torch.cuda.is_available():
        sys.exit("moe_kernels.py: needs a CUDA GPU")
    with open(args.out or os.devnull, "w") as out:

        def report(line: str) -> None:  # line by line, so a run stopped by a time limit keeps what it measured
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()

        report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        if args.quack_configs:
            quack_configs(report)
            return
        if args.float8_silu:
            float8_silu(report)
            return
        if args.float8:
            float8_gemms(report)
            return
        routing(report)
        if args.routing:
            return
        weighted_silu(report)
        row_sums(report)
        grouped_gemms(report, triton=not args.no_triton)
        gathered_gemms(report)


if __name__ == "__main__":
    main()

"""Where a profiled step's device time goes, by kind of kernel, and where the device waits, from the Chrome
trace ``logging.profile_steps`` writes (``profile/rank<r>.trace.json.gz``):

    python -m shardtune.bench.profile_share RUN_DIR/profile/rank0.trace.json.gz

GEMMs are the matrix-multiply kernels (cuBLAS / cuBLASLt, CUTLASS, including the grouped GEMMs of MoE
experts, quack's, and inductor's Triton matmul templates); attention is the fused attention kernels
(flash, memory-efficient, cuDNN); everything else (elementwise, copies, reductions, indexing,
communication) is "other". The kinds are told by kernel names, so a new kernel library may need its
names added here.

The device waits where no kernel, copy or memset runs: between two of them, the host had not yet launched
the next (it was behind, e.g. in Python between steps or in an op's host-side setup). Those gaps are
grouped by the two kernels around them, and the largest are shown with the host operators that were
running when the device ran out of work: what to make faster, or to take off the device's path.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

GEMM_MARKERS = ("gemm", "nvjet", "xmma", "matmul", "cutlass", "wgmma", "grouped_mm", "_mm_", "cublas")
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn", "cudnn_sdpa", "sdpa")


# Inductor names a kernel by its kind and by the ops fused into it: its pointwise and reduction kernels
# (triton_poi_ / triton_red_ / triton_per_) are elementwise work even when named after the matmul or the
# attention they feed (triton_poi_fused__grouped_mm_index_select_...); its matmul templates are triton_tem_.
INDUCTOR_ELEMENTWISE = ("triton_poi_", "triton_red_", "triton_per_")


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith(INDUCTOR_ELEMENTWISE):
        return "other"
    if any(marker in lowered for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in lowered for marker in GEMM_MARKERS):
        return "gemm"
    return "other"


def read_trace(trace_path: Path) -> list[dict]:
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def device_time_shares(events: list[dict]) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(microseconds per kind, the 10 largest non-GEMM kernels by total microseconds) of a trace's kernels."""
    by_kind: dict[str, float] = defaultdict(float)
    others: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        kind = kernel_kind(event["name"])
        by_kind[kind] += event["dur"]
        if kind != "gemm":
            others[event["name"]] += event["dur"]
    return dict(by_kind), sorted(others.items(), key=lambda item: -item[1])[:10]


def format_shares(by_kind: dict[str, float], largest: list[tuple[str, float]]) -> str:
    total = sum(by_kind.values())
    if not total:
        return "no device kernels in the trace (a CPU run?)"
    lines = [f"device time in kernels: {total / 1e6:.3f} s"]
    for kind in ("gemm", "attention", "other"):
        lines.append(f"  {kind:<10}{by_kind.get(kind, 0.0) / 1e6:>9.3f} s  {by_kind.get(kind, 0.0) / total:>6.1%}")
    lines.append("largest kernels besides GEMMs:")
    lines += [f"  {duration / total:>6.1%}  {name[:110]}" for name, duration in largest]
    return "\n".join(lines)


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WORK = ("cpu_op", "python_function", "user_annotation")
GAP_US = 10.0  # shorter gaps are a launch's own latency, not a host that fell behind


@dataclass
class Gap:
    start: float  # microseconds, trace time
    length: float
    before: str  # the device work that ran last before it
    after: str  # and the first after it


@dataclass
class DeviceIdle:
    span: float  # from the first device work's start to the last one's end, microseconds
    busy: float  # time some device work ran (overlapping streams counted once)
    gaps: list[Gap]  # every gap longer than GAP_US, in trace order


def device_idle(events: list[dict]) -> DeviceIdle:
    """The trace's device timeline: how long it spans, how much of that something ran, and its gaps."""
    work = sorted(
        (event for event in events if event.get("cat") in DEVICE_WORK and "dur" in event and "ts" in event),
        key=lambda event: event["ts"],
    )
    if not work:
        return DeviceIdle(0.0, 0.0, [])
    busy, gaps = 0.0, []
    run_start, run_end, ran_last = work[0]["ts"], work[0]["ts"] + work[0]["dur"], work[0]
    for event in work[1:]:
        if event["ts"] > run_end:  # the device was idle from run_end until this work began
            busy += run_end - run_start
            if event["ts"] - run_end > GAP_US:
                gaps.append(Gap(run_end, event["ts"] - run_end, ran_last["name"], event["name"]))
            run_start = event["ts"]
        if event["ts"] + event["dur"] >= run_end:
            run_end, ran_last = event["ts"] + event["dur"], event
    busy += run_end - run_start
    return DeviceIdle(run_end - work[0]["ts"], busy, gaps)


def host_operators_at(events: list[dict], moment: float) -> list[str]:
    """The host operators (and Python functions, where the trace has them) open at ``moment``, outermost
    first: what the host was doing when the device ran out of work."""
    open_ = [
        event
        for event in events
        if event.get("cat") in HOST_WORK and "dur" in event and event["ts"] <= moment < event["ts"] + event["dur"]
    ]
    return [event["name"] for event in sorted(open_, key=lambda event: (event["ts"], -event["dur"]))]


def format_idle(events: list[dict], idle: DeviceIdle, pairs: int = 15, longest: int = 8) -> str:
    if not idle.span:
        return "no device work in the trace (a CPU run?)"
    waiting = idle.span - idle.busy
    in_gaps = sum(gap.length for gap in idle.gaps)
    lines = [
        f"device idle: {waiting / 1e3:.1f} ms of {idle.span / 1e3:.1f} ms ({waiting / idle.span:.1%}); "
        f"{in_gaps / 1e3:.1f} ms of it in {len(idle.gaps)} gaps over {GAP_US:.0f} us",
        f"gaps by the device work around them (the {pairs} largest totals):",
    ]
    totals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for gap in idle.gaps:
        totals[(gap.before, gap.after)].append(gap.length)
    for (before, after), lengths in sorted(totals.items(), key=lambda item: -sum(item[1]))[:pairs]:
        lines.append(f"  {sum(lengths) / 1e3:>8.2f} ms {len(lengths):>5}x  {before[:55]}  ->  {after[:55]}")
    lines.append(f"the {longest} longest gaps, with the host operators running when the device ran out of work:")
    for gap in sorted(idle.gaps, key=lambda gap: -gap.length)[:longest]:
        host = host_operators_at(events, gap.start)
        lines.append(f"  {gap.length / 1e3:>8.2f} ms  {gap.before[:55]}  ->  {gap.after[:55]}")
        lines.append(f"             host: {' / '.join(name[:60] for name in host[-4:]) or '(no operator open)'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python -m shardtune.bench.profile_share PROFILE/rank0.trace.json.gz", file=sys.stderr)
        return 2
    events = read_trace(Path(argv[0]))
    print(format_shares(*device_time_shares(events)))
    print()
    print(format_idle(events, device_idle(events)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

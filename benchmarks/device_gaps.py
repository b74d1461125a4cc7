"""Where the device idles in a profiled step (``logging.profile_steps``' trace): the gaps between kernels, whether
the host had launched the next kernel before the device ran dry, and what the host was doing at that launch;
then one layer's forward and backward kernels in order, each with the idle time before it.

    python benchmarks/device_gaps.py RUN/profile/rank0.trace.json.gz

The idle time is summed by the kernel the device waited for (and by the pair of kernels around the gap): a gap that
recurs at one place in every layer shows as one line with a count of the layers. Read a trace of
``logging.profile_host: false`` for how long the device waits in a real step: recording the host's operators
slows the host, and a step that waits on the host waits longer (shardtune/metrics/profiler.py); such a trace has
no host operators, and the sections that name them are left out.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys

SIZES = ((3, 10), (10, 50), (50, 200), (200, 1000), (1000, float("inf")))  # gap sizes, us


def enclosing_ops(ops: list[dict], starts: list[float], ts: float, tid) -> str:
    """The host operators of thread ``tid`` running at ``ts``, outermost first."""
    index = bisect.bisect_right(starts, ts)
    around = [
        op
        for op in ops[max(0, index - 4000) : index]
        if op["ts"] <= ts <= op["ts"] + op["dur"] and op.get("tid") == tid
    ]
    return " > ".join(op["name"][:40] for op in sorted(around, key=lambda op: -op["dur"])[:6])


def main(path: str) -> None:
    with gzip.open(path) as trace:
        events = json.load(trace)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # Kernels launched through the runtime (cudaLaunchKernel: aten, cuBLAS, cuDNN) or the driver (cuLaunchKernel:
    # Triton's and CuTe DSL's kernels).
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
    }
    ops = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e), key=lambda e: e["ts"]
    )
    starts = [op["ts"] for op in ops]
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    print(f"kernels {len(kernels)}, busy {busy / 1e3:.1f} ms of span {span / 1e3:.1f} ms ({busy / span:.1%})")
    gaps = []  # (us, previous kernel, next kernel, at us, host late, host ops at the launch)
    end, previous = kernels[0]["ts"] + kernels[0]["dur"], kernels[0]
    for kernel in kernels[1:]:
        if kernel["ts"] - end > 3:
            launch = launches.get(kernel["args"].get("correlation"))
            stack = enclosing_ops(ops, starts, launch["ts"], launch.get("tid")) if launch else "?"
            late = launch is not None and launch["ts"] > end
            gaps.append(
                (kernel["ts"] - end, previous["name"], kernel["name"], kernel["ts"] - kernels[0]["ts"], late, stack)
            )
        if kernel["ts"] + kernel["dur"] > end:
            end, previous = kernel["ts"] + kernel["dur"], kernel
    late = sum(gap[0] for gap in gaps if gap[4])
    total = sum(gap[0] for gap in gaps)
    print(f"gaps > 3 us: {len(gaps)}, {total / 1e3:.1f} ms;", end=" ")
    print(f"host late (launched when the device was idle): {late / 1e3:.1f} ms")
    for low, high in SIZES:
        chosen = [gap[0] for gap in gaps if low < gap[0] <= high]
        print(f"  {low:>5}-{high:<6} us: {len(chosen):5d} gaps, {sum(chosen) / 1e3:7.2f} ms")
    print("\nlargest 40 gaps (us, at ms, host late, previous -> next kernel, host ops at the next launch):")
    for gap in sorted(gaps, key=lambda gap: -gap[0])[:40]:
        flag = "late" if gap[4] else "    "
        print(f"{gap[0]:8.0f} {gap[3] / 1e3:8.2f} {flag} {gap[1][:70]} -> {gap[2][:70]}\n        {gap[5][:300]}")
    idle_by("the kernel after the gap", gaps, lambda gap: gap[2][:70])
    idle_by("the kernels before and after the gap", gaps, lambda gap: f"{gap[1][:50]} -> {gap[2][:60]}")
    if ops:  # none in a trace of logging.profile_host: false
        idle_by("host ops at the next launch (4 levels)", gaps, lambda gap: " > ".join(gap[5].split(" > ")[:4]))
        host_late_windows(gaps_windows(kernels, launches), ops)
    for marker, what in (("fprop", "forward"), ("bprop", "backward")):
        at = [i for i, kernel in enumerate(kernels) if marker in kernel["name"]]
        if len(at) > 12:
            first, last = (at[10] - 20, at[11]) if marker == "fprop" else (at[10], at[11])
            print(f"\none layer's {what}: kernels {first}..{last}")
            print("  device us, idle before it us, host us since the previous launch, kernel, host ops at its launch")
            previous_launch = None
            for before, kernel in zip(kernels[first - 1 : last - 1], kernels[first:last], strict=True):
                idle = kernel["ts"] - (before["ts"] + before["dur"])
                launch = launches.get(kernel["args"].get("correlation"))
                host = "" if launch is None or previous_launch is None else f"{launch['ts'] - previous_launch:6.1f}"
                previous_launch = launch["ts"] if launch else None
                stack = enclosing_ops(ops, starts, launch["ts"], launch.get("tid")) if launch else "?"
                inner = " > ".join(stack.split(" > ")[-2:])
                print(f"{kernel['dur']:8.1f} {max(idle, 0):6.1f} {host:>6}  {kernel['name'][:60]:60}  {inner[:90]}")


def idle_by(title: str, gaps: list[tuple], key) -> None:
    """The gaps' idle time and number summed by ``key(gap)``, the 25 largest (ms, gaps)."""
    idle, count = collections.Counter(), collections.Counter()
    for gap in gaps:
        idle[key(gap)] += gap[0]
        count[key(gap)] += 1
    print(f"\nidle by {title}:")
    for name, total in idle.most_common(25):
        print(f"{total / 1e3:8.2f} ms {count[name]:5d}  {name[:250]}")


def gaps_windows(kernels: list[dict], launches: dict) -> list[tuple[float, float, object]]:
    """(from, to, host thread) of each stretch where the device sat idle waiting for the host: from the end of
    the kernels before to the launch of the next (which came after that end)."""
    windows, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for kernel in kernels[1:]:
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is not None and launch["ts"] > end + 3:
            windows.append((end, launch["ts"], launch.get("tid")))
        end = max(end, kernel["ts"] + kernel["dur"])
    return windows


def host_late_windows(windows: list[tuple[float, float, object]], ops: list[dict]) -> None:
    """What the host did while the device waited for it: each host operator's own time (less the operators
    inside it) within those stretches, summed by name."""
    by_thread = collections.defaultdict(list)
    for op in ops:  # ops are sorted by start
        by_thread[op.get("tid")].append(op)
    thread_starts = {tid: [op["ts"] for op in thread] for tid, thread in by_thread.items()}
    own = collections.Counter()
    total = 0.0
    for low, high, tid in windows:
        total += high - low
        thread, index = by_thread[tid], bisect.bisect_left(thread_starts.get(tid, []), high)
        inside = [op for op in thread[max(0, index - 4000) : index] if op["ts"] + op["dur"] > low]
        outermost = [
            op
            for op in inside
            if not any(
                o is not op
                and o["ts"] <= op["ts"]
                and op["ts"] + op["dur"] <= o["ts"] + o["dur"]
                and o["dur"] > op["dur"]
                for o in inside
            )
        ]
        own["(in no operator: Python between operators)"] += (high - low) - sum(
            min(high, op["ts"] + op["dur"]) - max(low, op["ts"]) for op in outermost
        )
        covered = collections.Counter()
        for op in inside:
            covered[id(op)] = min(high, op["ts"] + op["dur"]) - max(low, op["ts"])
        for op in inside:  # an operator's own time: its time in the window less its children's
            children = sum(
                covered[id(other)]
                for other in inside
                if other is not op
                and op["ts"] <= other["ts"]
                and other["ts"] + other["dur"] <= op["ts"] + op["dur"]
                and other["dur"] < op["dur"]
            )
            own[op["name"][:90]] += max(covered[id(op)] - children, 0.0)
    print(f"\nthe host while the device waited for it ({len(windows)} stretches, {total / 1e3:.1f} ms), own time:")
    for name, spent in own.most_common(30):
        print(f"{spent / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main(sys.argv[1])

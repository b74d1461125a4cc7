"""Where a profiled step's device time goes, by kind of kernel, from the Chrome trace ``logging.profile_steps``
writes (``profile/rank<r>.trace.json.gz``):

    python -m shardtune.bench.profile_share RUN_DIR/profile/rank0.trace.json.gz

GEMMs are the matrix-multiply kernels (cuBLAS / cuBLASLt, CUTLASS, including the grouped GEMMs of MoE
experts, quack's, and inductor's Triton matmul templates); attention is the fused attention kernels
(flash, memory-efficient, cuDNN); everything else (elementwise, copies, reductions, indexing,
communication) is "other". The kinds are told by kernel names, so a new kernel library may need its
names added here.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
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


def device_time_shares(trace_path: Path) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(microseconds per kind, the 10 largest non-GEMM kernels by total microseconds) of a trace's kernels."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
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


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python -m shardtune.bench.profile_share PROFILE/rank0.trace.json.gz", file=sys.stderr)
        return 2
    print(format_shares(*device_time_shares(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``logging.profile_steps`` and ``logging.profile_host``, and benchmarks/device_gaps.py on the traces they write."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import torch
from conftest import REPO
from torch.profiler import ProfilerActivity

from shardtune.metrics.profiler import profiled_activities


def test_the_host_is_recorded_unless_profile_host_is_off_on_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert profiled_activities(cpu, host=True) == profiled_activities(cpu, host=False) == [ProfilerActivity.CPU]
    assert profiled_activities(gpu, host=True) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert profiled_activities(gpu, host=False) == [ProfilerActivity.CUDA]


def gaps_report(tmp_path, with_host: bool) -> str:
    """device_gaps.py on a trace of three layers, each a norm, an attention kernel the device waits 50 us for
    and a GEMM; with the host's operators (a launch and the op around it) or the kernels alone."""
    events, at = [], 0
    for _ in range(3):  # layers
        for name, duration, idle in (("norm", 10, 1), ("attention", 100, 50), ("gemm", 200, 2)):
            at += idle
            correlation = len(events)
            events.append(
                {"cat": "kernel", "name": name, "ts": at, "dur": duration, "args": {"correlation": correlation}}
            )
            if with_host:
                launched = at - 5 if name == "attention" else at - idle - 20  # the attention's launch came late
                events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched, "dur": 4,
                               "tid": 1, "args": {"correlation": correlation}})  # fmt: skip
                events.append({"cat": "cpu_op", "name": f"aten::{name}", "ts": launched - 30, "dur": 40, "tid": 1})
            at += duration
    trace = tmp_path / f"trace-{with_host}.json.gz"
    with gzip.open(trace, "wt") as out:
        json.dump({"traceEvents": events}, out)
    script = REPO / "benchmarks" / "device_gaps.py"
    return subprocess.run([sys.executable, str(script), str(trace)], capture_output=True, text=True, check=True).stdout


def test_device_gaps_sums_the_idle_time_by_the_kernel_waited_for(tmp_path):
    device_only = gaps_report(tmp_path, with_host=False)
    assert "gaps > 3 us: 3, 0.1 ms" in device_only
    assert "idle by the kernel after the gap:\n    0.15 ms     3  attention\n" in device_only
    assert "idle by the kernels before and after the gap:\n    0.15 ms     3  norm -> attention\n" in device_only
    assert "idle by host ops" not in device_only and "the host while the device waited" not in device_only
    with_host = gaps_report(tmp_path, with_host=True)
    assert "host late (launched when the device was idle): 0.1 ms" in with_host
    assert "    0.15 ms     3  aten::attention\n" in with_host


def test_gpu_clocks_places_the_samples_in_their_steps(tmp_path):
    """benchmarks/gpu_clocks.py: three 1 s steps ending when the log was written, sampled every 0.1 s with a
    falling clock and rising power; each step gets its ten samples."""
    import datetime
    import os
    import time

    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "train_log.jsonl"
    rows = [{"step": step, "elapsed_s": float(step), "tokens": 1000, "tokens_per_s": 1000.0} for step in (1, 2, 3)]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    written = time.time()
    os.utime(log, (written, written))
    lines = []
    for sample in range(40):
        at = datetime.datetime.fromtimestamp(written - 3.45 + sample * 0.1).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        lines.append(f"{at}, {1980 - sample} MHz, {600 + sample} W, 0x0000000000000004")
    (tmp_path / "clocks.csv").write_text("timestamp, clocks.sm, power, reasons\n" + "\n".join(lines) + "\n")
    script = REPO / "benchmarks" / "gpu_clocks.py"
    report = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(tmp_path / "clocks.csv")], capture_output=True, text=True
    ).stdout.splitlines()
    assert report[1:] == [
        "   1     1,000  1966-1975 (1970)  610, 614  {'0x0000000000000004': 10}",
        "   2     1,000  1956-1965 (1960)  620, 624  {'0x0000000000000004': 10}",
        "   3     1,000  1946-1955 (1950)  630, 634  {'0x0000000000000004': 10}",
    ]

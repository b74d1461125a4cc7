"""``logging.profile_steps``: the PyTorch profiler over a few training steps, to see where a step goes.

For each rank, ``<output_dir>/profile/``: ``rank<r>.txt`` (the operators with the most device time and
the most host time, and how much of the profiled wall time the device was busy: well under 100% means
the step waits on the host) and ``rank<r>.trace.json.gz`` (a Chrome/Perfetto trace).

Recording the host's operators slows the host several times over, and a step that waits on the host waits
longer under the profiler: Qwen3-30B-A3B's step on one H200 ran 421 ms with the device busy 65% of it, against
310 ms and 89% with its kernels recorded alone (``logging.profile_host: false``), about the 308 ms of an
unprofiled step. The second is the one to read for where a real step's device waits
(``benchmarks/device_gaps.py``); the first says what the host was doing then.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("shardtune")

TABLE_ROWS = 30


class StepProfiler:
    """Profiles steps ``first``..``last`` (inclusive) of this rank; a no-op when ``steps`` is None."""

    def __init__(
        self, steps: tuple[int, int] | None, output_dir: Path, rank: int, device: torch.device, host: bool = True
    ):
        self.first, self.last = steps if steps else (0, -1)
        self.activities = profiled_activities(device, host)
        self.output_dir = output_dir / "profile"
        self.rank = rank
        self.device = device
        self.profiler: profile | None = None
        self.started = 0.0
        self.collections = CollectionTimes()

    def step_begins(self, step: int) -> None:
        if step != self.first:
            return
        self.profiler = profile(activities=self.activities, record_shapes=False)
        self.profiler.__enter__()
        self.collections.start()
        self.started = time.perf_counter()

    def step_ends(self, step: int) -> None:
        if self.profiler is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        self.collections.stop()
        self.profiler.__exit__(None, None, None)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        events = self.profiler.key_averages()
        steps = self.last - self.first + 1
        lines = [f"steps {self.first}..{self.last}: {wall:.3f} s wall, {wall / steps * 1e3:.1f} ms per step"]
        lines.append(self.collections.describe())
        if self.device.type == "cuda":
            # Kernels only: an operator's device time is that of the kernels it launched (counted once).
            device_us = sum(
                event.self_device_time_total for event in events if event.device_type == torch.autograd.DeviceType.CUDA
            )
            lines.append(f"device busy (sum of kernel times): {device_us / 1e6:.3f} s = {device_us / 1e6 / wall:.0%}")
            lines += ["", "by device time:", events.table(sort_by="self_cuda_time_total", row_limit=TABLE_ROWS)]
        if ProfilerActivity.CPU in self.activities:
            lines += ["", "by host time:", events.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
        report = self.output_dir / f"rank{self.rank}.txt"
        report.write_text("\n".join(lines) + "\n")
        self.profiler.export_chrome_trace(str(self.output_dir / f"rank{self.rank}.trace.json.gz"))
        self.profiler = None
        log.info("profile of steps %d..%d: %s", self.first, self.last, report)


def profiled_activities(device: torch.device, host: bool) -> list[ProfilerActivity]:
    """What the profiler records on ``device``: the device's kernels on GPUs, and the host's operators unless
    ``host`` is false there (on a CPU the operators are the work itself)."""
    if device.type != "cuda":
        return [ProfilerActivity.CPU]
    return ([ProfilerActivity.CPU] if host else []) + [ProfilerActivity.CUDA]


class CollectionTimes:
    """Python's garbage collections between ``start()`` and ``stop()``: how many, of which generation, and the
    host time they took (a collection inside a step's launches can leave the device idle)."""

    def __init__(self):
        self.times: dict[int, list[float]] = {}
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.times.setdefault(info["generation"], []).append(time.perf_counter() - self._began)

    def start(self) -> None:
        self.times = {}
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def describe(self) -> str:
        if not self.times:
            return "python gc: no collection"
        parts = [
            f"generation {generation}: {len(times)} ({sum(times) * 1e3:.1f} ms, longest {max(times) * 1e3:.2f} ms)"
            for generation, times in sorted(self.times.items())
        ]
        return "python gc: " + ", ".join(parts)

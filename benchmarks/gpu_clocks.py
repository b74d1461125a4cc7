"""Each training step's GPU clock and power, from nvidia-smi samples taken while the run trained: whether a step
ran slower because the GPU lowered its clock (its power cap, heat) rather than because of the code.

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader \\
        -lms 100 > clocks.csv &
    shardtune bench ... ; kill %1
    python benchmarks/gpu_clocks.py RUN/shardtune clocks.csv

A step's wall-clock interval is placed from the run's ``train_log.jsonl``: the last row was written when the file
was last modified, and each row's ``elapsed_s`` and step time place the others (to within the logging's few
milliseconds). The reasons are nvidia-smi's bit mask of what holds the clock down (0x4: the software power cap,
0x8: a hardware slowdown, 0x20 / 0x40: software / hardware thermal slowdown, 0x80: the power brake).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import statistics
import sys
from pathlib import Path


def samples(path: Path) -> list[tuple[float, float, float, str]]:
    """(time, SM MHz, W, reasons) of each well-formed line of the nvidia-smi CSV."""
    rows = []
    for line in path.read_text().splitlines():
        fields = [field.strip() for field in line.split(",")]
        try:
            at = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((at, float(fields[1].split()[0]), float(fields[2].split()[0]), fields[3]))
        except (ValueError, IndexError):
            continue  # a header, or a line cut short when the sampler was stopped
    return rows


def main(run_dir: str, csv: str) -> None:
    log = Path(run_dir) / "logs" / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    written, last = os.path.getmtime(log), rows[-1]["elapsed_s"]
    sampled = samples(Path(csv))
    print("step  tokens/s  SM MHz min-max (median)  power W (median, max)  reasons (samples)")
    for row in rows:
        ended = written - (last - row["elapsed_s"])
        began = ended - row["tokens"] / row["tokens_per_s"]
        inside = [sample for sample in sampled if began <= sample[0] <= ended]
        if not inside:
            print(f"{row['step']:4d} {row['tokens_per_s']:9,.0f}  (no sample)")
            continue
        clocks, power = [sample[1] for sample in inside], [sample[2] for sample in inside]
        reasons = dict(collections.Counter(sample[3] for sample in inside))
        print(
            f"{row['step']:4d} {row['tokens_per_s']:9,.0f}  {min(clocks):.0f}-{max(clocks):.0f} "
            f"({statistics.median(clocks):.0f})  {statistics.median(power):.0f}, {max(power):.0f}  {reasons}"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

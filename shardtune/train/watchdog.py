"""The hang watchdog: a rank that makes no progress for ``training.hang_timeout_s`` explains and exits.

Without it, a rank stuck in a collective waits for the collective timeout (30 minutes by default) and
then dies with a message that names neither the rank that is behind nor where it is. Here a thread
on every rank watches its own heartbeat. When it has not moved for the timeout (a hang stalls every
rank: one is stuck, the others wait for it in a collective), each rank writes into ``RUN_DIR/hang/``:

- ``rank-<r>.txt``: the Python stack of every thread of this process;
- ``rank-<r>.flight_recorder.json``: PyTorch's flight recorder, the last collectives this rank
  enqueued and completed per process group (recorded when ``TORCH_FR_BUFFER_SIZE`` is set before the
  process group starts, which ``enable_flight_recorder`` does);
- ``rank-<r>.json``: step, phase, where its main thread is, how many collectives it entered.

It then waits (briefly) for the other ranks' reports; the first rank done writes ``summary.txt`` and
prints it: which ranks are behind (they entered fewer collectives than the others, which wait for
them in the next one; without a flight recorder, the ranks at the lowest step) and where each rank is.
Every rank then exits with ``HANG_EXIT_CODE``, which ends the job instead of letting it hang.

A process stuck while holding the GIL stops the watchdog thread too; the C-level ``faulthandler``
timer then still dumps its stack to stderr and ends it, a few seconds later.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from shardtune.atomic import write_atomic
from shardtune.train.heartbeat import Heartbeat

log = logging.getLogger("shardtune")

HANG_EXIT_CODE = 124  # as timeout(1): the run was ended for taking too long
HANG_DIR = "hang"
FLIGHT_RECORDER_ENTRIES = "2000"
# Set once this process's watchdog has begun to report a hang, after which it ends the process itself.
_reporting_a_hang = threading.Event()
_LONGEST_REPORT_S = 60.0  # the longest a report can take: gather_s is at most 30 s


def wait_for_the_hang_report() -> bool:
    """Whether this process's watchdog is reporting a hang; if so, wait for it to end the process. A rank's peer
    exits as the report ends, so this rank's collective fails while its own report is still being written: the
    report and its exit status are what the run ends with, not the failed collective."""
    if not _reporting_a_hang.is_set():
        return False
    time.sleep(_LONGEST_REPORT_S)  # the watchdog's os._exit ends the process long before
    return True


def enable_flight_recorder() -> None:
    """Record every collective of the process groups created after this (a ring buffer per group)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def flight_recorder_dump() -> dict[str, Any] | None:
    """This process's flight recorder as a dict, or None where this torch or backend has none."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
        return json.loads(raw)
    except Exception:  # an optional, private API: its absence must never hide the diagnosis
        return None


def collectives_entered(dump: dict[str, Any] | None) -> dict[str, Any] | None:
    """The default process group's counters from a flight recorder dump: collectives entered
    (enqueued) and completed, and the last one's name."""
    if not dump:
        return None
    status = (dump.get("pg_status") or {}).get("0")
    if status is None:
        return None
    entries = [entry for entry in dump.get("entries", []) if str(entry.get("pg_id")) == "0"]
    last = max(entries, key=lambda entry: entry.get("collective_seq_id", 0), default=None)
    return {
        "entered": int(status.get("last_enqueued_collective", -1)),
        "completed": int(status.get("last_completed_collective", -1)),
        "last": last.get("profiling_name") if last else None,
    }


def main_thread_location() -> dict[str, str]:
    """Where the main thread is: its innermost frame, and the innermost frames of shardtune's own code."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return {"innermost": "?", "shardtune": "?"}
    stack = traceback.extract_stack(frame)

    def describe(entry: traceback.FrameSummary) -> str:
        return f"{entry.name} ({_short_path(entry.filename)}:{entry.lineno})"

    own = [entry for entry in stack if f"{os.sep}shardtune{os.sep}" in entry.filename]
    return {"innermost": describe(stack[-1]), "shardtune": " < ".join(map(describe, own[::-1][:3])) or "-"}


def _short_path(filename: str) -> str:
    for marker in (f"{os.sep}shardtune{os.sep}", f"{os.sep}torch{os.sep}", f"{os.sep}site-packages{os.sep}"):
        if marker in filename:
            return marker.strip(os.sep) + os.sep + filename.split(marker, 1)[1]
    return filename


def find_behind(reports: dict[int, dict[str, Any]], world_size: int) -> tuple[list[int], str]:
    """The ranks holding the others up, and why: fewest collectives entered (the others wait for them
    in the next one); without flight recorder counts, the lowest step. Ranks without a report are named
    too: their watchdog did not run (a process stuck holding the GIL, or gone)."""
    missing = [rank for rank in range(world_size) if rank not in reports]
    counted = {rank: report["collectives"]["entered"] for rank, report in reports.items() if report.get("collectives")}
    if counted and len(counted) == len(reports) and len(set(counted.values())) > 1:
        fewest = min(counted.values())
        behind = [rank for rank, entered in counted.items() if entered == fewest]
        waiting = [rank for rank in counted if rank not in behind]
        names = {reports[rank]["collectives"]["last"] for rank in waiting}
        why = (
            f"entered {fewest} collective(s); rank(s) {_ranks(waiting)} entered {max(counted.values())} "
            f"and wait in {', '.join(sorted(filter(None, names))) or 'a collective'} for them"
        )
        return sorted(set(behind) | set(missing)), why
    steps = {rank: report["step"] for rank, report in reports.items()}
    if steps and len(set(steps.values())) > 1:
        lowest = min(steps.values())
        behind = [rank for rank, step in steps.items() if step == lowest]
        return sorted(set(behind) | set(missing)), f"at step {lowest} while others are at step {max(steps.values())}"
    if missing:
        return missing, "wrote no report: stuck holding the GIL, gone, or on another node's storage"
    return [], "every rank is at the same step and collective: a collective that does not finish (network?)"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def summarize(reports: dict[int, dict[str, Any]], world_size: int, timeout_s: float, hang_dir: Path) -> str:
    behind, why = find_behind(reports, world_size)
    lines = [
        f"shardtune: hang: no progress for {timeout_s:g} s (training.hang_timeout_s). "
        + (f"Behind: rank(s) {_ranks(behind)}: {why}." if behind else f"No rank is behind: {why}.")
    ]
    now = time.time()
    for rank in range(world_size):
        report = reports.get(rank)
        if report is None:
            lines.append(f"  rank {rank}: no report")
            continue
        collectives = report.get("collectives")
        counted = (
            f"collectives entered {collectives['entered']}, completed {collectives['completed']} "
            f"(last {collectives['last']})"
            if collectives
            else "no flight recorder"
        )
        lines.append(
            f"  rank {rank} ({report['host']}, pid {report['pid']}){' BEHIND' if rank in behind else ''}: step "
            f"{report['step']}, phase {report['phase']} for {now - report['since']:.0f} s; {counted}; in "
            f"{report['where']['innermost']}, from {report['where']['shardtune']}"
        )
    lines.append(f"  stacks, flight recorder dumps and reports: {hang_dir}/rank-<r>.txt, .flight_recorder.json, .json")
    return "\n".join(lines)


class HangWatchdog:
    """Watches one rank's heartbeat from a daemon thread; see the module docstring."""

    def __init__(self, heartbeat: Heartbeat, run_dir: Path, world_size: int, timeout_s: float):
        self.heartbeat, self.run_dir, self.world_size, self.timeout_s = heartbeat, run_dir, world_size, timeout_s
        self.hang_dir = run_dir / HANG_DIR
        # Also how often the heartbeat file is brought up to date; timeout 0: only that, no watching.
        self.poll_s = min(5.0, max(0.2, timeout_s / 10)) if timeout_s > 0 else 1.0
        # After detecting, how long to wait for the other ranks' reports before summarizing without them.
        self.gather_s = min(30.0, max(5.0, timeout_s / 2))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardtune-hang-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        self.heartbeat.flush()

    def _watch(self) -> None:
        seen, last_change = self.heartbeat.beats, time.monotonic()
        if self.timeout_s > 0:
            self._arm_backstop()
        while not self._stop.wait(self.poll_s):
            self.heartbeat.flush()
            if self.timeout_s <= 0:
                continue
            if self.heartbeat.beats != seen:
                seen, last_change = self.heartbeat.beats, time.monotonic()
                self._arm_backstop()
            elif time.monotonic() - last_change >= self.timeout_s:
                self._diagnose_and_exit()

    def _arm_backstop(self) -> None:
        # Runs in C, without the GIL: it fires even when this thread cannot, and then ends the process.
        faulthandler.dump_traceback_later(self.timeout_s + self.gather_s + 2 * self.poll_s + 10, exit=True)

    def _diagnose_and_exit(self) -> None:
        _reporting_a_hang.set()
        rank = self.heartbeat.rank
        try:
            self._diagnose(rank)
        except FileExistsError:
            pass  # another rank wrote the summary
        except Exception:  # the exit below must happen whatever went wrong in the diagnosis
            traceback.print_exc()
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _diagnose(self, rank: int) -> None:
        self.heartbeat.flush()
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        with open(self.hang_dir / f"rank-{rank}.txt", "w") as stacks:
            faulthandler.dump_traceback(file=stacks, all_threads=True)
        dump = flight_recorder_dump()
        if dump is not None:
            (self.hang_dir / f"rank-{rank}.flight_recorder.json").write_text(json.dumps(dump, indent=1))
        report = {
            **self.heartbeat.record(),
            "where": main_thread_location(),
            "collectives": collectives_entered(dump),
        }
        # Last: its presence marks this rank's report complete.
        write_atomic(self.hang_dir / f"rank-{rank}.json", json.dumps(report, indent=2) + "\n")
        print(
            f"shardtune: hang: rank {rank}: no progress for {self.timeout_s:g} s at step {report['step']}, "
            f"phase {report['phase']}, in {report['where']['innermost']}; stack in {self.hang_dir}",
            file=sys.stderr,
            flush=True,
        )
        reports = self._gather_reports()
        # One rank (the first to get here) writes and prints the summary.
        fd = os.open(self.hang_dir / "summary.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        summary = summarize(reports, self.world_size, self.timeout_s, self.hang_dir)
        with os.fdopen(fd, "w") as handle:
            handle.write(summary + "\n")
        print(summary, file=sys.stderr, flush=True)

    def _gather_reports(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + self.gather_s
        while True:
            reports = {}
            for path in self.hang_dir.glob("rank-[0-9]*.json"):
                if not path.name.removeprefix("rank-").removesuffix(".json").isdigit():
                    continue  # a flight recorder dump
                with contextlib.suppress(OSError, ValueError, KeyError):
                    report = json.loads(path.read_text())
                    reports[int(report["rank"])] = report
            if len(reports) >= self.world_size or time.monotonic() > deadline:
                return reports
            time.sleep(0.2)


def start_heartbeat(
    run_dir: Path, rank: int, world_size: int, hang_timeout_s: float, interval_s: float
) -> tuple[Heartbeat, HangWatchdog]:
    """This rank's heartbeat (its file rewritten at most every ``interval_s``), and its watchdog
    (with ``hang_timeout_s`` 0, it only keeps the file up to date); close the watchdog when done."""
    previous = run_dir / HANG_DIR
    if rank == 0 and previous.is_dir():
        # An earlier attempt's diagnosis is kept for the user, out of the way of this attempt's.
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(previous.stat().st_mtime))
        with contextlib.suppress(OSError):
            os.replace(previous, run_dir / f"{HANG_DIR}-{stamp}")
    heartbeat = Heartbeat(run_dir, rank, interval_s)
    return heartbeat, HangWatchdog(heartbeat, run_dir, world_size, hang_timeout_s)

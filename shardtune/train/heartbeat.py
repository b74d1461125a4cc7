"""Each rank's heartbeat: where it is (step, phase) and since when, in ``RUN_DIR/heartbeat/rank-<r>.json``.

The training loop calls ``beat(step, phase)`` at every phase boundary of a step (a handful per step).
The beat itself only updates memory, which the hang watchdog (``watchdog.py``) watches. The file, for a
person (or ``cat``) to see where each rank is, is rewritten at most every
``training.heartbeat_interval_s`` by the beat, and brought up to date by the watchdog thread's polls;
on a shared filesystem, thousands of ranks rewriting a file at every phase would load its metadata
server for nothing. It is written under a temporary name and renamed: never seen half-written. Every
phase boundary is also a fault-injection point (``shardtune.faults``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from shardtune.atomic import write_atomic
from shardtune.faults import fault_point

log = logging.getLogger("shardtune")

HEARTBEAT_DIR = "heartbeat"


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, interval_s: float = 1.0):
        self.directory = run_dir / HEARTBEAT_DIR
        self.rank = rank
        self.path = self.directory / f"rank-{rank}.json"
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self.phase, self.since = 0, "setup", time.time()
        self.beats = 0  # bumped on every beat: what the watchdog watches
        self.interval_s = interval_s
        self._written_beats, self._written_at = -1, 0.0
        self._lock = threading.Lock()  # the main thread beats, the watchdog thread flushes
        self._write_failed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flush()

    def beat(self, step: int, phase: str) -> None:
        """This rank enters ``phase`` of ``step``."""
        self.step, self.phase, self.since = step, phase, time.time()
        self.beats += 1
        if time.monotonic() - self._written_at >= self.interval_s:
            self.flush()
        fault_point(phase, step)

    def record(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "step": self.step,
            "phase": self.phase,
            "since": self.since,
            "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
        }

    def flush(self) -> None:
        """Rewrite the file if it is behind the last beat."""
        with self._lock:
            if self._written_beats == self.beats:
                return
            beats, record = self.beats, self.record()
            self._written_beats, self._written_at = beats, time.monotonic()
            try:
                write_atomic(self.path, json.dumps(record) + "\n")
            except OSError as error:
                # A full disk must fail the checkpoint that needs the space, not the bookkeeping beside it.
                if not self._write_failed:
                    log.warning("heartbeat: cannot write %s (%s); the hang watchdog keeps running", self.path, error)
                self._write_failed = True

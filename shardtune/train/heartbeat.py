"""Each rank's heartbeat: where it is (step, phase) and since when, in ``RUN_DIR/heartbeat/rank-<r>.json``.

The training loop calls ``beat(step, phase)`` at every phase boundary of a step (a handful per step,
each a small file written under a temporary name and renamed: never seen half-written). The file tells
a person (or ``tail``) where each rank is; the hang watchdog (``watchdog.py``) reads the in-memory copy
to notice when this rank stopped moving, and every rank's file to say who is behind. Every phase
boundary is also a fault-injection point (``shardtune.faults``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from shardtune.faults import fault_point

log = logging.getLogger("shardtune")

HEARTBEAT_DIR = "heartbeat"


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int):
        self.directory = run_dir / HEARTBEAT_DIR
        self.rank = rank
        self.path = self.directory / f"rank-{rank}.json"
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self.phase, self.since = 0, "setup", time.time()
        self.beats = 0  # bumped on every beat: what the watchdog watches
        self._write_failed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write()

    def beat(self, step: int, phase: str) -> None:
        """This rank enters ``phase`` of ``step``."""
        self.step, self.phase, self.since = step, phase, time.time()
        self.beats += 1
        self._write()
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

    def _write(self) -> None:
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            temporary.write_text(json.dumps(self.record()) + "\n", encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError as error:
            # A full disk must fail the checkpoint that needs the space, not the bookkeeping beside it.
            if not self._write_failed:
                log.warning("heartbeat: cannot write %s (%s); the hang watchdog keeps running", self.path, error)
            self._write_failed = True

"""Each rank's heartbeat: where it is (step, phase) and since when, in ``RUN_DIR/heartbeat/rank-<r>.json``.

The training loop calls ``beat(step, phase)`` at every phase boundary of a step (a handful per step),
``progress()`` after every evaluation batch, and runs checkpoint saves and the final save inside
``saving(...)``, where a ticker thread beats while the save makes progress (see ``SaveTicker``).
The beat itself only updates memory, which the hang watchdog (``watchdog.py``) watches. The file, for a
person (or ``cat``) to see where each rank is, is rewritten at most every
``training.heartbeat_interval_s`` by the beat, and brought up to date by the watchdog thread's polls;
on a shared filesystem, thousands of ranks rewriting a file at every phase would load its metadata
server for nothing. It is written under a temporary name and renamed: never seen half-written. Every
phase boundary is also a fault-injection point (``shardtune.faults``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

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

    def progress(self, point: str | None = None) -> None:
        """Progress inside the current phase (an evaluation batch done, bytes of a save written): the
        watchdog sees the heartbeat move; the phase and its start stay. ``point``: a fault-injection
        point passed here."""
        self.beats += 1
        if point is not None:
            fault_point(point, self.step)

    @contextlib.contextmanager
    def saving(self, step: int, phase: str, store: Store, run_dir: Path, poll_s: float) -> Iterator[None]:
        """Enter ``phase`` of ``step``, a save, with a ``SaveTicker`` beating while any rank's save writes."""
        self.beat(step, phase)
        ticker = SaveTicker(self, store, f"shardtune/save-progress/{phase}/{step}", run_dir, poll_s)
        try:
            yield
        finally:
            ticker.stop()

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


class Store(Protocol):
    """The part of a torch.distributed store (the rendezvous key-value store) the ticker uses."""

    def add(self, key: str, value: int) -> int: ...


def save_bytes(run_dir: Path) -> tuple[int, int]:
    """(files, bytes) in the run directory's temporary save directories: every save (a checkpoint's
    ``.checkpoint-<step>.tmp``, ``final/``'s ``.final.tmp-<pid>``) writes there before its commit renames it."""
    files = size = 0
    for directory in run_dir.glob(".*.tmp*"):
        if not directory.is_dir():
            continue
        for root, _, names in os.walk(directory):
            for name in names:
                with contextlib.suppress(OSError):  # a file renamed or removed meanwhile
                    size += os.stat(os.path.join(root, name)).st_size
                    files += 1
    return files, size


class SaveTicker:
    """Beats this rank's heartbeat while a save makes progress on any rank.

    A save can take longer than ``training.hang_timeout_s`` and still be healthy: writing a large model
    to a slow filesystem, while the other ranks wait in a collective for the writer. Progress is what
    the writers' storage shows: the files and bytes in the run directory's temporary save directories.
    Every ``poll_s`` each rank looks at its view of them; a rank that sees a change counts it in the
    rendezvous store, and every rank whose count moved beats. So all ranks beat while any rank's save
    writes (also with node-local storage, where each node sees only its own files), and none beats while
    no save writes: a save stuck in a dead mount or a collective still trips the watchdog.
    """

    def __init__(self, heartbeat: Heartbeat, store: Store, key: str, run_dir: Path, poll_s: float):
        self.heartbeat, self.store, self.key, self.run_dir, self.poll_s = heartbeat, store, key, run_dir, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="shardtune-save-ticker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _tick(self) -> None:
        seen, counted = save_bytes(self.run_dir), 0
        while not self._stop.wait(self.poll_s):
            try:
                now = save_bytes(self.run_dir)
                total = self.store.add(self.key, 1 if now != seen else 0)
            except Exception:  # the store is gone (the run is ending): no beat, and no error of its own
                return
            if total != counted:
                self.heartbeat.progress()
            seen, counted = now, total

"""One run at a time in a run directory: global rank 0 holds an exclusive lock on ``<output_dir>/.shardtune.lock``
from before it removes or writes anything there until its run ends; on node-local storage, so does the lowest
rank of every other node on its own disk's copy (``run_dir.claim_output_dir``).

Two runs in one directory at once (a job submitted twice, a second ``train ... resume_from_checkpoint=auto``
while the first still runs) would resume from the same checkpoint and write the same ``checkpoint-<step>``
names, mixing their shards, and with ``overwrite_output_dir`` the second would delete what the first is writing.
The lock is the file system's (``flock``): it goes with the process that held it however that process ends (a
kill, a crash, a preempted job), so a restarted or requeued run takes it at once, and no stale lock ever needs
clearing by hand. Where the file system has no locks, the run goes on with one warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from shardtune.errors import ConfigError

log = logging.getLogger("shardtune")

LOCK_NAME = ".shardtune.lock"
# How long a run waits for the lock before it gives up: a run before it in the directory that is ending (a
# restart's or requeue's predecessor still exiting) lets go within seconds; one still training does not.
WAIT_S = 5.0


class RunLock:
    def __init__(self, handle: IO[str], path: Path):
        self._handle = handle
        self._path = path

    @classmethod
    def take(cls, output_dir: Path, wait_s: float = WAIT_S) -> RunLock | None:
        """The lock of ``output_dir`` (created if need be), or None where its file system has no locks; a
        ``ConfigError`` naming the run that holds it when that run keeps it for ``wait_s`` seconds."""
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / LOCK_NAME
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the lock's life)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = _describe(handle.read())
                handle.close()
                if time.monotonic() >= deadline:
                    raise ConfigError(in_use_line(output_dir, holder)) from None
                if not waiting:
                    log.info("%s is in use by another run (%s); waiting up to %.0f s for it to end", output_dir,
                             holder, wait_s)  # fmt: skip
                    waiting = True
                time.sleep(0.2)
                continue
            except OSError as error:  # ENOLCK, EOPNOTSUPP: a file system without locks (some network mounts)
                handle.close()
                log.warning(
                    "%s: no file locks on this file system (%s): nothing keeps a second run from writing into it at "
                    "the same time",
                    output_dir,
                    error.strerror or error,
                )
                return None
            # The run before may have removed the file between this open and this lock: then the lock is on a
            # file no other run can see. Take the one that is there.
            if not _same_file(handle, path):
                handle.close()
                continue
            handle.seek(0)
            handle.truncate()
            started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}))
            handle.flush()
            return cls(handle, path)

    def release(self) -> None:
        """Remove the lock file, then let go of it: a run waiting on this file finds it gone and takes a new one."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        self._handle.close()


def current_holder(output_dir: Path) -> str | None:
    """Who holds ``output_dir``'s lock now (for ``shardtune doctor``), or None: no run, or no file locks there."""
    try:
        handle = open(output_dir / LOCK_NAME, encoding="utf-8")  # noqa: SIM115
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go of again as the file closes
        except BlockingIOError:
            return _describe(handle.read())
        except OSError:
            return None
    return None


def in_use_line(output_dir: Path, holder: str) -> str:
    return (
        f"training.output_dir: {output_dir} is in use by another run ({holder}); wait for it to end, or choose "
        "another output_dir"
    )


def _same_file(handle: IO[str], path: Path) -> bool:
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _describe(text: str) -> str:
    """Who holds the lock, from what it wrote into the file (nothing yet, in the moment after it took it)."""
    try:
        holder = json.loads(text)
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (ValueError, TypeError, KeyError):
        return "starting"

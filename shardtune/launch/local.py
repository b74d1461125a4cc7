"""Whether this process is a worker, or the command a user typed (which may start workers)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def running_as_worker() -> bool:
    """Started by torchrun, by our own launcher, or as one task of a multi-task srun."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def exit_worker(code: int) -> NoReturn:
    """End a worker whose work is done and whose process group is destroyed, without the interpreter's
    finalization.

    Why: the collective backends keep C++ threads and static objects alive until the process ends. When
    one of them releases a tensor (and so takes the GIL) while Python is finalizing, CPython ends that
    thread with a forced unwind that C++ turns into std::terminate: a rare "terminate called without an
    active exception" and SIGABRT after a run that succeeded, which the launcher reports as a failed
    worker (and would restart). Everything the run writes is closed by the time this is called; only the
    standard streams and logging handlers still need flushing.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)

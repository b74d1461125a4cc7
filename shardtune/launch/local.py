"""Whether this process is a worker, or the command a user typed (which may start workers)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from shardtune.distributed.env import DistributedEnv

# Set by our launcher for its workers: a directory where the first worker to report an error claims it,
# so that N workers stopped by the same input print its line once, not N times.
REPORTED_ERRORS_VARIABLE = "SHARDTUNE_REPORTED_ERRORS"
# Set by our launcher for its workers: its process id (see end_with_the_launcher).
LAUNCHER_PID_VARIABLE = "SHARDTUNE_LAUNCHER_PID"
# prctl(2)'s option: the signal the kernel sends this process when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


def running_as_worker() -> bool:
    """Started by torchrun, by our own launcher, or as one task of a multi-task srun."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def end_with_the_launcher() -> None:
    """Have the kernel send this worker SIGTERM when our launcher dies, as Ctrl-C or a SIGTERM to the launcher
    would reach it: it stops at a step boundary, with a checkpoint where ``training.save_steps`` is set.

    Why: torch's agent starts each worker in a session of its own, so a launcher killed outright (SIGKILL, the
    kernel's out-of-memory killer) passes nothing on, and its workers, orphaned, train on and hold their GPUs
    until the collective timeout or for good. Linux only (prctl); elsewhere, and under torchrun or srun,
    nothing changes."""
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != int(launcher):  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


def exit_without_finalization(code: int, *, worker: bool) -> NoReturn:
    """End the process (``shardtune.entry.main`` does, whatever its command returned) without the interpreter's
    finalization; a worker's process group ends with the process (``close_unless_worker``).

    Why, for a worker: the collective backends keep C++ threads and static objects alive until the process
    ends. When one of them releases a tensor (and so takes the GIL) while Python is finalizing, CPython ends
    that thread with a forced unwind that C++ turns into std::terminate: a rare "terminate called without an
    active exception" and SIGABRT after a run that succeeded, which the launcher reports as a failed worker
    (and would restart). A worker does not wait for its threads either: one stopped by a peer's failure may
    have a thread blocked in a collective that will never complete.

    Why, for the command a user typed: finalization tears torch's and transformers' modules down object by
    object, about 2 s a command on a CPU, and writes nothing. What it would run first still runs: the
    threads the process must wait for, then the atexit handlers (wandb's, inductor's compile workers').

    Everything a command writes is closed by the time this is called; only the standard streams and
    logging handlers still need flushing.
    """
    if not worker:
        # What Py_FinalizeEx runs before tearing down: threading's own exit hooks (a ThreadPoolExecutor's
        # workers are told to stop there; a bare join of them waits forever), the wait for every non-daemon
        # thread, then the atexit handlers. threading._shutdown is that first step's only entry point.
        threading._shutdown()
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def close_unless_worker(env: DistributedEnv) -> None:
    """Destroy ``env``'s process group where the process goes on after the command; a worker's process group
    ends with its process (``exit_without_finalization``).

    Why: destroying it drops the process group's last reference but one, often a DDP reducer's, and freeing
    that later (the stopped run's frames go when its error has been reported) runs the backend's destructor in
    the main thread, which holds the GIL while it joins the backend's threads. One of them may still be
    finishing an all-reduce whose tensor Python also holds, and waits for the GIL to release it (py-spy showed
    both threads): a deadlock, seen on a loaded CPU as a rank that ran out of memory, printed its line and never
    exited, while its peer waited in a collective with it until the hang watchdog restarted the run."""
    if not running_as_worker():
        env.close()


def say_once(lines: list[str], every_rank_says_it: bool = False) -> None:
    """Write ``lines`` (an error, or how a run stopped) to stderr once per launch, not once per worker.

    ``every_rank_says_it``: the ranks agreed on the words first (a run fault, a stop): global rank 0
    alone writes them, under any launcher. Otherwise (input errors, which a rank may meet alone) the
    first worker of our launcher to claim the message (an exclusive create of a file named by its hash)
    writes it and the others stay silent; a message no other worker claimed is still written. Workers
    started by torchrun or srun have no shared directory: each writes its own.
    """
    if every_rank_says_it:
        if os.environ.get("RANK", "0") != "0":
            return
    elif (directory := os.environ.get(REPORTED_ERRORS_VARIABLE)) and running_as_worker():
        attempt = os.environ.get("SHARDTUNE_RESTART_COUNT", "0")
        digest = hashlib.sha256("\n".join([attempt, *lines]).encode()).hexdigest()[:32]
        try:
            os.close(os.open(Path(directory) / digest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        except OSError:
            pass  # the directory is gone: better twice than never
    # One write per line: stderr to a pipe is unbuffered, print() writes text and newline apart, and the
    # ranks of a launch share the pipe, so their lines could otherwise end up glued together.
    for line in lines:
        sys.stderr.write(line + "\n")


def check_worker_count(nproc: int, option: str) -> str | None:
    """Raise an ``InputError`` for a worker count no machine can run (below 1, or more workers than visible
    GPUs: each worker drives the GPU of its local rank); return a warning when CPU workers outnumber the
    cores (they would only take turns), else None."""
    import torch

    from shardtune.errors import InputError

    if nproc < 1:
        raise InputError(f"{option}: must be at least 1, got {nproc}")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise InputError(
                f"{option}: {nproc} workers but {gpus} GPU(s) visible: each worker needs a GPU of its own; "
                f"start at most {gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
            )
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores:
        return f"{option}: {nproc} workers on {cores} CPU core(s): they will take turns, and the run will be slower"
    return None

"""Stop cleanly when asked: by the cluster (SIGTERM, SIGUSR1) or by the user (Ctrl-C, SIGINT).

Inside the step loop a signal on any rank -> every rank stops at the same step boundary -> a full
checkpoint is committed (for SIGINT only where ``training.save_steps`` is set) -> global rank 0 prints
one line saying where it is and the exact command that resumes from it -> the process exits with
``PREEMPTED_EXIT_CODE`` (SIGTERM, SIGUSR1: the sbatch script turns it into a requeue, and
``resume_from_checkpoint: auto`` picks the checkpoint up) or ``EXIT_INTERRUPTED`` (SIGINT).

A signal handler may run between any two bytecodes, so inside the loop it only records the request;
at each step boundary every rank sends what it has in a one-integer all-reduce on the CPU backend
(no GPU synchronization) and reads the answer at the next boundary, when it has long arrived: no rank
waits for the others at every step, and all ranks still stop after the same step together. Outside the loop (setup,
the final evaluation and save) Ctrl-C interrupts at once, as ``KeyboardInterrupt``; the command line
then prints one line, also without a traceback, and exits with ``EXIT_INTERRUPTED``.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from shardtune.errors import EXIT_INTERRUPTED

if TYPE_CHECKING:
    from shardtune.distributed.env import DistributedEnv

log = logging.getLogger("shardtune")

# EX_TEMPFAIL: "try again later", which is what a preempted run asks for.
PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What the step loop defers to its next boundary. Ranks that got different signals agree on the one
# with the highest priority: a preemption's checkpoint is needed by the requeued job.
STOP_PRIORITY = {signal.SIGINT: 1, signal.SIGUSR1: 2, signal.SIGTERM: 3}
# The command that started the run (the launcher's, for its workers): where the resume line starts.
COMMAND_VARIABLE = "SHARDTUNE_COMMAND"

_interrupted = False  # this process got a SIGINT (wherever it was)


class Preempted(Exception):
    """Raised out of the training loop once the stop is agreed (and its checkpoint committed)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        super().__init__(f"{signal_name}: stopping after step {step}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.signal_name == "SIGINT" else PREEMPTED_EXIT_CODE

    def line(self) -> str:
        """The one line the run ends with: where it stopped, what holds it, how to resume."""
        if self.checkpoint is None:
            return f"shardtune: {self}; nothing saved (Ctrl-C saves a checkpoint only with training.save_steps set)"
        return f"shardtune: {self}; saved {self.checkpoint}; resume with: {resume_command(self.checkpoint)}"


def resume_command(checkpoint: str) -> str:
    """The command that started this run, resuming from ``checkpoint`` instead."""
    words = shlex.split(os.environ.get(COMMAND_VARIABLE) or shlex.join(["shardtune", *sys.argv[1:]]))
    words = [word for word in words if not word.startswith("training.resume_from_checkpoint=")]
    return shlex.join([*words, f"training.resume_from_checkpoint={checkpoint}"])


def catch_interrupts() -> None:
    """From now on this process remembers a SIGINT, which still interrupts at once (outside the step
    loop): an error that follows it (a collective whose peer was interrupted first) is part of the stop."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this process got a SIGINT."""
    return _interrupted


# Ctrl-C outside the step loop.
INTERRUPTED_LINE = (
    "shardtune: SIGINT: stopped outside the training steps (setup, evaluation, final save); nothing saved"
)


class PreemptionWatch:
    """Records SIGTERM, SIGUSR1 and SIGINT during the step loop, and tells every rank at a step
    boundary which one, if any, any rank got."""

    def __init__(self, env: DistributedEnv):
        self.env = env
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._in_flight: tuple[Any, Any] | None = None  # (flag, its all-reduce) sent at the last boundary
        # Handlers can only be installed from the main thread (tests may run the loop elsewhere).
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_PRIORITY:
                self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        global _interrupted
        _interrupted = _interrupted or signum == signal.SIGINT
        name = signal.Signals(signum).name
        if self.signal_name is None or STOP_PRIORITY[signum] > STOP_PRIORITY[signal.Signals[self.signal_name]]:
            self.signal_name = name

    def requested(self) -> str | None:
        """The signal any rank got (the highest priority one), or None: a collective, every rank must
        call it at each step boundary, and all get the same answer. With several ranks the answer is
        the previous boundary's: the all-reduce started here is read at the next one."""
        import torch

        priority = STOP_PRIORITY[signal.Signals[self.signal_name]] if self.signal_name else 0
        flag = torch.tensor([priority], dtype=torch.int32)
        if self.env.world_size > 1:
            sent = self._in_flight
            reduction = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
            self._in_flight = (flag, reduction)
            if sent is None:
                return None
            flag, reduction = sent
            reduction.wait()
        return {value: signum.name for signum, value in STOP_PRIORITY.items()}.get(int(flag.item()))

    def close(self) -> None:
        if self._in_flight is not None:  # every rank started it: it completes
            self._in_flight[1].wait()
            self._in_flight = None
        self.restore_handlers()

    def restore_handlers(self) -> None:
        """The signals' handlers as they were: however the run ended (an error too, when no collective may be
        waited for), a later SIGTERM or SIGINT acts as it did before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

"""Stop cleanly when the cluster asks: SIGTERM or SIGUSR1 on any rank -> every rank stops at the same
step boundary -> a full checkpoint is committed -> the process exits with ``PREEMPTED_EXIT_CODE``,
which the sbatch script turns into a requeue (and ``resume_from_checkpoint: auto`` picks it up).

A signal handler may run between any two bytecodes, so it only records the request; the training
loop asks at each step boundary whether any rank has one (a one-integer all-reduce on the CPU
backend: no GPU synchronization), so all ranks save the same step together.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardtune.distributed.env import DistributedEnv

log = logging.getLogger("shardtune")

# EX_TEMPFAIL: "try again later", which is what a preempted run asks for.
PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised out of the training loop once the preemption checkpoint is committed."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"preempted: stopped after step {step}, checkpoint {checkpoint} committed")
        self.step, self.checkpoint = step, checkpoint


class PreemptionWatch:
    """Records SIGTERM / SIGUSR1 and tells every rank, at a step boundary, whether any rank got one."""

    def __init__(self, env: DistributedEnv):
        self.env = env
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        # Handlers can only be installed from the main thread (tests may run the loop elsewhere).
        if threading.current_thread() is threading.main_thread():
            for signum in PREEMPTION_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any rank has been signalled (a collective: every rank must call it each step)."""
        import torch

        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)
        if self.env.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

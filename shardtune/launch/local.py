"""Whether this process is a worker, or the command a user typed (which may start workers)."""

from __future__ import annotations

import os


def running_as_worker() -> bool:
    """Started by torchrun, by our own launcher, or as one task of a multi-task srun."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1

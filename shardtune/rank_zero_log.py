"""Warnings every rank of a run meets alike (a checkpoint's kind, a kernel this GPU model cannot build) are said
by global rank 0 alone: the other ranks log warnings too (what only they meet), so without this a node of 8
workers printed each such line 8 times. Log them with ``extra=SAID_BY_RANK_ZERO``; ``setup_logging`` installs
the filter. A rank alone in meeting one (a kernel failing on one GPU only) is still seen: it runs slower than its
peers, which the straggler warning names."""

from __future__ import annotations

import logging
import os

SAID_BY_RANK_ZERO = {"said_by_rank_zero": True}


class RankZeroSaysIt(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # The rank is read when the record is made: DistributedEnv sets RANK (from Slurm's task id where srun
        # started the process) after logging is set up.
        return not getattr(record, "said_by_rank_zero", False) or os.environ.get("RANK", "0") == "0"


def install() -> None:
    """The filter on every handler of the root logger, once."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(existing, RankZeroSaysIt) for existing in handler.filters):
            handler.addFilter(RankZeroSaysIt())

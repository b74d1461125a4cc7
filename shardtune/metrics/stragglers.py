"""Per-rank step times: their spread over the ranks, the slowest rank by name, and a warning when the
same rank stays the slowest.

A rank's step time is the time from the start of its step (fetching the batch included) until it has
done its own part of the step (optimizer step included). The ranks then wait for each other at the step
boundary, and that wait is not part of anyone's step time: a rank that is slow at its own work (a slower
device or host, CPU contention, a slow file system) has the longest step time while the others show
how long they would have taken. Waits inside a step's collectives (the gradient reduction) are shared
by every rank and do not single anyone out.

Test hook: ``SHARDTUNE_TEST_SLOW_RANK=RANK:SECONDS`` makes global rank RANK sleep SECONDS at the end of
each of its steps, as a slower rank would be. It is read here, once, by ``injected_step_delay``; tests
use it to check that the slowed rank is the one named.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

SLOW_RANK_ENV = "SHARDTUNE_TEST_SLOW_RANK"

# A rank is a straggler when its step time is this many times the median of the other ranks'...
STRAGGLER_RATIO = 1.2
# ... in this many logging intervals in a row: one slow interval (a checkpoint's page cache flush, a
# garbage collection) is noise, a rank that stays behind is a finding.
STRAGGLER_INTERVALS = 3


def injected_step_delay(rank: int) -> float:
    """Seconds ``rank`` sleeps at the end of every step, from ``SHARDTUNE_TEST_SLOW_RANK`` (0: none)."""
    text = os.environ.get(SLOW_RANK_ENV)
    if not text:
        return 0.0
    slow_rank, sep, seconds = text.partition(":")
    try:
        if not sep:
            raise ValueError
        slow_rank_number, delay = int(slow_rank), float(seconds)
    except ValueError:
        raise ValueError(f"{SLOW_RANK_ENV}={text!r}: expected RANK:SECONDS, e.g. 1:0.5") from None
    return delay if slow_rank_number == rank else 0.0


@dataclass(frozen=True)
class StepTimeSpread:
    """Mean step time per rank over an interval, summarized."""

    min: float
    median: float
    max: float
    slowest_rank: int
    slowest_host: str
    rest_median: float  # median of every other rank (the slowest rank's own time when it is alone)

    @classmethod
    def of(cls, step_times: list[float], hostnames: list[str]) -> StepTimeSpread:
        slowest = max(range(len(step_times)), key=step_times.__getitem__)
        rest = step_times[:slowest] + step_times[slowest + 1 :]
        return cls(
            min=min(step_times),
            median=statistics.median(step_times),
            max=step_times[slowest],
            slowest_rank=slowest,
            slowest_host=hostnames[slowest],
            rest_median=statistics.median(rest) if rest else step_times[slowest],
        )

    @property
    def slowdown(self) -> float:
        """The slowest rank's step time over the median of the others' (1.0 for a single rank)."""
        return self.max / self.rest_median if self.rest_median > 0 else 1.0

    def record(self) -> dict[str, float | int | str]:
        """The train_log.jsonl fields."""
        return {
            "step_time_s_min": self.min,
            "step_time_s_median": self.median,
            "step_time_s_max": self.max,
            "slowest_rank": self.slowest_rank,
            "slowest_host": self.slowest_host,
        }


class StragglerWatch:
    """Warns once when the same rank has been a straggler for ``intervals`` logging intervals in a row
    (and again if it recovers and falls behind once more)."""

    def __init__(self, ratio: float = STRAGGLER_RATIO, intervals: int = STRAGGLER_INTERVALS):
        self.ratio = ratio
        self.intervals = intervals
        self.rank: int | None = None
        self.streak = 0

    def observe(self, spread: StepTimeSpread) -> str | None:
        """The warning to print after this interval, if it completes a streak."""
        if spread.slowdown < self.ratio:
            self.rank, self.streak = None, 0
            return None
        self.streak = self.streak + 1 if spread.slowest_rank == self.rank else 1
        self.rank = spread.slowest_rank
        if self.streak != self.intervals:
            return None
        return (
            f"straggler: rank {spread.slowest_rank} ({spread.slowest_host}) has been the slowest rank for "
            f"{self.intervals} logging intervals in a row: {spread.max:.3f} s per step against a median of "
            f"{spread.rest_median:.3f} s on the other ranks ({spread.slowdown:.1f}x); every rank waits for it "
            "at each step, so check that rank's device, host load and data path"
        )

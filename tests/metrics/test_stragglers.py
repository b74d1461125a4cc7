"""Per-rank step times summarized, the straggler warning's streak rule, and the delay hook's parsing."""

from __future__ import annotations

import pytest

from shardtune.metrics.stragglers import SLOW_RANK_ENV, StepTimeSpread, StragglerWatch, injected_step_delay

HOSTS = ["node0", "node0", "node1", "node1"]


def test_spread_names_the_slowest_rank_and_compares_it_with_the_rest():
    spread = StepTimeSpread.of([1.0, 1.1, 3.0, 0.9], HOSTS)
    assert (spread.min, spread.median, spread.max) == (0.9, 1.05, 3.0)
    assert (spread.slowest_rank, spread.slowest_host) == (2, "node1")
    assert spread.rest_median == 1.0 and spread.slowdown == 3.0
    assert spread.record() == {"step_time_s_min": 0.9, "step_time_s_median": 1.05, "step_time_s_max": 3.0,
                               "slowest_rank": 2, "slowest_host": "node1"}  # fmt: skip
    alone = StepTimeSpread.of([0.5], ["solo"])
    assert alone.slowest_rank == 0 and alone.slowdown == 1.0


def test_the_warning_comes_once_after_three_slow_intervals_of_the_same_rank():
    watch = StragglerWatch()
    slow_2 = StepTimeSpread.of([1.0, 1.0, 1.5, 1.0], HOSTS)
    slow_1 = StepTimeSpread.of([1.0, 1.5, 1.0, 1.0], HOSTS)
    even = StepTimeSpread.of([1.0, 1.1, 1.05, 1.0], HOSTS)  # 1.1x: within the noise
    assert [watch.observe(s) for s in (slow_2, slow_2, slow_1, slow_2, even, slow_2, slow_2)] == [None] * 7
    warning = watch.observe(slow_2)
    assert warning.startswith("straggler: rank 2 (node1) has been the slowest rank for 3 logging intervals")
    assert "1.500 s per step against a median of 1.000 s on the other ranks (1.5x)" in warning
    assert watch.observe(slow_2) is None  # once per streak
    assert watch.observe(even) is None and [watch.observe(slow_2) for _ in range(3)][-1] is not None
    lone = StragglerWatch()
    assert [lone.observe(StepTimeSpread.of([9.0], ["solo"])) for _ in range(5)] == [None] * 5


def test_the_delay_hook(monkeypatch):
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    assert injected_step_delay(0) == 0.0
    monkeypatch.setenv(SLOW_RANK_ENV, "1:0.25")
    assert injected_step_delay(1) == 0.25 and injected_step_delay(0) == 0.0
    for bad in ("1", "x:1", "1:fast"):
        monkeypatch.setenv(SLOW_RANK_ENV, bad)
        with pytest.raises(ValueError, match=f"{SLOW_RANK_ENV}='{bad}': expected RANK:SECONDS"):
            injected_step_delay(0)

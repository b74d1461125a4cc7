"""Hang diagnosis: heartbeats in the run directory, and a watchdog that names the rank that is behind,
dumps every rank's stack and collectives, and ends the job instead of letting it hang."""

from __future__ import annotations

import json

from faulty_runs import run

from shardtune.train.heartbeat import Heartbeat
from shardtune.train.watchdog import HANG_EXIT_CODE, find_behind, summarize


def test_a_rank_asleep_inside_a_step_is_named_with_every_stack_and_the_job_exits(tmp_path):
    out = tmp_path / "run"
    result = run(
        tmp_path, out, 2, "training.max_steps=6", "training.hang_timeout_s=8",
        fault="forward_backward:hang:rank=1:step=3", timeout=240,
    )  # fmt: skip
    assert result.returncode == HANG_EXIT_CODE, result.log[-4000:]
    # 8 s without progress, then the diagnosis: far from the 30-minute collective timeout.
    assert result.seconds < 120
    hang = out / "hang"
    summary = (hang / "summary.txt").read_text()
    assert summary.strip() in result.log
    first = summary.splitlines()[0]
    # Rank 1 never entered the collective that rank 0 waits in (from the flight recorder's counts).
    assert "Behind: rank(s) 1: entered" in first and "rank(s) 0 entered" in first and "gloo:all_reduce" in first
    rank_lines = {int(line.split()[1]): line for line in summary.splitlines() if line.startswith("  rank ")}
    assert "BEHIND" in rank_lines[1] and "BEHIND" not in rank_lines[0]
    assert "step 3, phase forward_backward" in rank_lines[1] and "shardtune/faults.py" in rank_lines[1]
    assert "all_reduce" in rank_lines[0]
    # Every rank's Python stack, flight recorder and report.
    assert "in at" in (hang / "rank-1.txt").read_text() and "run_training" in (hang / "rank-1.txt").read_text()
    assert "all_reduce" in (hang / "rank-0.txt").read_text()
    reports = {rank: json.loads((hang / f"rank-{rank}.json").read_text()) for rank in (0, 1)}
    assert reports[0]["collectives"]["entered"] == reports[1]["collectives"]["entered"] + 1
    recorded = json.loads((hang / "rank-0.flight_recorder.json").read_text())
    assert recorded["entries"][-1]["profiling_name"] == "gloo:all_reduce"
    # The heartbeats say the same: both ranks at step 3, in the forward/backward phase.
    for rank in (0, 1):
        beat = json.loads((out / "heartbeat" / f"rank-{rank}.json").read_text())
        assert (beat["rank"], beat["step"], beat["phase"]) == (rank, 3, "forward_backward")


def test_heartbeat_file_follows_the_phases_at_most_every_interval(tmp_path):
    def written(rank: int) -> tuple:
        beat = json.loads((tmp_path / "heartbeat" / f"rank-{rank}.json").read_text())
        return beat["rank"], beat["step"], beat["phase"]

    every_phase = Heartbeat(tmp_path, rank=3, interval_s=0)
    every_phase.beat(7, "checkpoint")
    assert written(3) == (3, 7, "checkpoint") and every_phase.beats == 1
    throttled = Heartbeat(tmp_path, rank=4, interval_s=3600)
    throttled.beat(7, "forward_backward")
    throttled.beat(7, "optimizer")
    assert written(4) == (4, 0, "setup")  # within the interval: memory only
    throttled.flush()  # what the watchdog thread does at every poll
    assert written(4) == (4, 7, "optimizer")


def report(rank: int, step: int, entered: int | None) -> dict:
    collectives = None if entered is None else {"entered": entered, "completed": entered - 1, "last": "gloo:broadcast"}
    return {
        "rank": rank, "host": "h", "pid": 100 + rank, "step": step, "phase": "optimizer", "since": 0.0,
        "where": {"innermost": "wait (x.py:1)", "shardtune": "-"}, "collectives": collectives,
    }  # fmt: skip


def test_who_is_behind_without_a_flight_recorder_and_with_missing_reports(tmp_path):
    # Counts from the flight recorder decide first.
    assert find_behind({0: report(0, 5, 40), 1: report(1, 5, 40), 2: report(2, 5, 39)}, 3)[0] == [2]
    # Without them, the lowest step; a rank with no report at all is suspect too.
    behind, why = find_behind({0: report(0, 5, None), 1: report(1, 4, None)}, 3)
    assert behind == [1, 2] and "at step 4 while others are at step 5" in why
    assert find_behind({0: report(0, 5, None)}, 2)[0] == [1]
    behind, why = find_behind({0: report(0, 5, 7), 1: report(1, 5, 7)}, 2)
    assert behind == [] and "same step and collective" in why
    text = summarize({0: report(0, 5, 40), 1: report(1, 5, 39)}, 3, 30, tmp_path)
    assert "Behind: rank(s) 1, 2" in text and "  rank 2: no report" in text

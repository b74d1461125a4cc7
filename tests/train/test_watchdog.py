"""Hang diagnosis: heartbeats in the run directory, and a watchdog that names the rank that is behind,
dumps every rank's stack and collectives, and ends the job instead of letting it hang."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from faulty_runs import run

from shardtune.train.heartbeat import Heartbeat
from shardtune.train.watchdog import HANG_EXIT_CODE, find_behind, start_heartbeat, summarize


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


@pytest.mark.variants
def test_a_long_healthy_evaluation_does_not_trip_a_short_hang_timeout(tmp_path):
    out = tmp_path / "run"
    # Four evaluation batches per rank of 3 s each (12 s in all) under a 5 s hang timeout: each batch beats.
    result = run(
        tmp_path, out, 2, "training.max_steps=1", "training.eval_subset_size=8",
        "training.per_device_eval_batch_size=1", "training.hang_timeout_s=5",
        fault="eval.batch:slow:seconds=3", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.log[-4000:]
    assert result.seconds > 12 and not (out / "hang").exists()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "metrics.json").read_text())["eval_loss"] > 0


@pytest.mark.variants
def test_a_stuck_evaluation_is_reported_naming_the_phase_and_the_rank(tmp_path):
    out = tmp_path / "run"
    result = run(
        tmp_path, out, 2, "training.max_steps=1", "training.eval_subset_size=4",
        "training.per_device_eval_batch_size=1", "training.hang_timeout_s=5",
        fault="eval.batch:hang:rank=1", timeout=240,
    )  # fmt: skip
    assert result.returncode == HANG_EXIT_CODE, result.log[-4000:]
    summary = (out / "hang" / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("shardtune: hang: no progress for 5 s") and "Behind: rank(s) 1" in summary
    rank_lines = {int(line.split()[1]): line for line in summary.splitlines() if line.startswith("  rank ")}
    assert "BEHIND" in rank_lines[1] and "step 1, phase eval for" in rank_lines[1]
    assert not (out / "final").exists()


@pytest.mark.variants
def test_a_stuck_checkpoint_save_is_reported_naming_the_phase_and_the_rank(tmp_path):
    out = tmp_path / "run"
    result = run(
        tmp_path, out, 2, "training.max_steps=4", "training.save_steps=2", "training.hang_timeout_s=5",
        fault="save.shards:hang:rank=1:step=2", timeout=240,
    )  # fmt: skip
    assert result.returncode == HANG_EXIT_CODE, result.log[-4000:]
    summary = (out / "hang" / "summary.txt").read_text()
    rank_lines = {int(line.split()[1]): line for line in summary.splitlines() if line.startswith("  rank ")}
    assert "Behind: rank(s) 1" in summary and "BEHIND" in rank_lines[1], summary
    assert "step 2, phase checkpoint for" in rank_lines[1] and "step 2, phase checkpoint for" in rank_lines[0]
    assert not (out / "checkpoint-2").exists()


def _save_under_watch(run_dir: Path, write_every_s: float | None, seconds: float) -> None:
    """A rank's save phase under a 2 s hang timeout, lasting ``seconds``: writing its temporary save
    directory every ``write_every_s`` (a healthy long save), or never (a stuck one)."""
    import torch.distributed as dist

    heartbeat, watchdog = start_heartbeat(run_dir, rank=0, world_size=1, hang_timeout_s=2, interval_s=0)
    staging = run_dir / ".checkpoint-7.tmp"
    with heartbeat.saving(7, "checkpoint", dist.HashStore(), run_dir, watchdog.poll_s):
        staging.mkdir()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if write_every_s is None:
                time.sleep(0.1)
                continue
            with open(staging / "shard.distcp", "ab") as shard:
                shard.write(b"x" * 4096)
            time.sleep(write_every_s)
    watchdog.close()
    os._exit(0)


@pytest.mark.parametrize("healthy", [True, False], ids=["writing", "stuck"])
def test_a_save_beats_while_it_writes_and_a_stuck_one_trips_the_watchdog(tmp_path, healthy):
    # In a child process: the watchdog ends the process it watches.
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_save_under_watch, args=(tmp_path, 0.3 if healthy else None, 7))
    child.start()
    child.join(timeout=120)
    if healthy:
        assert child.exitcode == 0 and not (tmp_path / "hang").exists()
        return
    assert child.exitcode == HANG_EXIT_CODE
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "rank 0" in summary and "step 7, phase checkpoint for" in summary

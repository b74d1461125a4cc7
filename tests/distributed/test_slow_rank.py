"""Two workers (gloo, CPU), one slowed through the SHARDTUNE_TEST_SLOW_RANK hook: every logged step names
it as the slowest rank, its step time exceeds the other's by the delay, and the run warns about it."""

from __future__ import annotations

import json

import pytest
from cli_runs import schema_checked_logs, train

# Far above a tiny step's time (and its jitter on a busy machine), so the slowed rank stands out.
DELAY_S = 0.8
STEPS = 5


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("slow")
    return train(
        tmp_path, "slow", 2, "parallel.strategy=ddp", "data.eval_split_ratio=0.05", "training.eval_subset_size=8",
        "training.eval_steps=2", steps=STEPS, env={"SHARDTUNE_TEST_SLOW_RANK": f"1:{DELAY_S}"},
    )  # fmt: skip


def test_the_slowed_rank_is_named_in_every_logged_step(slow_run):
    rows = schema_checked_logs(slow_run["out"])["train"]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    hosts = json.loads((slow_run["out"] / "run_args.json").read_text())["hostnames"]
    for row in rows:
        assert row["slowest_rank"] == 1 and row["slowest_host"] == hosts[1]
        # rank 0 waits for rank 1 after its own work: that wait is not rank 0's step time
        assert 0.75 * DELAY_S <= row["step_time_s_max"] - row["step_time_s_min"] <= DELAY_S + 0.5
        assert row["step_time_s_median"] == pytest.approx((row["step_time_s_max"] + row["step_time_s_min"]) / 2)
        # the run goes at the slow rank's pace
        assert row["tokens_per_s"] <= row["tokens"] / DELAY_S


def test_the_run_warns_about_the_straggler(slow_run):
    warnings = [line for line in slow_run["log"].splitlines() if "straggler:" in line]
    assert len(warnings) == 1, slow_run["log"][-3000:]
    assert "rank 1 (" in warnings[0] and "slowest rank for 3 logging intervals in a row" in warnings[0]


def test_two_rank_logs_and_manifest(slow_run):
    logs = schema_checked_logs(slow_run["out"])
    assert [row["step"] for row in logs["eval"]] == [2, 4, 5]
    manifest = json.loads((slow_run["out"] / "run_args.json").read_text())
    assert manifest["world_size"] == 2 and manifest["devices"] == ["cpu", "cpu"] and len(manifest["hostnames"]) == 2
    assert slow_run["metrics"]["world_size"] == 2
    # the run's token count is the sum of what its rows logged
    assert slow_run["metrics"]["tokens"] == sum(row["tokens"] for row in logs["train"])

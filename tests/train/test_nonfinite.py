"""Non-finite losses and gradients: every rank agrees, the bad step never updates weights, it is logged, and
the run stops after ``training.max_nonfinite_steps`` in a row (or, with ``skip``, never)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from faulty_runs import checkpoint_weights, run, same_weights, train_log

from shardtune.errors import EXIT_NONFINITE, NonFiniteError
from shardtune.train.nonfinite import NonFiniteGuard


# The fused optimizer's device verdict is the default on GPUs; the host's runs with -m variants.
@pytest.mark.parametrize(
    "fused_optimizer",
    [pytest.param(False, id="host_verdict", marks=pytest.mark.variants), pytest.param(True, id="device_verdict")],
)
def test_nonfinite_steps_on_one_rank_are_skipped_by_every_rank_then_stop_the_run(fused_optimizer, tmp_path):
    """Decided on the host before the update (the foreach optimizer), or on the device by the fused
    optimizer and read by the host a step later: the same skips, logs, weights and stop."""
    out = tmp_path / "run"
    faults = ",".join([
        "forward_backward:nan_loss:rank=1:step=3",  # NaN loss, and so NaN gradients after the all-reduce
        "optimizer:inf_grad:rank=0:step=5",  # an inf in rank 0's gradient only, after the all-reduce
        "forward_backward:nan_loss:rank=1:step=7",
        "forward_backward:nan_loss:rank=1:step=8",  # the second in a row: the run stops
    ])  # fmt: skip
    result = run(
        tmp_path, out, 2, "training.max_steps=9", "training.save_steps=1", "training.checkpoint_mode=lite",
        "training.max_nonfinite_steps=2", f"training.fused_optimizer={str(fused_optimizer).lower()}", fault=faults,
    )  # fmt: skip
    assert result.returncode == EXIT_NONFINITE, result.log[-4000:]
    errors = [line for line in result.log.splitlines() if line.startswith("shardtune: error: training stopped")]
    # Both ranks stop with the same verdict; one line says it for the run.
    assert len(errors) == 1 and "Traceback" not in result.log, result.log[-4000:]
    assert "at step 8: 2 step(s) in a row had a non-finite loss or gradient" in errors[0]
    assert "non-finite loss on rank(s) 1" in errors[0]

    records = [json.loads(line) for line in (out / "logs/nonfinite.jsonl").read_text().splitlines()]
    assert [{key: value for key, value in record.items() if key != "schema_version"} for record in records] == [
        {"step": 3, "loss_ranks": [1], "gradient_ranks": [0, 1], "consecutive": 1, "action": "skip"},
        {"step": 5, "loss_ranks": [], "gradient_ranks": [0], "consecutive": 1, "action": "skip"},
        {"step": 7, "loss_ranks": [1], "gradient_ranks": [0, 1], "consecutive": 1, "action": "skip"},
        {"step": 8, "loss_ranks": [1], "gradient_ranks": [0, 1], "consecutive": 2, "action": "stop"},
    ]
    assert all(record["schema_version"] == 1 for record in records)
    assert "step 5: non-finite gradient norm on rank(s) 0; update skipped" in result.log
    # The logged loss leaves skipped steps out: a window of only skipped steps has no loss.
    losses = {row["step"]: row["loss"] for row in train_log(out)}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7]
    assert [step for step, loss in losses.items() if math.isnan(loss)] == [3, 5, 7]

    # A skipped step leaves the weights exactly as they were; a good one changes them.
    weights = {step: checkpoint_weights(out / f"checkpoint-{step}") for step in range(2, 8)}
    assert same_weights(weights[2], weights[3]) and same_weights(weights[4], weights[5])
    assert same_weights(weights[6], weights[7])
    assert not same_weights(weights[3], weights[4]) and not same_weights(weights[5], weights[6])
    assert all(value.isfinite().all() for value in weights[7].values())
    assert not (out / "checkpoint-8").exists()


def guard(world, tmp_path, policy: str, max_consecutive: int, fused: bool) -> NonFiniteGuard:
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], fused=fused)
    return NonFiniteGuard(world, policy, max_consecutive, tmp_path, optimizer)


def test_skip_never_stops_and_stop_counts_only_consecutive_steps(world, tmp_path):
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    skip = guard(world, tmp_path, "skip", 1, fused=False)
    assert [skip.check(step, nan, one) for step in range(1, 6)] == [(False, torch.tensor(False))] * 5
    assert skip.check(6, one, one) == (True, torch.tensor(True)) and skip.skipped == 5

    stop = guard(world, tmp_path, "stop", 3, fused=False)
    verdicts = [stop.check(step, loss, one)[0] for step, loss in enumerate([nan, nan, one, nan, nan], 1)]
    assert verdicts == [False, False, True, False, False]  # the good step reset the count
    with pytest.raises(NonFiniteError, match="at step 6: 3 step"):
        stop.check(6, one, torch.tensor(float("inf")))
    lines = (tmp_path / "logs/nonfinite.jsonl").read_text().splitlines()
    assert len(lines) == 5 + 5 and json.loads(lines[-1])["action"] == "stop"


def test_a_fused_optimizer_skips_on_the_device_and_the_host_learns_a_step_later(world, tmp_path):
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    stop = guard(world, tmp_path, "stop", 2, fused=True)
    # Always "step": the optimizer skips by itself, flagged by found_inf; the flag also uncounts the loss.
    assert stop.check(1, nan, one) == (True, torch.tensor(False))
    assert stop.optimizer.found_inf == 1.0 and stop.skipped == 0  # not read yet
    assert stop.check(2, one, one) == (True, torch.tensor(True))
    assert stop.optimizer.found_inf == 0.0 and stop.skipped == 1  # step 1 read while step 2 was judged
    stop.check(3, nan, one)
    stop.check(4, one, torch.tensor(float("inf")))  # reads step 3: one in a row
    with pytest.raises(NonFiniteError, match="at step 4: 2 step"):
        stop.settle()  # before a checkpoint, or at the end: the last verdict is read

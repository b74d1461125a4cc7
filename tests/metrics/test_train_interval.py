"""A logging interval's numbers on a real world-size-1 process group: the FLOP count weighs each sequence
by its own length, the interval restarts after each row, and the delay hook lengthens the step time."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from shardtune.data.collate import collate
from shardtune.metrics.flops import TokenFlops
from shardtune.metrics.progress import Progress
from shardtune.metrics.stragglers import SLOW_RANK_ENV
from shardtune.metrics.train_interval import TrainInterval

# 1,000 matmul weights, 2 layers, attention width 8, full fine-tuning.
FLOPS = TokenFlops(matmul_params=1000, layers=2, attention_width=8, sequence_length=0, adapter_params=None)


def batch_of(*lengths: int):
    sequences = [(np.arange(3, 3 + n), np.arange(3, 3 + n), None) for n in lengths]
    return collate(sequences, pad_token_id=0, packed=False)


def one_step(interval: TrainInterval, lengths: tuple[int, ...], loss: float, targets: float) -> None:
    interval.start_step()
    interval.data_ready([batch_of(*lengths)])
    counted = torch.tensor(True)
    interval.add_loss(torch.tensor(loss, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64), counted)
    interval.end_step()


def test_flops_weigh_each_sequence_by_its_own_length(world, monkeypatch):
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    interval = TrainInterval(world, ["host0"], FLOPS, peak_flops=1e9)
    one_step(interval, (10, 30), loss=80.0, targets=38.0)
    record = interval.reduce()
    assert record["tokens"] == 40 and record["target_tokens"] == 38 and record["interval_steps"] == 1
    assert record["loss"] == pytest.approx(80.0 / 38.0)
    # By hand: 6 x 1000 per token, plus 12 x 2 x 8 x n for each of a sequence's n tokens.
    step_flops = 6 * 1000 * 40 + 12 * 2 * 8 * (10 * 10 + 30 * 30)
    assert record["tflops_per_device"] == pytest.approx(record["tokens_per_s_per_device"] * step_flops / 40 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] * 1e12 / 1e9)
    # Training time is wall time up to the logging sync: at least the step's own host time.
    assert 40 / record["tokens_per_s"] >= record["step_time_s_max"]
    assert record["slowest_rank"] == 0 and record["slowest_host"] == "host0"

    # The next row covers only the steps after this one; with no known peak, MFU is null.
    interval.peak_flops = None
    one_step(interval, (5,), loss=4.0, targets=4.0)
    time.sleep(0.3)  # an evaluation or a checkpoint between two steps: not training time
    one_step(interval, (7,), loss=2.0, targets=6.0)
    record = interval.reduce()
    assert 12 / record["tokens_per_s"] < 0.3
    assert (record["tokens"], record["target_tokens"], record["interval_steps"]) == (12, 10, 2)
    assert record["loss"] == pytest.approx(0.6) and record["mfu"] is None
    assert interval.run_tokens == 52


def test_the_hook_slows_this_rank_step(world, monkeypatch):
    monkeypatch.setenv(SLOW_RANK_ENV, "0:0.3")
    interval = TrainInterval(world, ["host0"], FLOPS, peak_flops=None)
    one_step(interval, (10,), loss=1.0, targets=9.0)
    record = interval.reduce()
    assert record["step_time_s_max"] >= 0.3 and record["data_wait_s"] < 0.3


def progress_row(**changes) -> dict:
    return {"loss": 2.5, "lr": 1e-4, "tokens_per_s": 12345.0, "mfu": 0.125, "interval_steps": 2, **changes}


def test_progress_bar_and_log_lines_show_loss_lr_throughput_mfu_and_eta(capsys, caplog):
    bar = Progress(10, True, enabled=True)
    bar.advance()
    bar.advance()
    bar.report(2, progress_row())
    bar.close()
    shown = capsys.readouterr().err
    assert "loss=2.5000" in shown and "lr=1.00e-04" in shown and "tok_s=12,345" in shown and "mfu=12.5%" in shown
    assert "2/10" in shown and ", eta 00:0" in shown
    with caplog.at_level(logging.INFO, logger="shardtune"):
        lines = Progress(10, False, enabled=True)
        lines.report(4, progress_row(mfu=None))
    assert "step 4/10  loss 2.5000  lr 1.000e-04  12,345 tokens/s  mfu -  elapsed 0:00:00  eta 0:00:0" in caplog.text

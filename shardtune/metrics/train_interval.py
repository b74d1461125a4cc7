"""What one ``train_log.jsonl`` row reports: the optimizer steps since the previous row (the interval).

Per step, each rank adds its loss and target-token count on the device and its tokens, sequence
lengths, data wait and step time on the host: nothing forces a host-device sync or a collective. At a
logging step, one all-gather of a few numbers per rank gives every rank the interval's totals and each
rank's step time (see ``stragglers``).

Throughput is over the interval's training time: the wall time from the start of its first step to the
logging step's all-gather (which waits for the device to finish the interval's work), less the time spent
between steps (evaluation, checkpoints, logging). Per-rank step times are host times (the device runs
ahead of the host), used to compare ranks, never to measure throughput: with logging at every step they
would leave out the device work that the logging's sync waits for. TFLOP/s and MFU use ``shardtune.metrics.flops``, the
model ``shardtune bench`` uses, with the interval's token-weighted mean sequence length.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from shardtune.data.collate import Batch
from shardtune.distributed.env import DistributedEnv
from shardtune.metrics.flops import TokenFlops
from shardtune.metrics.memory import peak_memory_gib
from shardtune.metrics.stragglers import StepTimeSpread, StragglerWatch, injected_step_delay

log = logging.getLogger("shardtune")

# Columns of the per-rank row gathered at a logging step.
_LOSS, _TARGETS, _TOKENS, _SQUARED_LENGTHS, _STEP_TIME, _DATA_WAIT, _PEAK_MEMORY = range(7)


class TrainInterval:
    def __init__(self, env: DistributedEnv, hostnames: list[str], flops: TokenFlops, peak_flops: float | None) -> None:
        self.env = env
        self.hostnames = hostnames
        self.flops = flops
        self.peak_flops = peak_flops
        self.stragglers = StragglerWatch()
        self.injected_delay = injected_step_delay(env.rank)
        # Loss sum and target tokens stay on the device: adding to them forces no host sync.
        self.device_sums = torch.zeros(2, dtype=torch.float64, device=env.device)
        self.tokens = self.squared_lengths = self.steps = 0
        self.step_time_s = self.data_wait_s = 0.0
        self.run_tokens = 0  # this rank's tokens over the whole run
        self.run_train_time_s = 0.0  # the intervals' training time over the whole run
        self._step_started = 0.0
        self._interval_started: float | None = None
        self._last_step_ended: float | None = None
        self._between_steps_s = 0.0  # evaluation, checkpoints, logging inside the interval

    def start_step(self) -> None:
        self._step_started = time.perf_counter()
        if self._interval_started is None:
            self._interval_started = self._step_started
        elif self._last_step_ended is not None:
            self._between_steps_s += self._step_started - self._last_step_ended

    def data_ready(self, micro_batches: list[Batch]) -> None:
        """The step's batches are collated (still on the host): count their tokens and sequence lengths."""
        self.data_wait_s += time.perf_counter() - self._step_started
        for batch in micro_batches:
            lengths = batch.real_tokens.sum(dim=1)
            self.tokens += batch.num_tokens
            self.squared_lengths += int((lengths * lengths).sum())
        self.run_tokens += sum(batch.num_tokens for batch in micro_batches)

    def add_loss(self, loss_sum: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor) -> None:
        """A step's loss and target tokens, where ``counted`` (a device flag): a skipped step's are left out."""
        self.device_sums[0] += torch.where(counted, loss_sum, 0.0)
        self.device_sums[1] += torch.where(counted, targets, 0.0)

    def end_step(self) -> None:
        """This rank's part of the step is done (the wait for the other ranks comes after)."""
        if self.injected_delay:
            time.sleep(self.injected_delay)
        self._last_step_ended = time.perf_counter()
        self.step_time_s += self._last_step_ended - self._step_started
        self.steps += 1

    def run_train_time_so_far_s(self) -> float:
        """``run_train_time_s`` and the interval still open, up to the end of its last step (what a
        checkpoint saved between logging steps records)."""
        if self._interval_started is None or self._last_step_ended is None:
            return self.run_train_time_s
        return self.run_train_time_s + self._last_step_ended - self._interval_started - self._between_steps_s

    def reduce(self) -> dict[str, Any]:
        """The interval's train_log fields (from ``loss`` to ``slowest_host``); a collective every rank
        calls at the same step. Starts the next interval."""
        host = [self.tokens, self.squared_lengths, self.step_time_s, self.data_wait_s, peak_memory_gib(self.env.device)]
        local = torch.cat([self.device_sums, torch.tensor(host, dtype=torch.float64, device=self.env.device)])
        per_rank = self.env.all_gather_rows(local)
        totals = per_rank.sum(dim=0).tolist()  # the host sync of this interval: the device is done
        started = self._interval_started if self._interval_started is not None else time.perf_counter()
        seconds = max(time.perf_counter() - started - self._between_steps_s, 1e-9)
        steps = max(self.steps, 1)
        spread = StepTimeSpread.of((per_rank[:, _STEP_TIME] / steps).tolist(), self.hostnames)
        tokens, targets = totals[_TOKENS], totals[_TARGETS]
        per_device = tokens / seconds / self.env.world_size
        # Attention's cost grows with the sequence length: sum(length^2) / sum(length) makes
        # flops_per_token x tokens the sum of every sequence's own cost.
        mean_length = totals[_SQUARED_LENGTHS] / max(tokens, 1)
        flops_per_token = dataclasses.replace(self.flops, sequence_length=mean_length).per_token
        tflops = per_device * flops_per_token / 1e12
        record = {
            "loss": totals[_LOSS] / totals[_TARGETS] if totals[_TARGETS] else float("nan"),
            "interval_steps": self.steps,
            "tokens": int(tokens),
            "target_tokens": int(targets),
            "tokens_per_s": tokens / seconds,
            "target_tokens_per_s": targets / seconds,
            "tokens_per_s_per_device": per_device,
            "target_tokens_per_s_per_device": targets / seconds / self.env.world_size,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak_memory_gib": float(per_rank[:, _PEAK_MEMORY].max()),
            "data_wait_s": float(per_rank[:, _DATA_WAIT].max()) / steps,
            **spread.record(),
        }
        warning = self.stragglers.observe(spread)
        if warning and self.env.is_main:
            log.warning("%s", warning)
        self.run_train_time_s += seconds
        self.device_sums.zero_()
        self.tokens = self.squared_lengths = self.steps = 0
        self.step_time_s = self.data_wait_s = self._between_steps_s = 0.0
        self._interval_started = self._last_step_ended = None
        return record

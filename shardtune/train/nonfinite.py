"""Non-finite losses and gradients: every rank decides the same way, and a bad step never updates weights.

A NaN or inf may show up on one rank only: in its loss (a bad batch, an overflow in its forward pass) or
in its gradients (before or after the data-parallel reduction). If each rank judged for itself, one
would step and another would not, and the replicas would silently diverge. So each rank puts what it
saw (1: its loss, 2: its gradient norm) into its own slot of a world-sized vector, one all-reduce sums
the vector, and every rank then holds the same verdict and knows which ranks saw what. That costs one
small collective and one host sync per step, the price of deciding before ``optimizer.step()``.

``training.on_nonfinite``: ``stop`` skips the update and stops the run (every rank raises
``shardtune.errors.NonFiniteError``: exit status 3) once ``training.max_nonfinite_steps`` steps in a
row were non-finite; ``skip`` skips every such update and never stops. Each skipped step is logged,
and recorded in ``logs/nonfinite.jsonl`` by global rank 0.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.distributed.env import DistributedEnv
from shardtune.errors import NonFiniteError
from shardtune.metrics.schema import LOG_FILES, make_row

log = logging.getLogger("shardtune")

LOSS, GRADIENT = 1, 2


class NonFiniteGuard:
    def __init__(self, env: DistributedEnv, policy: str, max_consecutive: int, run_dir: Path):
        self.env, self.policy, self.max_consecutive = env, policy, max_consecutive
        self.log_path = run_dir / "logs" / LOG_FILES["nonfinite"] if env.is_main else None
        self.consecutive = 0
        self.skipped = 0

    def step_is_finite(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether every rank's loss and gradient norm are finite (a collective: every rank calls it
        every step, and all get the same answer). ``False``: do not apply this step's update."""
        verdict = torch.zeros(self.env.world_size, dtype=torch.int32, device=loss_sum.device)
        verdict[self.env.rank] = (~torch.isfinite(loss_sum)).int() * LOSS + (
            ~torch.isfinite(grad_norm.to(loss_sum.device))
        ).int() * GRADIENT
        if self.env.world_size > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.SUM)  # slots are disjoint: the sum is each rank's code
        codes = verdict.tolist()
        if not any(codes):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        loss_ranks = [rank for rank, code in enumerate(codes) if code & LOSS]
        gradient_ranks = [rank for rank, code in enumerate(codes) if code & GRADIENT]
        what = "; ".join(
            f"non-finite {name} on rank(s) {', '.join(map(str, ranks))}"
            for name, ranks in (("loss", loss_ranks), ("gradient norm", gradient_ranks))
            if ranks
        )
        stop = self.policy == "stop" and self.consecutive >= self.max_consecutive
        if self.env.is_main:
            log.warning(
                "step %d: %s; update skipped (%d non-finite step(s) in a row%s)",
                step, what, self.consecutive,
                f", stopping at {self.max_consecutive}" if self.policy == "stop" else "",
            )  # fmt: skip
            if self.log_path is not None:
                record = make_row("nonfinite", step, {
                    "loss_ranks": loss_ranks,
                    "gradient_ranks": gradient_ranks,
                    "consecutive": self.consecutive,
                    "action": "stop" if stop else "skip",
                })  # fmt: skip
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
        if stop:
            raise NonFiniteError(
                f"training stopped at step {step}: {self.consecutive} step(s) in a row had a non-finite loss or "
                f"gradient (training.max_nonfinite_steps={self.max_consecutive}); last: {what}. No update of "
                "those steps was applied. Lower training.learning_rate, check the data, or set "
                "training.on_nonfinite=skip"
            )
        return False

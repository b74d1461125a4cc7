"""Non-finite losses and gradients: every rank decides the same way, and a bad step never updates weights.

A NaN or inf may show up on one rank only: in its loss (a bad batch, an overflow in its forward pass) or
in its gradients (before or after the data-parallel reduction). If each rank judged for itself, one
would step and another would not, and the replicas would silently diverge. So each rank puts what it
saw (1: its loss, 2: its gradient norm) into its own slot of a world-sized vector, one all-reduce sums
the vector, and every rank then holds the same verdict and knows which ranks saw what.

Where the optimizer is fused (``training.fused_optimizer``; CUDA by default), the verdict never leaves
the device before the update: it is the optimizer's ``found_inf``, with which the fused kernel leaves
weights, moments and step count untouched. The host reads the verdict one step later, when the device
has long computed it, so the host keeps queueing work ahead of the device. It then logs the skipped
step and counts it; a stop is raised before the next update (the one after the last bad step, which
was itself skipped). Other optimizers need the verdict on the host before ``optimizer.step()``: one
host sync per step (free on CPU, where there is no device to wait for).

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


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` itself skips an update flagged in ``optimizer.found_inf`` (fused Adam
    and AdamW do; the for-loop and foreach implementations refuse the flag)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


class NonFiniteGuard:
    def __init__(
        self, env: DistributedEnv, policy: str, max_consecutive: int, run_dir: Path, optimizer: torch.optim.Optimizer
    ):
        self.env, self.policy, self.max_consecutive = env, policy, max_consecutive
        self.log_path = run_dir / "logs" / LOG_FILES["nonfinite"] if env.is_main else None
        self.optimizer = optimizer
        self.on_device = skips_on_device(optimizer)
        self.consecutive = 0
        self.skipped = 0
        # The device path's last verdict, not yet read on the host: (step, its host copy, the copy's event).
        self._unread: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None

    def check(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """Judge this step on every rank (a collective: every rank calls it every step, before
        ``optimizer.step()``). Returns (whether to call ``optimizer.step()``, a device flag: 1 where the
        step counts, 0 where its update is skipped). On the device path the answer to the first is always
        yes: the optimizer skips by itself. May raise ``NonFiniteError`` for an earlier step."""
        verdict = torch.zeros(self.env.world_size, dtype=torch.int32, device=loss_sum.device)
        verdict[self.env.rank] = (~torch.isfinite(loss_sum)).int() * LOSS + (
            ~torch.isfinite(grad_norm.to(loss_sum.device))
        ).int() * GRADIENT
        if self.env.world_size > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.SUM)  # slots are disjoint: the sum is each rank's code
        finite = verdict.count_nonzero() == 0
        if not self.on_device:
            return self._settle(step, verdict.tolist()), finite  # the host sync of this path
        self.settle()  # the previous step's verdict: computed by now
        self.optimizer.found_inf = (~finite).float()
        on_host = verdict.to("cpu", non_blocking=True)
        ready = None
        if verdict.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self._unread = (step, on_host, ready)
        return True, finite

    def settle(self) -> None:
        """Read, log and count the verdict still on its way to the host (a host sync where there is one):
        before anything that must know it (a checkpoint, the end of the run)."""
        if self._unread is None:
            return
        (step, on_host, ready), self._unread = self._unread, None
        if ready is not None:
            ready.synchronize()
        self._settle(step, on_host.tolist())

    def _settle(self, step: int, codes: list[int]) -> bool:
        """Log and count one step's verdict (each rank's code); whether the step was finite."""
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

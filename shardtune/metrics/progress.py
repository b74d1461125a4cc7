"""A live progress bar on a terminal; plain log lines when output goes to a file. Both show the loss,
learning rate, tokens/s, MFU (when the device's peak is known) and the time left. A long evaluation says how far
it has got (``EvalProgress``)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger("shardtune")

# How often a long evaluation says how far it has got: one that ends sooner says nothing before its result.
EVAL_PROGRESS_EVERY_S = 30.0
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}, eta {remaining}{postfix}]"


class Progress:
    def __init__(self, total_steps: int, mode: bool | str, enabled: bool):
        self.total_steps = total_steps
        self.enabled = enabled
        self.started = time.perf_counter()
        self.first_step: int | None = None
        use_bar = enabled and (mode is True or (mode == "auto" and sys.stderr.isatty()))
        self.bar = (
            tqdm(total=total_steps, desc="train", dynamic_ncols=True, file=sys.stderr, bar_format=BAR_FORMAT)
            if use_bar
            else None
        )

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, record: dict[str, Any]) -> None:
        """Show a train_log row (``step`` is its step)."""
        if not self.enabled:
            return
        mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "-"
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:,.0f}",
                mfu=mfu,
                refresh=True,
            )
            return
        if self.first_step is None:
            # A resumed run: the ETA comes from the steps this process ran, not from step 0.
            self.first_step = step - record["interval_steps"]
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(step - self.first_step, 1) * (self.total_steps - step)
        log.info(
            "step %d/%d  loss %.4f  lr %.3e  %s tokens/s  mfu %s  elapsed %s  eta %s",
            step,
            self.total_steps,
            record["loss"],
            record["lr"],
            f"{record['tokens_per_s']:,.0f}",
            mfu,
            _clock(elapsed),
            _clock(eta),
        )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            log.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class EvalProgress:
    """Called after each evaluation batch with (batches done, batches in all): every ``EVAL_PROGRESS_EVERY_S``
    seconds, a line through ``say`` with the share done and the time left. Rank 0's batches stand for every rank's:
    each runs as many (``batches_per_rank``)."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < EVAL_PROGRESS_EVERY_S or done >= total:
            return
        self.last = now
        elapsed = now - self.started
        self.say(
            f"eval: {done:,} of {total:,} batches ({done / total:.0%})  elapsed {_clock(elapsed)}  "
            f"eta {_clock(elapsed / done * (total - done))}"
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}"

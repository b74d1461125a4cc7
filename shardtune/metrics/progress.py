"""A live progress bar on a terminal; plain log lines (with an ETA) when output goes to a file."""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("shardtune")


class Progress:
    def __init__(self, total_steps: int, mode: bool | str, enabled: bool):
        self.total_steps = total_steps
        self.enabled = enabled
        self.started = time.perf_counter()
        use_bar = enabled and (mode is True or (mode == "auto" and sys.stderr.isatty()))
        self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, file=sys.stderr) if use_bar else None

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=True)
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / step * (self.total_steps - step)
        log.info(
            "step %d/%d  loss %.4f  lr %.3e  %s tokens/s  elapsed %s  eta %s",
            step,
            self.total_steps,
            loss,
            lr,
            f"{tokens_per_s:,.0f}",
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


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}"

"""Fault injection for the reliability tests: the one place that reads ``SHARDTUNE_FAULT``.

A run only ever meets a fault when that variable is set; production runs never set it, and then
every hook below is a dictionary lookup that finds nothing. Each fault is injected through a real
mechanism, so the code under test meets it exactly as it would meet the real thing:

    SHARDTUNE_FAULT="POINT:ACTION[:rank=R][:step=S][:attempt=A]"   (several: separated by ",")

Points are named places in a run: ``save.begin`` (a rank enters a checkpoint save), ``save.shards`` (before
this rank writes its shards), ``save.written`` (after this rank's shards are on disk, before the commit),
``save.rotate`` (as ``save_total_limit`` removes an older checkpoint), every heartbeat phase of a training
step (``forward_backward``, ``optimizer``, ...), and ``eval.batch`` (after each evaluation batch). Actions:

- ``kill``: SIGKILL this process (a crashed rank or lost node: no handler, no cleanup).
- ``hang``: sleep forever (a stuck rank: a deadlock, a dead NFS mount, a GPU that stopped answering).
- ``slow``: sleep ``seconds=S`` (default 1) every time the point is passed, not only once per step: a
  rank that is slow but progressing (a long evaluation, a slow device).
- ``write_error``: limit this process's file size to 0 bytes with ``setrlimit(RLIMIT_FSIZE)``; from
  then on the kernel fails every write it makes with EFBIG ("File too large"), an ``OSError`` raised
  by ``write()`` exactly where ENOSPC ("No space left on device") would be.
- ``nan_loss``: the embedding output of this step's forward passes becomes NaN, so the loss and every
  gradient computed from it are NaN.
- ``inf_grad``: one gradient of this rank becomes +inf after backward (and after the gradient
  all-reduce, so only this rank sees it).
- ``oom``: the embedding layer of the next forward pass raises ``torch.OutOfMemoryError`` with the
  CUDA caching allocator's words, as a forward that cannot allocate does (on a CPU no allocator raises it).

``rank`` (global rank), ``step`` and ``attempt`` (the launcher's restart count) narrow where a fault
fires; left out, it fires everywhere. A fault other than ``slow`` fires at most once per process and step.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from dataclasses import dataclass

import torch

FAULT_VARIABLE = "SHARDTUNE_FAULT"
ACTIONS = ("kill", "hang", "slow", "write_error", "nan_loss", "inf_grad", "oom")
OPTIONS = ("rank", "step", "attempt", "seconds")


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    rank: int | None = None
    step: int | None = None
    attempt: int | None = None
    seconds: int = 1  # how long ``slow`` sleeps

    def matches(self, point: str, rank: int, step: int | None) -> bool:
        attempt = int(os.environ.get("SHARDTUNE_RESTART_COUNT", "0"))
        return (
            self.point == point
            and self.rank in (None, rank)
            and (self.step is None or self.step == step)
            and self.attempt in (None, attempt)
        )


def parse_faults(text: str) -> list[Fault]:
    """``SHARDTUNE_FAULT``'s value -> faults; a malformed one is an error, never silently ignored."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, rest = item.partition(":")
        action, *options = rest.split(":")
        if not point or action not in ACTIONS:
            raise ValueError(
                f"{FAULT_VARIABLE}: {item!r}: expected POINT:ACTION[:rank=R][:step=S], ACTION one of {ACTIONS}"
            )
        fields: dict[str, int] = {}
        for option in options:
            name, _, value = option.partition("=")
            if name not in OPTIONS or not value.lstrip("-").isdigit():
                raise ValueError(
                    f"{FAULT_VARIABLE}: {item!r}: unknown option {option!r} (rank=R, step=S, attempt=A, seconds=N)"
                )
            fields[name] = int(value)
        faults.append(Fault(point, action, **fields))
    return faults


class FaultInjector:
    """This process's configured faults, and the model they act on (for ``nan_loss``/``inf_grad``)."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults, self.rank = faults, rank
        self.fired: set[tuple[Fault, int | None]] = set()
        self.step: int | None = None  # the step of the last point passed
        self.poison_step: int | None = None  # nan_loss: the step whose forward passes are poisoned
        self.runs_out_of_memory = False  # oom: the next forward pass runs out of memory
        self.parameters: list[torch.nn.Parameter] = []

    def attach(self, model: torch.nn.Module) -> None:
        """Give ``nan_loss``, ``inf_grad`` and ``oom`` the model to act on (only when one is configured)."""
        if not any(fault.action in ("nan_loss", "inf_grad", "oom") for fault in self.faults):
            return
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        embeddings = _input_embeddings(model)
        embeddings.register_forward_hook(self._poison_embeddings)

    def _poison_embeddings(self, module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        if self.runs_out_of_memory:
            self.runs_out_of_memory = False
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                "1.06 GiB is free. Including non-PyTorch memory, this process has 78.10 GiB memory in use."
            )
        if self.poison_step is not None and self.poison_step == self.step:
            return output * float("nan")
        return output

    def at(self, point: str, step: int | None = None) -> None:
        """Fire whatever fault is configured for ``point`` (at ``step``) on this rank."""
        self.step = step
        self.poison_step = None  # nan_loss poisons only the forward passes of the phase it fired in
        for fault in self.faults:
            if not fault.matches(point, self.rank, step) or (fault, step) in self.fired:
                continue
            if fault.action == "slow":
                time.sleep(fault.seconds)
                continue
            self.fired.add((fault, step))
            # One write (print() writes the newline apart): the ranks share the pipe, and another rank's line
            # could otherwise end up glued to this one.
            sys.stderr.write(f"shardtune: fault injection: {fault.action} at {point}, step {step}, rank {self.rank}\n")
            sys.stderr.flush()
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "hang":
                while True:
                    time.sleep(3600)
            elif fault.action == "write_error":
                # Without SIGXFSZ ignored the kernel would kill the process instead of failing the write.
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            elif fault.action == "nan_loss":
                self.poison_step = step
            elif fault.action == "oom":
                self.runs_out_of_memory = True
            elif fault.action == "inf_grad":
                with torch.no_grad():
                    target = next(p for p in self.parameters if p.grad is not None)
                    target.grad.view(-1)[0] = float("inf")


def _input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if getter is not None:
            return getter()
    raise ValueError(f"{FAULT_VARIABLE}: nan_loss needs a model with input embeddings, not {type(model).__name__}")


_injector: FaultInjector | None = None


def install_faults(rank: int) -> FaultInjector:
    """Read ``SHARDTUNE_FAULT`` for this process (global ``rank``); ``fault_point`` then consults it."""
    global _injector
    _injector = FaultInjector(parse_faults(os.environ.get(FAULT_VARIABLE, "")), rank)
    return _injector


def fault_point(point: str, step: int | None = None) -> None:
    """A named place where a configured fault may fire; nothing happens when none is configured."""
    if _injector is not None and _injector.faults:
        _injector.at(point, step)

"""The fault-injection hook: what ``SHARDTUNE_FAULT`` accepts, and that a write error is the kernel's."""

from __future__ import annotations

import errno
import multiprocessing

import pytest

from shardtune.faults import Fault, FaultInjector, parse_faults


def test_parse_faults():
    assert parse_faults("save.shards:kill:rank=1:step=4:attempt=0, forward_backward:hang") == [
        Fault("save.shards", "kill", rank=1, step=4, attempt=0),
        Fault("forward_backward", "hang"),
    ]
    assert parse_faults("eval.batch:slow:seconds=3:rank=1") == [Fault("eval.batch", "slow", rank=1, seconds=3)]
    assert parse_faults("") == []
    with pytest.raises(ValueError, match="expected POINT:ACTION"):
        parse_faults("save.shards:explode")
    with pytest.raises(ValueError, match="unknown option 'ranks=1'"):
        parse_faults("save.shards:kill:ranks=1")


def test_a_fault_fires_only_where_and_when_it_is_meant_to(monkeypatch):
    monkeypatch.setenv("SHARDTUNE_RESTART_COUNT", "1")
    fault = Fault("optimizer", "kill", rank=1, step=3, attempt=1)
    assert fault.matches("optimizer", 1, 3)
    assert not fault.matches("optimizer", 0, 3) and not fault.matches("optimizer", 1, 4)
    assert not fault.matches("save.shards", 1, 3)
    monkeypatch.setenv("SHARDTUNE_RESTART_COUNT", "0")
    assert not fault.matches("optimizer", 1, 3)


def _write_after_write_error(queue) -> None:
    FaultInjector([Fault("save.shards", "write_error")], rank=0).at("save.shards", 1)
    import tempfile

    try:
        with tempfile.TemporaryFile() as handle:
            handle.write(b"x" * 10)
            handle.flush()
        queue.put(None)
    except OSError as error:
        queue.put(error.errno)


def test_write_error_makes_the_kernel_fail_every_write_of_the_process():
    # In a child process: the file size limit stays with the process that set it.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_write_after_write_error, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert queue.get(timeout=5) == errno.EFBIG


def test_slow_sleeps_every_time_the_point_is_passed():
    import time

    injector = FaultInjector([Fault("eval.batch", "slow", seconds=1)], rank=0)
    started = time.monotonic()
    for _ in range(2):
        injector.at("eval.batch", 5)  # the same point and step twice: a slow rank stays slow
    assert time.monotonic() - started >= 2

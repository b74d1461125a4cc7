"""The token store: exact round trips through memory maps, content-addressed keys, atomic commits,
and exactly one build among processes that race for the same store."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardtune.data import store
from shardtune.data.store import (
    IGNORE_INDEX,
    SequenceArrays,
    build_once,
    fingerprint_file,
    is_committed,
    open_store,
    store_key,
    write_store,
)
from shardtune.errors import DataError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KEY = "0123456789abcdef0123"


def make_splits(seed: int = 0) -> dict[str, SequenceArrays]:
    """Deterministic splits of varied lengths, including an empty sequence and an empty split."""
    rng = np.random.default_rng(seed)
    sequences = []
    for length in [5, 1, 0, 17, 3]:
        ids = rng.integers(0, 32_000, size=length).tolist()
        targets = ids[1:] + [IGNORE_INDEX] if ids else []
        sequences.append((ids, targets, list(range(length))))
    return {
        "train": SequenceArrays.from_sequences(sequences),
        "eval": SequenceArrays.from_sequences(sequences[:2]),
        "empty": SequenceArrays.from_sequences([]),
    }


def checksum(splits: dict[str, SequenceArrays]) -> str:
    digest = hashlib.sha256()
    for name in sorted(splits):
        digest.update(name.encode())
        for field in ("input_ids", "targets", "position_ids", "offsets"):
            array = np.asarray(getattr(splits[name], field))
            digest.update(f"{field}:{array.dtype}:{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def child_main(argv: list[str]) -> None:
    """Run in a separate OS process: wait for the start signal, then ``build_once`` on a shared cache.

    The build sleeps so that the other process surely arrives while it runs, and leaves a file named
    after this pid so the test can count builds; the store's checksum is written for comparison.
    """
    cache_dir, work, role = Path(argv[0]), Path(argv[1]), argv[2]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    pid = os.getpid()
    (work / "ready" / str(pid)).touch()
    deadline = time.monotonic() + 30
    while not (work / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no start signal")
        time.sleep(0.005)

    def build():
        (work / "ran" / str(pid)).touch()
        time.sleep(1.0)
        return make_splits(), {"rows_read": 5}, {"inputs": {"seed": 0}}

    opened = build_once(cache_dir, KEY, build, is_builder=role == "builder", timeout_s=30, poll_s=0.05)
    (work / "sums" / str(pid)).write_text(checksum(opened.splits))


def start_children(tmp_path: Path, roles: list[str]) -> tuple[Path, Path, list[subprocess.Popen]]:
    cache_dir, work = tmp_path / "cache", tmp_path / "work"
    for name in ("ready", "ran", "sums"):
        (work / name).mkdir(parents=True)
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_store import child_main; child_main(sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache_dir), str(work), role],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in roles
    ]
    # A barrier: both imports are done before either may start, so the two really race.
    deadline = time.monotonic() + 60
    while len(list((work / "ready").iterdir())) < len(children):
        assert time.monotonic() < deadline, "children did not start"
        assert all(child.poll() is None for child in children), [child.communicate() for child in children]
        time.sleep(0.01)
    (work / "go").touch()
    return cache_dir, work, children


def finish(child: subprocess.Popen) -> str:
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    return stderr


def assert_same_arrays(left: dict[str, SequenceArrays], right: dict[str, SequenceArrays]) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        for field in ("input_ids", "targets", "position_ids", "offsets"):
            expected, actual = getattr(left[name], field), getattr(right[name], field)
            assert actual.dtype == expected.dtype
            np.testing.assert_array_equal(actual, expected)


def only_entries(cache_dir: Path) -> list[str]:
    return sorted(entry.name for entry in cache_dir.iterdir())


# SequenceArrays


def test_from_sequences_concatenates_and_sequence_returns_views():
    arrays = SequenceArrays.from_sequences(
        [([1, 2, 3], [2, 3, IGNORE_INDEX], [0, 1, 0]), ([], [], []), (np.array([7, 8]), (8, -100), [0, 1])]
    )
    assert len(arrays) == 3
    np.testing.assert_array_equal(arrays.input_ids, [1, 2, 3, 7, 8])
    np.testing.assert_array_equal(arrays.targets, [2, 3, -100, 8, -100])
    np.testing.assert_array_equal(arrays.position_ids, [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(arrays.offsets, [0, 3, 3, 5])
    np.testing.assert_array_equal(arrays.lengths(), [3, 0, 2])
    assert [a.dtype for a in (arrays.input_ids, arrays.targets, arrays.position_ids)] == [np.int32] * 3
    assert arrays.offsets.dtype == np.int64
    ids, targets, positions = arrays.sequence(-1)
    np.testing.assert_array_equal(ids, [7, 8])
    assert np.shares_memory(ids, arrays.input_ids) and np.shares_memory(targets, arrays.targets)
    assert np.shares_memory(positions, arrays.position_ids)
    with pytest.raises(IndexError):
        arrays.sequence(3)


def test_from_sequences_rejects_bad_sequences_naming_them():
    good = ([1], [IGNORE_INDEX], [0])
    with pytest.raises(ValueError, match=r"sequence 1: fields differ in length \(input_ids 2, targets 1"):
        SequenceArrays.from_sequences([good, ([1, 2], [2], [0, 1])])
    with pytest.raises(ValueError, match="sequence 0: targets must be a flat sequence of ints"):
        SequenceArrays.from_sequences([([1], [0.5], [0])])
    with pytest.raises(ValueError, match="input_ids has values outside int32"):
        SequenceArrays.from_sequences([good, ([2**31], [0], [0])])


@pytest.mark.parametrize(
    ("offsets", "message"),
    [([1, 3], "start with 0"), ([0, 2], "end at 2, but there are 3 tokens"), ([0, 2, 1, 3], "must not decrease")],
)
def test_inconsistent_offsets_are_refused(offsets, message):
    tokens = np.zeros(3, np.int32)
    with pytest.raises(ValueError, match=message):
        SequenceArrays(tokens, tokens, tokens, np.array(offsets))


# Keys and fingerprints


def test_store_key_is_stable_and_changes_with_any_input():
    inputs = {"files": {"train": "sha256:ab:3"}, "tokenizer": "tiny", "max_length": 512, "packing": True}
    key = store_key(inputs)
    assert key == store_key(dict(reversed(list(inputs.items()))))  # order does not matter
    assert key == store_key(
        {"packing": True, "max_length": 512, "tokenizer": "tiny", "files": {"train": "sha256:ab:3"}}
    )
    assert len(key) == 20 and int(key, 16) >= 0
    changed = [
        {**inputs, "files": {"train": "sha256:ac:3"}},
        {**inputs, "tokenizer": "tiny2"},
        {**inputs, "max_length": 513},
        {**inputs, "packing": False},
        {**inputs, "seed": 0},
    ]
    keys = {store_key(variant) for variant in changed}
    assert len(keys) == len(changed) and key not in keys
    with pytest.raises(TypeError):
        store_key({"path": Path("data.jsonl")})  # never silently str()-ed


def test_fingerprint_follows_content_not_name_or_time(tmp_path: Path):
    content = os.urandom((1 << 20) + 12_345)  # crosses the 1 MiB read chunk
    first = tmp_path / "a.jsonl"
    first.write_bytes(content)
    fingerprint = fingerprint_file(first)
    assert fingerprint == f"sha256:{hashlib.sha256(content).hexdigest()}:{len(content)}"
    copy = tmp_path / "b.jsonl"
    copy.write_bytes(content)
    assert fingerprint_file(copy) == fingerprint
    edited = bytearray(content)
    edited[(1 << 20) + 5] ^= 1  # same size, one bit in the second chunk
    first.write_bytes(bytes(edited))
    assert fingerprint_file(first) != fingerprint


# Writing and opening


def test_round_trip_is_exact_and_memory_mapped_read_only(tmp_path: Path):
    splits = make_splits()
    path = write_store(tmp_path, KEY, splits, {"rows_read": 5, "dropped": {"empty": 1}}, {"inputs": {"a": 1}})
    assert path == tmp_path / KEY and is_committed(tmp_path, KEY)
    assert only_entries(tmp_path) == [KEY]  # no temporary left behind

    opened = open_store(path)
    assert_same_arrays(splits, opened.splits)
    for arrays in opened.splits.values():
        for field in ("input_ids", "targets", "position_ids", "offsets"):
            array = getattr(arrays, field)
            assert isinstance(array, np.memmap) and not array.flags.writeable
    ids, _, _ = opened.splits["train"].sequence(3)
    np.testing.assert_array_equal(ids, splits["train"].sequence(3)[0])
    assert opened.summary == {"rows_read": 5, "dropped": {"empty": 1}}
    assert opened.meta["inputs"] == {"a": 1}
    assert {"shardtune_version", "created_at", "host"} <= set(opened.meta)


def test_a_damaged_store_is_a_data_error(tmp_path: Path):
    path = write_store(tmp_path, KEY, make_splits(), {}, {})
    (path / "train" / "targets.npy").unlink()
    with pytest.raises(DataError, match=f"{path}: damaged token store.*delete the directory"):
        open_store(path)


def test_the_first_committed_store_wins(tmp_path: Path, monkeypatch):
    first = make_splits(seed=1)
    write_store(tmp_path, KEY, first, {"who": "first"}, {})
    # Another process commits between our check and our rename: the rename fails and theirs is kept.
    real_is_committed, calls = store.is_committed, []

    def not_yet_committed_at_first_look(*args):
        calls.append(args)
        return len(calls) > 1 and real_is_committed(*args)

    monkeypatch.setattr(store, "is_committed", not_yet_committed_at_first_look)
    path = write_store(tmp_path, KEY, make_splits(seed=2), {"who": "second"}, {})
    assert len(calls) == 2  # the race was really taken: checked, written, rename refused, checked again
    assert open_store(path).summary == {"who": "first"}
    assert_same_arrays(first, open_store(path).splits)
    assert only_entries(tmp_path) == [KEY]


def test_a_failed_build_commits_nothing_and_a_later_build_works(tmp_path: Path):
    def broken():
        raise RuntimeError("tokenizer exploded")

    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        build_once(tmp_path, KEY, broken, is_builder=True, timeout_s=5)
    assert not (tmp_path / KEY).exists() and not is_committed(tmp_path, KEY)

    opened = build_once(tmp_path, KEY, lambda: (make_splits(), {}, {}), is_builder=True, timeout_s=5)
    assert_same_arrays(make_splits(), opened.splits)


def test_processes_waiting_for_a_store_get_the_error_that_stopped_its_builder(tmp_path: Path):
    def no_rows():
        raise DataError("data.jsonl: no training example left")

    with pytest.raises(DataError, match="no training example left"):
        build_once(tmp_path, KEY, no_rows, is_builder=True, timeout_s=5)
    started = time.monotonic()
    with pytest.raises(DataError) as waited:
        build_once(tmp_path, KEY, no_rows, is_builder=False, timeout_s=30, poll_s=0.05)
    assert waited.value.lines == ["data.jsonl: no training example left"] and time.monotonic() - started < 5
    # The next build clears the failure and commits.
    opened = build_once(tmp_path, KEY, lambda: (make_splits(), {}, {}), is_builder=True, timeout_s=5)
    assert_same_arrays(make_splits(), opened.splits)
    assert not (tmp_path / f"{KEY}.failed").exists()


def test_a_store_without_its_meta_in_the_way_is_one_line_before_any_build(tmp_path: Path):
    """A directory at the store's name without meta.json (write_store never leaves one: a copy of the cache cut
    short) is named at once, to every process, and left as it is; the build used to run whole before its rename
    failed with a traceback."""
    path = write_store(tmp_path, KEY, make_splits(), {}, {})
    (path / "meta.json").unlink()
    left = sorted(entry.name for entry in path.iterdir())
    builds = []

    def build():
        builds.append(1)
        return make_splits(), {}, {}

    line = f"{path}: damaged token store (no meta.json); delete the directory to rebuild it"
    with pytest.raises(DataError) as built:
        build_once(tmp_path, KEY, build, is_builder=True, timeout_s=5)
    with pytest.raises(DataError) as waited:
        build_once(tmp_path, KEY, build, is_builder=False, timeout_s=30, poll_s=0.05)
    assert built.value.lines == waited.value.lines == [line] and builds == []
    assert sorted(entry.name for entry in path.iterdir()) == left


def test_a_failure_while_writing_leaves_no_partial_store(tmp_path: Path, monkeypatch):
    real_save, saved = np.save, []

    def failing_save(*args, **kwargs):
        if len(saved) == 5:  # the second split is half written
            raise OSError(28, "No space left on device")
        saved.append(1)
        real_save(*args, **kwargs)

    monkeypatch.setattr(store.np, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        write_store(tmp_path, KEY, make_splits(), {}, {})
    assert only_entries(tmp_path) == []


def test_the_next_builder_removes_what_a_crashed_build_left(tmp_path: Path):
    crashed = tmp_path / f"{KEY}.tmp-deadhost-99999"
    (crashed / "train").mkdir(parents=True)
    (crashed / "train" / "input_ids.npy").write_bytes(b"half")
    assert not is_committed(tmp_path, KEY)
    other_key = tmp_path / "fedcba9876543210fedc.tmp-otherhost-1"  # another store's build: not ours to touch
    other_key.mkdir()

    build_once(tmp_path, KEY, lambda: (make_splits(), {}, {}), is_builder=True, timeout_s=5)
    assert only_entries(tmp_path) == sorted([KEY, f"{KEY}.lock", other_key.name])


# build_once


def test_build_once_builds_once_then_reuses(tmp_path: Path, caplog):
    calls = []

    def build():
        calls.append(1)
        return make_splits(), {"rows_read": 5}, {}

    caplog.set_level(logging.INFO, logger="shardtune")
    first = build_once(tmp_path, KEY, build, is_builder=True, timeout_s=5)
    second = build_once(tmp_path, KEY, build, is_builder=True, timeout_s=5)
    third = build_once(tmp_path, KEY, build, is_builder=False, timeout_s=5)
    assert len(calls) == 1
    assert_same_arrays(first.splits, second.splits)
    assert_same_arrays(first.splits, third.splits)
    assert second.summary == {"rows_read": 5}
    assert sum(f"reusing token store {tmp_path / KEY}" in r.getMessage() for r in caplog.records) == 2


def test_a_non_builder_times_out_naming_the_store(tmp_path: Path):
    def never():
        raise AssertionError("a non-builder must not build")

    started = time.monotonic()
    with pytest.raises(DataError, match=rf"token store {tmp_path / KEY} was not built within 0.3 s \(builder: unknown"):
        build_once(tmp_path, KEY, never, is_builder=False, timeout_s=0.3, poll_s=0.05)
    assert 0.3 <= time.monotonic() - started < 2


def test_a_builder_gives_up_waiting_for_a_held_lock_naming_the_holder(tmp_path: Path):
    lock = tmp_path / f"{KEY}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # flock conflicts between open files even within one process
        os.write(fd, b"otherhost 4242 2025-01-01T00:00:00+00:00")
        with pytest.raises(DataError, match=r"within 0.3 s; it is held by otherhost 4242 2025"):
            build_once(tmp_path, KEY, lambda: (make_splits(), {}, {}), is_builder=True, timeout_s=0.3, poll_s=0.05)
    finally:
        os.close(fd)
    assert not is_committed(tmp_path, KEY)


def test_a_non_builder_waits_for_a_builder_in_another_process(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr(store, "LOG_EVERY_S", 0.1)
    caplog.set_level(logging.INFO, logger="shardtune")
    cache_dir, work, (child,) = start_children(tmp_path, ["builder"])

    def never():
        raise AssertionError("a non-builder must not build")

    opened = build_once(cache_dir, KEY, never, is_builder=False, timeout_s=30, poll_s=0.05)
    stderr = finish(child)
    assert "built token store" in stderr
    assert [p.name for p in (work / "ran").iterdir()] == [str(child.pid)]
    assert_same_arrays(make_splits(), opened.splits)
    # While it waited it named the process that builds, from the line the builder writes in the lock file.
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for token store")]
    assert any(f" {child.pid} " in message for message in waiting), waiting


def test_two_processes_racing_build_exactly_once(tmp_path: Path):
    cache_dir, work, children = start_children(tmp_path, ["builder", "builder"])
    logs = [finish(child) for child in children]

    assert len(list((work / "ran").iterdir())) == 1
    sums = {path.read_text() for path in (work / "sums").iterdir()}
    assert sums == {checksum(make_splits())}  # both got identical arrays, and the right ones
    assert sorted("built token store" in log for log in logs) == [False, True]
    assert all("reusing token store" in log for log in logs if "built token store" not in log)
    assert only_entries(cache_dir) == [KEY, f"{KEY}.lock"]
    assert (cache_dir / f"{KEY}.lock").read_text() == ""  # the builder no longer claims it

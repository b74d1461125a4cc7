"""The token store: a prepared dataset written once to a directory named by a hash of its inputs.

Tokenizing (and packing) a dataset is slow and the same for every process of a run and for every run
with the same inputs, so it is done once and the result kept as flat ``.npy`` arrays that every later
reader memory-maps: all ranks of a node share one copy in the page cache, and opening is instant.

Layout of ``<cache_dir>/<key>/``::

    <split>/input_ids.npy, targets.npy, position_ids.npy   # int32, all sequences concatenated
    <split>/offsets.npy                                     # int64, sequence i spans offsets[i]:offsets[i+1]
    summary.json                                            # what preparing the data kept and dropped
    meta.json                                               # the hash inputs, version, created_at, host

A store is written under a temporary name and renamed into place, so the final name is the commit:
a directory with it is always complete, and a crash leaves only a ``<key>.tmp-*`` directory that the
next builder removes. ``build_once`` adds an exclusive ``flock`` so that of many processes that need
the same store (ranks of one run, or two runs started together) exactly one builds it and the others
wait for the commit. flock is released by the kernel when its holder dies, so a stale lock file never
blocks anyone; on network filesystems it works where the filesystem supports it (NFSv4, most Lustre
and GPFS mounts), and where it does not the rename still keeps every store complete, at worst built twice.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from shardtune import __version__
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "SequenceArrays",
    "TokenStore",
    "build_once",
    "fingerprint_file",
    "is_committed",
    "open_store",
    "store_key",
    "write_store",
]

KEY_LENGTH = 20  # hex characters of sha256: 80 bits, no accidental collision among any number of stores
TOKEN_FIELDS = ("input_ids", "targets", "position_ids")
SUMMARY_FILE = "summary.json"
META_FILE = "meta.json"  # written last, so a directory holding it was written completely
LOG_EVERY_S = 30.0  # how often a waiting process says what it waits for
_CHUNK = 1 << 20
# Keys and split names become file names: nothing that could escape the directory or hide in it.
# No dots: nothing can be mistaken for a temporary directory, a lock file or one of the JSON files.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


@dataclass(eq=False, repr=False)
class SequenceArrays:
    """One split: many token sequences concatenated. Sequence i spans ``offsets[i]:offsets[i+1]``.

    Flat arrays rather than a list of lists: one memory map per field whatever the number of
    sequences, and a sequence is a slice (a view), never a copy. ``position_ids`` restart at 0 at
    every example start, since a packed sequence holds several examples; ``targets`` are next-token
    targets with ``IGNORE_INDEX`` where no loss is taken.
    """

    input_ids: np.ndarray  # int32
    targets: np.ndarray  # int32
    position_ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len = num_sequences + 1, offsets[0] == 0

    def __post_init__(self) -> None:
        # Conversion copies only arrays of another dtype; memory-mapped int32 arrays pass through as they are.
        for name in TOKEN_FIELDS:
            setattr(self, name, _as_int_array(name, getattr(self, name), np.int32))
        self.offsets = _as_int_array("offsets", self.offsets, np.int64)
        num_tokens = len(self.input_ids)
        for name in TOKEN_FIELDS[1:]:
            if len(getattr(self, name)) != num_tokens:
                raise ValueError(f"{name} has {len(getattr(self, name))} tokens, input_ids {num_tokens}")
        if len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError("offsets must start with 0")
        if self.offsets[-1] != num_tokens:
            raise ValueError(f"offsets end at {self.offsets[-1]}, but there are {num_tokens} tokens")
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must not decrease")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __repr__(self) -> str:
        return f"SequenceArrays(num_sequences={len(self)}, num_tokens={len(self.input_ids)})"

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views ``(input_ids, targets, position_ids)`` of sequence ``i`` (negative counts from the end)."""
        i = range(len(self))[i]  # IndexError out of range, and negative indices, like a list
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[start:end], self.targets[start:end], self.position_ids[start:end]

    def lengths(self) -> np.ndarray:
        """Tokens per sequence (int64)."""
        return np.diff(self.offsets)

    @classmethod
    def from_sequences(cls, seqs: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> SequenceArrays:
        """Concatenate ``(input_ids, targets, position_ids)`` triples (lists or arrays of ints).

        Each triple becomes one small array per field and the pieces are joined by one
        ``np.concatenate`` per field, so the cost is linear whatever the number of sequences.
        """
        pieces: dict[str, list[np.ndarray]] = {name: [] for name in TOKEN_FIELDS}
        lengths: list[int] = []
        for index, triple in enumerate(seqs):
            if len(triple) != 3:
                raise ValueError(
                    f"sequence {index}: expected (input_ids, targets, position_ids), got {len(triple)} items"
                )
            arrays = []
            for name, values in zip(TOKEN_FIELDS, triple, strict=True):
                array = np.asarray(values)
                if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                    raise ValueError(
                        f"sequence {index}: {name} must be a flat sequence of ints, got {array.dtype} {array.shape}"
                    )
                # np.asarray([]) is float64, which would turn the whole concatenation into floats.
                arrays.append(array if array.size else np.zeros(0, np.int32))
            if len({len(array) for array in arrays}) != 1:
                sizes = ", ".join(f"{name} {len(array)}" for name, array in zip(TOKEN_FIELDS, arrays, strict=True))
                raise ValueError(f"sequence {index}: fields differ in length ({sizes})")
            for name, array in zip(TOKEN_FIELDS, arrays, strict=True):
                pieces[name].append(array)
            lengths.append(len(arrays[0]))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # One concatenation per field; the constructor then checks that every value fits int32.
        joined = {name: np.concatenate(parts) if parts else np.zeros(0, np.int32) for name, parts in pieces.items()}
        return cls(offsets=offsets, **joined)


@dataclass(eq=False)
class TokenStore:
    """An opened store: its directory, its splits (read-only memory maps), and its two JSON files."""

    path: Path
    splits: dict[str, SequenceArrays]
    summary: dict = field(default_factory=dict)  # rows read, kept, dropped per reason, tokens...
    meta: dict = field(default_factory=dict)  # the hash inputs, shardtune version, created_at, host


def store_key(inputs: dict) -> str:
    """A stable name for a store: the sha256 of ``inputs`` as canonical JSON, first 20 hex characters.

    ``inputs`` must hold everything the prepared data depends on (file fingerprints, tokenizer,
    max_length, packing, seed, format version...): a change in any of them is a new key and so a new
    store, never a stale one. Canonical means sorted keys and fixed separators, so dict order and
    whitespace do not matter. JSON cannot tell a tuple from a list, nor ``{1: x}`` from ``{"1": x}``;
    anything it cannot encode (a ``Path``, a set) is a ``TypeError`` rather than a silent ``str()``.
    """
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:KEY_LENGTH]


def fingerprint_file(path: str | Path) -> str:
    """``sha256:<hex of the content>:<size in bytes>``, read in 1 MiB chunks.

    The content, not the modification time: copying or touching a dataset keeps its stores valid,
    and editing it in place (same size, same mtime) cannot go unnoticed. The size is redundant with
    the hash; it is there for a person reading ``meta.json``.
    """
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
    return f"sha256:{digest.hexdigest()}:{size}"


def is_committed(cache_dir: str | Path, key: str) -> bool:
    """Whether ``<cache_dir>/<key>`` is a complete store (it has the name only once it is complete)."""
    return (Path(cache_dir) / _check_name("key", key) / META_FILE).is_file()


def write_store(cache_dir: str | Path, key: str, splits: dict[str, SequenceArrays], summary: dict, meta: dict) -> Path:
    """Write a store and commit it as ``<cache_dir>/<key>``; return that path.

    Everything is written and fsynced under ``<key>.tmp-<host>-<pid>`` first and then renamed, so the
    final name never points at half a store, even after a power cut. ``meta`` gets ``shardtune_version``,
    ``created_at`` and ``host`` unless it has them. If another process committed the same key first,
    its store is kept (same key, same content) and ours is discarded.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / _check_name("key", key)
    for name, arrays in splits.items():
        _check_name("split name", name)
        if not isinstance(arrays, SequenceArrays):
            raise TypeError(f"split {name!r} is a {type(arrays).__name__}, not SequenceArrays")
    meta = {
        "shardtune_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        **meta,
    }
    # Encoded before anything touches the disk: data that cannot be stored fails without leftovers.
    texts = {SUMMARY_FILE: _dumps(summary, "summary"), META_FILE: _dumps(meta, "meta")}

    if is_committed(cache_dir, key):  # nothing to add: a committed store is never replaced
        logger.info("token store %s is already committed; keeping it", final)
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cache_dir / f"{key}.tmp-{_host_tag()}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)  # an earlier failed attempt of this very process
    try:
        temporary.mkdir()
        for name, arrays in splits.items():
            split_dir = temporary / name
            split_dir.mkdir()
            for field_name in (*TOKEN_FIELDS, "offsets"):
                with open(split_dir / f"{field_name}.npy", "wb") as handle:
                    np.save(handle, np.ascontiguousarray(getattr(arrays, field_name)), allow_pickle=False)
                    _flush(handle)
            _fsync_dir(split_dir)
        for file_name, text in texts.items():  # meta.json last: its presence marks a complete store
            with open(temporary / file_name, "w", encoding="utf-8") as handle:
                handle.write(text)
                _flush(handle)
        _fsync_dir(temporary)
        try:
            os.rename(temporary, final)
        except OSError as exc:
            # Linux refuses to rename onto a non-empty directory: someone else committed this key first.
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not is_committed(cache_dir, key):
                raise
            logger.info("token store %s was committed by another process first; keeping it", final)
            shutil.rmtree(temporary, ignore_errors=True)
            return final
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync_dir(cache_dir)  # makes the rename itself durable
    return final


def open_store(path: str | Path) -> TokenStore:
    """Open a committed store; its arrays are read-only memory maps (nothing is read until used)."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise DataError(f"{path}: not a token store (no {META_FILE}); was it built completely?")
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
        splits = {}
        # Only names write_store could have made: a stray hidden directory is not a split.
        for split_dir in sorted(p for p in path.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)):
            loaded = {
                name: np.load(split_dir / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                for name in (*TOKEN_FIELDS, "offsets")
            }
            splits[split_dir.name] = SequenceArrays(**loaded)
    except (OSError, ValueError) as exc:  # missing file, bad JSON, bad .npy header, inconsistent arrays
        raise DataError(f"{path}: damaged token store ({exc}); delete the directory to rebuild it") from None
    return TokenStore(path=path, splits=splits, summary=summary, meta=meta)


def build_once(
    cache_dir: str | Path,
    key: str,
    build: Callable[[], tuple[dict[str, SequenceArrays], dict, dict]],
    *,
    is_builder: bool,
    timeout_s: float,
    poll_s: float = 1.0,
    log: logging.Logger = logger,
) -> TokenStore:
    """The store ``<cache_dir>/<key>``: reused if committed, else built by exactly one process.

    ``build()`` returns ``(splits, summary, meta)`` for ``write_store``. A builder takes the lock
    ``<key>.lock``, checks again (whoever held the lock before may have just built the store), and
    otherwise builds and commits; several builders racing on one cache (two ``shardtune prepare`` runs)
    are therefore safe, and all but one reuse. A non-builder (every rank but the one chosen to build)
    never builds: it waits for the commit. Either kind of wait ends after ``timeout_s`` with a
    ``DataError`` naming the store and the process that holds the lock.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / _check_name("key", key)
    if is_committed(cache_dir, key):
        log.info("reusing token store %s", final)
        return open_store(final)
    if not is_builder:
        _wait_for_commit(cache_dir, key, timeout_s, poll_s, log)
        log.info("reusing token store %s", final)
        return open_store(final)

    cache_dir.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir / f"{key}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _acquire(fd, cache_dir, key, lock_path, timeout_s, poll_s, log):
            log.info("reusing token store %s", final)  # committed by the lock holder while we waited
            return open_store(final)
        try:
            # Tell waiting processes who builds (the lock itself cannot say).
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} {os.getpid()} {_now()}".encode(), 0)
            if is_committed(cache_dir, key):
                log.info("reusing token store %s", final)
                return open_store(final)
            _remove_stale_temporaries(cache_dir, key, log)
            log.info("building token store %s", final)
            started = time.perf_counter()
            failure = _failure_path(cache_dir, key)
            failure.unlink(missing_ok=True)
            try:
                if final.exists():
                    # Not left by write_store, which names a store only once it is complete: a copy cut short.
                    # Its rename onto it would fail after the whole build.
                    raise DataError(
                        f"{final}: damaged token store (no {META_FILE}); delete the directory to rebuild it"
                    )
                splits, summary, meta = build()
            except DataError as error:
                # The processes waiting for this store learn why it will never come (and say the same),
                # instead of waiting out their timeout.
                failure.write_text("\n".join(error.lines), encoding="utf-8")
                raise
            write_store(cache_dir, key, splits, summary, meta)
            sequences = sum(len(arrays) for arrays in splits.values())
            tokens = sum(len(arrays.input_ids) for arrays in splits.values())
            log.info(
                "built token store %s in %.1f s (%d sequences, %d tokens)",
                final,
                time.perf_counter() - started,
                sequences,
                tokens,
            )
            return open_store(final)
        finally:
            os.ftruncate(fd, 0)  # so no one names us as the builder once we are done
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(
    fd: int, cache_dir: Path, key: str, lock_path: Path, timeout_s: float, poll_s: float, log: logging.Logger
) -> bool:
    """Take the exclusive lock (True), or return False once the store is committed while waiting.

    Non-blocking attempts in a loop rather than one blocking ``flock``, which could not time out or
    report progress.
    """
    started = time.monotonic()
    next_log = started + LOG_EVERY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if is_committed(cache_dir, key):
            return False
        now = time.monotonic()
        if now - started >= timeout_s:
            raise DataError(
                f"token store {cache_dir / key}: could not take the build lock {lock_path} within {timeout_s:g} s; "
                f"it is held by {_describe_builder(lock_path)}"
            )
        if now >= next_log:
            log.info(
                "waiting for the build lock of token store %s, held by %s",
                cache_dir / key,
                _describe_builder(lock_path),
            )
            next_log = now + LOG_EVERY_S
        time.sleep(min(poll_s, max(timeout_s - (now - started), 0.0)))


def _wait_for_commit(cache_dir: Path, key: str, timeout_s: float, poll_s: float, log: logging.Logger) -> None:
    final = cache_dir / key
    lock_path = cache_dir / f"{key}.lock"
    started = time.monotonic()
    next_log = started + LOG_EVERY_S
    while not is_committed(cache_dir, key):
        failure = _failure_path(cache_dir, key)
        if failure.is_file():
            # Possibly left by an earlier build of the same inputs; the builder clears it before building
            # again. The inputs are those the store's name hashes, so it fails the same way again.
            raise DataError(failure.read_text(encoding="utf-8").splitlines())
        now = time.monotonic()
        if now - started >= timeout_s:
            raise DataError(
                f"token store {final} was not built within {timeout_s:g} s (builder: {_describe_builder(lock_path)}); "
                "check that process, or raise the timeout if the dataset is just large"
            )
        if now >= next_log:
            log.info("waiting for token store %s, built by %s", final, _describe_builder(lock_path))
            next_log = now + LOG_EVERY_S
        time.sleep(min(poll_s, max(timeout_s - (now - started), 0.0)))


def _failure_path(cache_dir: Path, key: str) -> Path:
    """Where a builder leaves the error that stopped it, for the processes waiting on the store."""
    return cache_dir / f"{key}.failed"


def _describe_builder(lock_path: Path) -> str:
    """``host pid started_at`` of the lock holder, ``unknown`` if none has said, and a note if it is gone.

    A holder that died leaves its line in the file but not the lock; a shared lock taken for an
    instant tells the two apart.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return "unknown"
    try:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder  # held: the holder is alive
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "unknown (no process holds the lock)" if holder == "unknown" else f"{holder} (no longer running)"
    finally:
        os.close(fd)


def _remove_stale_temporaries(cache_dir: Path, key: str, log: logging.Logger) -> None:
    """Remove ``<key>.tmp-*`` left by builders that crashed; only the lock holder may call this.

    Every builder writes while holding the lock, so while we hold it no temporary directory of this
    key belongs to a live writer.
    """
    prefix = f"{key}.tmp-"
    for entry in cache_dir.iterdir():
        if entry.name.startswith(prefix) and entry.is_dir():
            log.info("removing %s, left by an interrupted build", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _as_int_array(name: str, values: np.ndarray, dtype: type[np.integer]) -> np.ndarray:
    array = np.asanyarray(values)  # not asarray, which would turn an np.memmap into a plain ndarray view
    if array.ndim == 1 and array.dtype == dtype:
        return array
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a flat array of ints, got {array.dtype} with shape {array.shape}")
    info = np.iinfo(dtype)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"{name} has values outside {np.dtype(dtype).name} ({array.min()}..{array.max()})")
    return array.astype(dtype)


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid {what} {name!r}: use letters, digits, '_' and '-' ('-' not first)")
    return name


def _dumps(value: dict, what: str) -> str:
    try:
        return json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the store's {what} must be JSON-able: {exc}") from None


def _flush(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

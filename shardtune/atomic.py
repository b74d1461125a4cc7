"""Writing files so that a reader, a crash or a kill never sees half of one: write a sibling under a
temporary name, then rename it over the target (a rename within a directory is atomic on POSIX)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def temporary_sibling(path: Path, tag: str = "tmp") -> Path:
    """A hidden name next to ``path`` (same directory, same filesystem: the rename stays atomic), unique
    to this process."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def write_atomic(path: Path, text: str, durable: bool = False) -> None:
    """``path`` holds ``text``, or what it held before. ``durable``: on disk (fsync) before the rename,
    for files whose loss after a power cut would break what refers to them (a checkpoint's manifest)."""
    temporary = temporary_sibling(path)
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def replace_path(staging: Path, target: Path) -> None:
    """Put the finished ``staging`` (a file or a directory) in ``target``'s place. A rename puts a file over a
    file or a link, and a directory over nothing (or an empty directory) only: anything else at ``target`` (a
    non-empty directory, or a file or link where a directory goes) is first renamed aside, and removed only once
    the new one is in place, so at every moment ``target`` is the old or the new, whole."""
    real_directory = target.is_dir() and not target.is_symlink()
    if not os.path.lexists(target) or not (real_directory or staging.is_dir()):
        os.replace(staging, target)
        return
    aside = temporary_sibling(target, "old")
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(aside, target)
        raise
    if real_directory:
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink()


@contextlib.contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """A temporary sibling of ``target`` for the block to write a file into (a writer that takes a path, as
    matplotlib's does). Once the block completes, it replaces ``target`` (``replace_path``); on an error or Ctrl-C
    it is removed, and ``target`` is left as it was."""
    staging = temporary_sibling(target)
    try:
        yield staging
        replace_path(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A temporary sibling of ``target`` (not yet made) for the block to write a directory into. Once the block
    completes, it replaces ``target`` (``replace_path``); on an error or Ctrl-C it is removed, and ``target``
    is left as it was, with nothing half-written beside it."""
    staging = temporary_sibling(target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        replace_path(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

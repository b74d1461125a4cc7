"""The errors the command line reports as one line each, without a traceback, and their exit statuses.

Two families: ``InputError`` (bad input the user must fix: config keys, values, files, data rows; exit
status 2) and ``RunFault`` (a fault the run met, not the user's input: each kind has its own status, so
a script or scheduler can tell them apart). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import math

# The exit status of a process stopped by an InputError. A restart cannot fix such input, so the
# launcher does not restart workers that exit with it.
EXIT_BAD_INPUT = 2
# Training stopped: too many consecutive steps had a non-finite loss or gradient.
EXIT_NONFINITE = 3
# A checkpoint could not be written (a full disk, a read-only or vanished directory).
EXIT_SAVE_FAILED = 4
# A rank ran out of device memory (its allocator could not allocate); the same step would again.
EXIT_OUT_OF_MEMORY = 5
# A peer worker went away mid-collective without a word (killed, out of host memory, its node lost); this worker
# said so in one line. The launcher restarts it (``--max-restarts``): the next attempt may well get through.
EXIT_LOST_PEER = 6
# Stopped by Ctrl-C (SIGINT), as a shell reports a process that SIGINT ended: 128 + 2.
EXIT_INTERRUPTED = 130


class ReportedError(Exception):
    """An error the command line reports as its lines, one each, and ends with ``exit_code``."""

    exit_code = 1

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


class InputError(ReportedError):
    """Bad input; each line names the key, file or row and what was expected."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(InputError):
    """A config key or value the user must fix."""


class DataError(InputError):
    """A dataset file or row the user must fix."""


class RunFault(ReportedError):
    """A fault the run met (not bad input); each line says what happened and what to do. Every rank
    raises it together, so the launcher does not restart: the same fault would stop the next attempt."""

    every_rank_raises_it = True  # the ranks agreed on the words: global rank 0 says them


class NonFiniteError(RunFault):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""

    exit_code = EXIT_NONFINITE


class CheckpointSaveError(RunFault):
    """A checkpoint could not be written on some rank; every rank raises it together. The message
    names the failing rank(s) and the OS error."""

    exit_code = EXIT_SAVE_FAILED


class OutOfMemory(RunFault):
    """A rank ran out of device memory. It may be the only one: it says so itself (the first rank of a launch
    to meet it), and the launcher stops the others without a restart, which would run out again."""

    exit_code = EXIT_OUT_OF_MEMORY
    every_rank_raises_it = False


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (a library's message may go on for a traceback's length),
    or its type's name when it has none: what a one-line error quotes of its cause."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def first_and_last_line(error: BaseException) -> str:
    """``first_line``, and the message's last line after it when there are several: where a library ends a long
    message with its reason (datasets' and Arrow's "Couldn't cast ... because column names don't match")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return first_line(error) if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def positive_number_problem(option: str, value: float) -> str | None:
    """The line for a command-line number that must be positive (a count, seconds, GiB), or None when it is.
    argparse's ``float`` takes ``nan`` and ``inf`` too, which no count, wait or size can be."""
    if not math.isfinite(value):
        return f"{option}: must be a finite number, got {value}"
    return None if value > 0 else f"{option}: must be positive, got {value}"

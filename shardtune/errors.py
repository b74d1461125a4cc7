"""Errors caused by the user's input. The CLI prints them as one line each and exits with status 2;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

# The exit status of a process stopped by an InputError. A restart cannot fix such input, so the
# launcher does not restart workers that exit with it.
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """Bad input; each line names the key, file or row and what was expected."""

    def __init__(self, lines: list[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


class ConfigError(InputError):
    """A config key or value the user must fix."""


class DataError(InputError):
    """A dataset file or row the user must fix."""

"""The ``shardtune`` command's entry point (the console script and ``python -m shardtune``).

Every command first spends seconds importing torch and transformers (``shardtune.cli`` and the parsers it builds
import them). A Ctrl-C then, or at any later time a command does not handle itself (``train`` does: a checkpoint,
a resume line), ends with one line and exit 130, not the interpreter's traceback. So this module imports nothing
but the standard library and shardtune's light modules before it runs the command.
"""

from __future__ import annotations

import sys

from shardtune.errors import EXIT_INTERRUPTED
from shardtune.launch.local import end_with_the_launcher, exit_without_finalization, running_as_worker, say_once


def main(argv: list[str] | None = None) -> int:
    if running_as_worker():
        end_with_the_launcher()
    try:
        from shardtune.cli import main as run_command

        status = run_command(argv)
    except KeyboardInterrupt:
        say_once([f"shardtune: SIGINT: stopped ({_command_name(argv)})"], every_rank_says_it=True)
        status = EXIT_INTERRUPTED
    if argv is None or running_as_worker():  # the process's own command line (not a caller's): it ends here
        exit_without_finalization(status, worker=running_as_worker())
    return status


def _command_name(argv: list[str] | None) -> str:
    """The command of a command line that may not be parsed yet: its first word that is not an option."""
    words = sys.argv[1:] if argv is None else argv
    return next((word for word in words if not word.startswith("-")), "startup")

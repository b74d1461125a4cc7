"""The doctor's findings: one row per check, printed as an aligned table with what to fix below it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

OK, WARN, FAIL = "ok", "WARN", "FAIL"
GIB = 2**30


@dataclass(frozen=True)
class Check:
    """One finding. ``node`` is a node rank, or ``all`` for a finding about the whole run; ``fix`` says what
    to change when the status is not ok."""

    name: str
    status: str
    detail: str
    fix: str = ""
    node: str = "all"
    host: str = ""

    def on(self, node: str, host: str) -> Check:
        return replace(self, node=node, host=host)


def size(num_bytes: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``640 KiB``: the unit that keeps the number readable."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.0f} KiB"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def failed(checks: Sequence[Check]) -> bool:
    return any(check.status == FAIL for check in checks)


def format_report(checks: Sequence[Check]) -> str:
    """The table, the fixes for every row that is not ok, and a one-line verdict."""
    header = ("node", "host", "check", "status", "detail")
    rows = [header, *((c.node, c.host or "-", c.name, c.status, c.detail) for c in checks)]
    # The detail column is last and left ragged: it is the only long one.
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    lines = [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]) for row in rows
    ]
    problems = [check for check in checks if check.status != OK and check.fix]
    if problems:
        lines += ["", "to fix:"]
        lines += [f"  {c.status} {c.name}{'' if c.node == 'all' else f' (node {c.node})'}: {c.fix}" for c in problems]
    failures = sum(check.status == FAIL for check in checks)
    warnings = sum(check.status == WARN for check in checks)
    if failures or warnings:
        verdict = f"{failures} failed, {plural(warnings, 'warning')} in {len(checks)} checks"
    else:
        verdict = f"all {len(checks)} checks ok"
    lines += ["", f"shardtune doctor: {verdict}"]
    return "\n".join(lines)

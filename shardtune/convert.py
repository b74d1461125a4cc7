"""``shardtune convert``: turn a dataset with a prompt column and a response column into chat-messages
JSONL, the ``{"messages": [...]}`` layout ms-swift and most chat fine-tuning tools read.

Rows that cannot become a conversation are skipped and counted by reason rather than stopping the
conversion: a public dataset with a few broken rows is the common case, and the counts say how common.
A column name that no row has is a typo, not a data problem, and stops with the columns that do exist.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.atomic import staged_file
from shardtune.data.sources import BadRow, SourceSpec, iter_rows
from shardtune.errors import DataError, InputError
from shardtune.run_dir import check_output_path

# Columns listed in the "no row has a column" error; wide tables would bury the message.
_MAX_COLUMNS_SHOWN = 20


@dataclass
class ConvertReport:
    """What a conversion did. ``skipped_reasons`` maps a reason (``missing column 'output'``, ``not valid
    JSON``) to its count, most frequent first; ``first_skipped`` maps each reason to the location and full
    reason of the first row skipped for it, so the user can go and look."""

    written: int
    skipped: int
    skipped_reasons: dict[str, int]
    out: Path
    first_skipped: dict[str, str] = field(default_factory=dict)


def _reason_key(reason: str) -> str:
    """A bad row's reason without its detail: ``not valid JSON (Expecting value at column 5)`` counts as
    ``not valid JSON``, so rows broken the same way land in one bucket whatever the column."""
    return reason.split(" (", 1)[0]


def _skip_reason(row: dict, column: str) -> str | None:
    if column not in row:
        return f"missing column '{column}'"
    value = row[column]
    # Columnar sources (Parquet, datasets) give every row every column, with null where a value is absent.
    if value is None or (isinstance(value, str) and not value.strip()):
        return f"empty '{column}'"
    if not isinstance(value, str):
        return f"non-string '{column}'"
    return None


def _unknown_column_error(label: str, missing: list[str], columns: set[str]) -> DataError:
    names = sorted(columns)
    shown = ", ".join(f"'{name}'" for name in names[:_MAX_COLUMNS_SHOWN])
    if len(names) > _MAX_COLUMNS_SHOWN:
        shown += f" and {len(names) - _MAX_COLUMNS_SHOWN} more"
    lines = []
    for column in missing:
        line = f"{label}: no row has a column '{column}' (columns: {shown or 'none'})"
        close = difflib.get_close_matches(column, names, n=1)
        if close:
            line += f"; did you mean '{close[0]}'?"
        lines.append(line)
    return DataError(lines)


def convert_to_messages(
    source: SourceSpec,
    out: Path,
    input_col: str,
    output_col: str,
    system_prompt: str | None = None,
    limit: int | None = None,
    overwrite: bool = False,
) -> ConvertReport:
    """Write one ``{"messages": [system?, user, assistant]}`` line per convertible row of ``source``.

    A row converts when ``input_col`` and ``output_col`` hold strings that are not blank; their text is
    written unchanged (not stripped: leading whitespace can be content, e.g. in code). ``system_prompt``
    adds a system message to every conversation when given, even an empty one, since an explicit empty
    system prompt replaces a template's default in the tools that read this file. ``limit`` stops after
    that many rows are written. The file appears only when complete (written under a temporary name
    beside it, then renamed); if no row converts, nothing is written and ``DataError`` says why. An
    existing ``out`` is replaced only with ``overwrite``, and never when it is the source itself (or a run
    directory, or inside a checkpoint).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    out = Path(out)
    if out.is_dir():
        raise InputError(f"{out}: is a directory; --out needs a file name")
    local_source = Path(source.path)
    out = check_output_path(out, {local_source: "the input"} if local_source.exists() else {}, overwrite)
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []

    written = 0
    reasons: Counter[str] = Counter()
    first_skipped: dict[str, str] = {}
    columns: set[str] = set()
    has_column = {input_col: False, output_col: False}
    rows = iter_rows(source)  # before any file is made: a missing source leaves nothing behind
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with staged_file(out) as staging, open(staging, "w", encoding="utf-8", newline="\n") as handle:
            for row in rows:
                if isinstance(row, BadRow):
                    reason, detail = _reason_key(row.reason), row.reason
                else:
                    columns.update(row.data)
                    for column in has_column:
                        has_column[column] = has_column[column] or column in row.data
                    reason = _skip_reason(row.data, input_col) or _skip_reason(row.data, output_col)
                    detail = reason
                if reason is not None:
                    reasons[reason] += 1
                    first_skipped.setdefault(reason, f"{row.where}: {detail}")
                    continue
                messages = [
                    *system,
                    {"role": "user", "content": row.data[input_col]},
                    {"role": "assistant", "content": row.data[output_col]},
                ]
                handle.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
                written += 1
                if written == limit:
                    break
            if written == 0:
                missing = [column for column, seen in has_column.items() if not seen]
                if missing and columns:
                    raise _unknown_column_error(source.label, missing, columns)
                skipped = f"skipped {sum(reasons.values()):,}: {_format_reasons(_ordered(reasons))}"
                summary = f" ({skipped})" if reasons else ""
                raise DataError(f"{source.label}: no row to convert{summary}")
    finally:
        rows.close()

    ordered = _ordered(reasons)
    return ConvertReport(
        written=written,
        skipped=sum(ordered.values()),
        skipped_reasons=ordered,
        out=out,
        first_skipped={reason: first_skipped[reason] for reason in ordered},
    )


def _ordered(reasons: Counter[str]) -> dict[str, int]:
    # Most frequent first; ties by name, so the same data always prints the same line.
    return dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0])))


def _format_reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {count:,}" for reason, count in reasons.items())


def format_report(report: ConvertReport) -> str:
    """``wrote 1,234 rows to out.jsonl; skipped 5 (missing column 'output': 3, not valid JSON: 2)``."""
    line = f"wrote {report.written:,} row{'s' if report.written != 1 else ''} to {report.out}"
    if report.skipped:
        line += f"; skipped {report.skipped:,} ({_format_reasons(report.skipped_reasons)})"
    return line


def cmd_convert(args: argparse.Namespace) -> int:
    spec = SourceSpec(args.source, split=args.split, subset=args.subset)
    report = convert_to_messages(
        spec, args.out, args.input_col, args.output_col, args.system_prompt, args.limit, args.overwrite
    )
    print(format_report(report))
    # Where to look, on stderr so stdout stays the one summary line scripts may parse.
    for where in report.first_skipped.values():
        print(f"shardtune: first skipped: {where}", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_convert_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``convert`` on the ``shardtune`` sub-command parsers; returns its parser."""
    convert = commands.add_parser(
        "convert",
        help="turn a dataset into chat-messages JSONL (ms-swift's format)",
        description='Write one {"messages": [system?, user, assistant]} line per row with a non-empty input and '
        "output column; rows without are skipped and counted by reason.",
    )
    convert.add_argument(
        "source", help="a .jsonl, .json, .csv, .tsv or .parquet file, a directory of data files, or a hub id"
    )
    convert.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    convert.add_argument("--input-col", required=True, help="column holding the user's message")
    convert.add_argument("--output-col", required=True, help="column holding the assistant's reply")
    convert.add_argument("--system-prompt", default=None, help="a system message for every conversation")
    convert.add_argument("--split", default="train", help="split of a hub dataset or directory (default: train)")
    convert.add_argument("--subset", default=None, help="config name of a hub dataset")
    convert.add_argument("--limit", type=_positive_int, default=None, help="stop after writing N rows")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing --out (never the source)")
    convert.set_defaults(handler=cmd_convert)
    return convert

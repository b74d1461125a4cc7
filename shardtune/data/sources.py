"""Rows of a dataset source — a local JSONL, JSON, CSV/TSV or Parquet file, or a Hugging Face dataset — read lazily,
each with its exact location, so any message about a row can name it.

Reading never decides what a bad row means: a line that is not a JSON object comes back as a ``BadRow`` and
the caller chooses to stop (training) or to skip and count (conversion). Problems with the source as a
whole (a missing file, an unreadable format, a missing optional package) raise ``DataError``.

``pyarrow`` and ``datasets`` are optional and imported only when a source needs them: reading a JSONL file
must not cost the import time of either, nor require them installed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shardtune.errors import DataError, first_and_last_line
from shardtune.hub import not_cached_line, say_the_cache_serves, use_the_cache_if_the_hub_is_out_of_reach

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
# A spreadsheet's export: the first line names the columns; a field may hold line breaks inside quotes.
_DELIMITERS = {".csv": ",", ".tsv": "\t"}

_HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class SourceSpec:
    """Where rows come from.

    ``path`` is a local ``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet`` file, a local directory of data files
    (read by ``datasets`` as it reads a hub dataset), or a hub dataset id (``org/name`` or ``name``). ``split`` and
    ``subset`` (the hub's config name) apply to directories and hub datasets only.
    """

    path: str
    split: str = "train"
    subset: str | None = None
    weight: float = 1.0

    @property
    def label(self) -> str:
        """How messages name the source: the path of a file; ``org/name[train]`` or
        ``org/name[train, subset=NAME]`` for anything read through ``datasets``."""
        if _is_file_source(self.path):
            return self.path
        subset = f", subset={self.subset}" if self.subset is not None else ""
        return f"{self.path}[{self.split}{subset}]"


@dataclass(frozen=True)
class Row:
    """A row that is a JSON object (a CSV row: its header's names to its strings); ``where`` is ``file.jsonl:12`` or
    ``file.csv:12`` (the 1-based line it starts on), ``file.json:row 3`` or ``file.parquet:row 3`` (0-based index),
    or ``org/name[train]:row 5``."""

    data: dict
    where: str


@dataclass(frozen=True)
class BadRow:
    """A row that could not be read as a JSON object, and why (``not valid JSON (...)``, ``expected a JSON
    object, got list``, ``not valid UTF-8 (...)``)."""

    where: str
    reason: str


def is_local(path: str) -> bool:
    """Whether ``path`` names something on this machine rather than a hub dataset id.

    A known data-file suffix or a path-like start (``.``, ``/``, ``~``) is local even when missing, so a
    mistyped file name is reported as a missing file, not as a dataset the hub does not have.
    """
    return (
        path.lower().endswith(LOCAL_SUFFIXES)
        or path.startswith((".", "/", "~", os.sep))
        or os.path.isabs(path)
        or os.path.exists(os.path.expanduser(path))
    )


def _is_file_source(path: str) -> bool:
    """Local and not a directory: read by shardtune itself. Directories go through ``datasets``."""
    return is_local(path) and not os.path.isdir(os.path.expanduser(path))


def iter_rows(spec: SourceSpec) -> Generator[Row | BadRow, None, None]:
    """The source's rows in order, read as they are consumed.

    What can be known without reading rows (a missing file, an unsupported file type, a missing optional
    package, ``split``/``subset`` given for a file) raises ``DataError`` at the call; what needs reading
    (a file that is not JSON or Parquet at all, a dataset the hub does not have) raises while iterating.
    Close the generator (or exhaust it) to release the file.
    """
    if not _is_file_source(spec.path):
        datasets = _import_datasets(spec)
        return _iter_datasets(spec, datasets)
    path = _existing_file(spec)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path, spec.path)
    if suffix == ".json":
        return _iter_json(path, spec.path)
    if suffix in _DELIMITERS:
        return _iter_delimited(path, spec.path, _DELIMITERS[suffix])
    return _iter_parquet(path, spec.path, _import_pyarrow_parquet(spec.path))


def source_fingerprint(spec: SourceSpec) -> str:
    """A hex digest that changes when the rows may have changed, for cache keys.

    A local file: the sha256 of its bytes (streamed, so any size is fine; the path plays no part, so a
    moved file keeps its cache). A directory or hub dataset: ``datasets``' own content fingerprint of the
    loaded split, with the subset and split, hashed to the same form. Loading a hub dataset downloads and
    prepares it once; ``datasets`` caches it for the read that follows.
    """
    if _is_file_source(spec.path):
        digest = hashlib.sha256()
        with open(_existing_file(spec), "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()
    dataset = _load_dataset(spec, _import_datasets(spec))
    key = json.dumps(["datasets", dataset._fingerprint, spec.subset, spec.split])
    return hashlib.sha256(key.encode()).hexdigest()


def _existing_file(spec: SourceSpec) -> Path:
    if spec.subset is not None or spec.split != "train":
        # Silently reading the whole file when a split was asked for would train on the wrong rows.
        raise DataError(f"{spec.path}: split and subset apply to hub datasets and directories, not to a file")
    path = Path(os.path.expanduser(spec.path))
    if not path.exists():
        raise DataError(f"{spec.path}: no such file")
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise DataError(f"{spec.path}: unsupported file type (expected {', '.join(LOCAL_SUFFIXES)})")
    return path


def _object_or_reason(value: Any) -> str | None:
    """Why ``value`` cannot be a row, or None when it can."""
    if isinstance(value, dict):
        return None
    return f"expected a JSON object, got {_json_type_name(value)}"


def _json_type_name(value: Any) -> str:
    # The user wrote JSON, so name JSON's types rather than Python's (``null``, not ``NoneType``).
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _iter_jsonl(path: Path, name: str) -> Generator[Row | BadRow, None, None]:
    # Bytes, decoded line by line: one line of bad UTF-8 is one bad row, not the end of the file.
    with open(path, "rb") as handle:
        first = True  # the first line that holds anything
        for number, line, bad_utf8 in _decoded_lines(handle):
            where = f"{name}:{number}"
            if bad_utf8:
                yield BadRow(where, bad_utf8)
                continue
            if not line.strip():
                continue
            hint = _one_document_hint(line) if first else ""
            first = False
            try:
                # Without its line end, so an error at the end of the line reports this line's column.
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                detail = f"{exc.msg} at column {exc.colno}" + (f"; {hint}" if hint else "")
                yield BadRow(where, f"not valid JSON ({detail})")
                continue
            reason = _object_or_reason(value)
            if reason is not None and hint:
                reason += f" ({hint})"
            yield Row(value, where) if reason is None else BadRow(where, reason)


def _one_document_hint(first_line: str) -> str:
    """What a .jsonl file whose first line opens one JSON document (a list of rows, a row indented over several
    lines) is, for the reason its first bad row gives: each of its lines is a bad row, and none says why."""
    text = first_line.strip()
    if text.startswith("["):
        return "one JSON list of rows is JSON, not JSON Lines: name the file .json"
    if text == "{":
        return "JSON Lines holds each row on one line"
    return ""


def _iter_json(path: Path, name: str) -> Generator[Row | BadRow, None, None]:
    # A JSON document has no row boundaries before it is parsed, so the file is read whole.
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start + 1})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.msg == "Extra data":
            hint = "; one JSON object per line is JSON Lines: name the file .jsonl"
        raise DataError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}){hint}") from None
    if not isinstance(value, list):
        found = _json_type_name(value)
        if isinstance(value, dict):
            found = f"an object with keys {sorted(value)[:10]}"
        raise DataError(f"{name}: expected a JSON list of row objects at the top level, got {found}")
    for index, item in enumerate(value):
        where = f"{name}:row {index}"
        reason = _object_or_reason(item)
        yield Row(item, where) if reason is None else BadRow(where, reason)


def _iter_delimited(path: Path, name: str, delimiter: str) -> Generator[Row | BadRow, None, None]:
    # Python's csv module, not pandas or datasets: rows one at a time, each with the line it starts on (a quoted
    # field may span lines), and every value the text the file holds, never a number or a date guessed from it.
    with open(path, "rb") as handle:
        # strict: a quote that is never closed is an error, not a field holding the rest of the file.
        reader = csv.reader(_utf8_lines(handle, name), delimiter=delimiter, strict=True)
        start = 1  # the line the row being read starts on
        try:
            header = next(reader, None)
            if header is None:
                return
            if len(set(header)) < len(header) or "" in header:
                raise DataError(f"{name}:1: the header must name every column once (got {header}); fix the first line")
            start = reader.line_num + 1
            for fields in reader:
                where, start = f"{name}:{start}", reader.line_num + 1
                if not fields:
                    continue  # an empty line
                if len(fields) != len(header):
                    yield BadRow(where, f"{len(fields)} fields where the header names {len(header)}")
                    continue
                yield Row(dict(zip(header, fields, strict=True)), where)
        except csv.Error as exc:
            raise DataError(f"{name}:{start}: not readable as {path.suffix[1:].upper()} ({exc})") from None


def _decoded_lines(handle: BinaryIO) -> Generator[tuple[int, str, str | None], None, None]:
    """Each line of the file (line end kept) decoded on its own, as (1-based number, text, why it is not UTF-8 or
    None): bad UTF-8 is named by its line, which a decoder reading ahead in blocks could not say."""
    for number, raw in enumerate(handle, start=1):
        try:
            # Only the first line may carry a byte-order mark (editors and spreadsheets on Windows write one).
            yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8"), None
        except UnicodeDecodeError as exc:
            yield number, "", f"not valid UTF-8 ({exc.reason} at byte {exc.start + 1})"


def _utf8_lines(handle: BinaryIO, name: str) -> Generator[str, None, None]:
    """The file's lines as the csv module reads them; bad UTF-8 stops the read, naming its line (a CSV row may
    span lines, so one bad line cannot be skipped as a row)."""
    for number, line, bad_utf8 in _decoded_lines(handle):
        if bad_utf8:
            raise DataError(f"{name}:{number}: {bad_utf8}")
        yield line


def _import_pyarrow_parquet(name: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{name}: reading Parquet needs pyarrow: pip install pyarrow") from None
    return pq


def _iter_parquet(path: Path, name: str, pq: Any) -> Generator[Row | BadRow, None, None]:
    import pyarrow as pa

    index = 0
    try:
        # Record batches keep memory bounded by the batch, not by the file.
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                yield Row(row, f"{name}:row {index}")
                index += 1
    except pa.ArrowException as exc:
        raise DataError(f"{name}: not a readable Parquet file ({exc})") from None


def _import_datasets(spec: SourceSpec) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{spec.path}: reading hub datasets and directories needs datasets: pip install datasets"
        ) from None
    return datasets


def _load_dataset(spec: SourceSpec, datasets: Any) -> Any:
    path = os.path.expanduser(spec.path)
    out_of_reach = use_the_cache_if_the_hub_is_out_of_reach(path)
    if out_of_reach is not None:
        datasets.config.HF_HUB_OFFLINE = True  # datasets keeps its own copy of huggingface_hub's setting
    try:
        dataset = datasets.load_dataset(path, name=spec.subset, split=spec.split)
    except (datasets.exceptions.DatasetsError, ValueError, FileNotFoundError, ConnectionError) as exc:
        if out_of_reach is not None:
            fix = "name DIR in its place (a directory is read as the hub dataset is)"
            raise DataError(not_cached_line(spec.label, spec.path, out_of_reach, fix, dataset=True)) from None
        # Unknown dataset, split or subset, no network, unparsable data files: all fixed by the user.
        cause = f" ({first_and_last_line(exc.__cause__)})" if exc.__cause__ is not None else ""
        hint = ""
        if os.path.isdir(path) and isinstance(exc, datasets.exceptions.DatasetGenerationError):
            hint = "; the data files of a directory must share one format and the same columns, else name one file"
        raise DataError(f"{spec.label}: {first_and_last_line(exc)}{cause}{hint}") from None
    if out_of_reach is not None:
        say_the_cache_serves(out_of_reach)
    return dataset


def _iter_datasets(spec: SourceSpec, datasets: Any) -> Generator[Row | BadRow, None, None]:
    label = spec.label
    # Non-streaming on purpose: the prepared split is memory-mapped (rows are still read one at a time)
    # and has the content fingerprint that source_fingerprint reports.
    for index, row in enumerate(_load_dataset(spec, datasets)):
        yield Row(row, f"{label}:row {index}")

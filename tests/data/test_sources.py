"""Dataset sources: every kind of file, exact row locations, bad rows as values, missing files and packages,
content fingerprints, and local directories read through ``datasets``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, write_jsonl

from shardtune.data.sources import BadRow, Row, SourceSpec, is_local, iter_rows, source_fingerprint
from shardtune.errors import DataError


def read(path: Path | str, **spec) -> list[Row | BadRow]:
    return list(iter_rows(SourceSpec(str(path), **spec)))


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``datasets`` with its cache in the test's directory, so tests neither share nor leave prepared data."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def test_is_local():
    assert is_local("data/train.jsonl") and is_local("rows.JSON") and is_local("x.parquet")  # missing, by suffix
    assert is_local("rows.csv") and is_local("rows.tsv")
    assert is_local("./data") and is_local("../data") and is_local("/abs/data") and is_local("~/data")
    assert is_local(str(REPO / "examples"))  # exists, no suffix
    assert not is_local("tatsu-lab/alpaca") and not is_local("squad")


def test_jsonl_rows_with_lines_blank_lines_and_bad_rows(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b'{"a": 1}\n'
        b"\n"
        b'{"a": \n'
        b"[1, 2]\n"
        b"   \n"
        b'"text"\n'
        b'{"a": "\xc3\xa9t\xc3\xa9"}\r\n'  # CRLF line end is whitespace to JSON
        b"\xff\n"
        b'{"a": 3}'  # no final newline
    )
    assert read(path) == [
        Row({"a": 1}, f"{path}:1"),
        BadRow(f"{path}:3", "not valid JSON (Expecting value at column 7)"),
        BadRow(f"{path}:4", "expected a JSON object, got list"),
        BadRow(f"{path}:6", "expected a JSON object, got string"),
        Row({"a": "été"}, f"{path}:7"),
        BadRow(f"{path}:8", "not valid UTF-8 (invalid start byte at byte 1)"),
        Row({"a": 3}, f"{path}:9"),
    ]


def test_jsonl_location_uses_the_path_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}, {"a": 2}])
    assert [row.where for row in read("rows.jsonl")] == ["rows.jsonl:1", "rows.jsonl:2"]


def test_jsonl_byte_order_mark_is_ignored(tmp_path: Path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    assert read(path) == [Row({"a": 1}, f"{path}:1"), Row({"a": 2}, f"{path}:2")]


def test_jsonl_is_read_lazily(tmp_path: Path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}, {"a": 2}])
    rows = iter_rows(SourceSpec(str(path)))
    assert next(rows) == Row({"a": 1}, f"{path}:1")
    # A line added after the first row was read is still seen: the file was not read up front.
    with open(path, "a") as handle:
        handle.write('{"a": 3}\n')
    assert list(rows) == [Row({"a": 2}, f"{path}:2"), Row({"a": 3}, f"{path}:3")]


def test_json_list(tmp_path: Path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"a": 1}, 5, {"b": "ü"}, None]), encoding="utf-8")
    assert read(path) == [
        Row({"a": 1}, f"{path}:row 0"),
        BadRow(f"{path}:row 1", "expected a JSON object, got number"),
        Row({"b": "ü"}, f"{path}:row 2"),
        BadRow(f"{path}:row 3", "expected a JSON object, got null"),
    ]


def test_json_that_is_not_a_list_names_the_file(tmp_path: Path):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": [{"a": 1}]}))
    with pytest.raises(DataError) as caught:
        read(path)
    assert caught.value.lines == [
        f"{path}: expected a JSON list of row objects at the top level, got an object with keys ['data']"
    ]


def test_json_lines_in_a_json_file_gets_a_hint(tmp_path: Path):
    path = tmp_path / "lines.json"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(DataError) as caught:
        read(path)
    assert caught.value.lines == [
        f"{path}: not valid JSON (Extra data at line 2 column 1); one JSON object per line is JSON Lines: "
        "name the file .jsonl"
    ]


def test_one_json_document_in_a_jsonl_file_gets_a_hint_at_its_first_line(tmp_path: Path):
    """A list of rows saved as .jsonl (indented or on one line), or rows indented over several lines: every line is
    a bad row, and none but the first says why (the mirror of the hint above)."""
    rows = [{"instruction": "Add 1 and 1.", "output": "2"}] * 2
    as_json = "one JSON list of rows is JSON, not JSON Lines: name the file .json"
    cases = {
        "indented-list": (json.dumps(rows, indent=2), f"not valid JSON (Expecting value at column 2; {as_json})"),
        "one-line-list": (json.dumps(rows), f"expected a JSON object, got list ({as_json})"),
        "indented-row": (
            json.dumps(rows[0], indent=2),
            "not valid JSON (Expecting property name enclosed in double quotes at column 2; JSON Lines holds each "
            "row on one line)",
        ),
    }
    for name, (text, reason) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(f"\n{text}\n")  # the first line that holds anything names the document
        bad = read(path)
        assert bad[0] == BadRow(f"{path}:2", reason), name
        assert all(as_json not in row.reason and "one line" not in row.reason for row in bad[1:]), name


def test_parquet_rows_across_record_batches(tmp_path: Path):
    import pyarrow as pa  # a dev dependency: not skipped when missing
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    table = pa.table({"q": [f"q{i}" for i in range(5)], "n": [0, 1, None, 3, 4]})
    pq.write_table(table, path, row_group_size=2)  # three row groups: indices must run on across them
    rows = read(path)
    assert [row.where for row in rows] == [f"{path}:row {i}" for i in range(5)]
    assert rows[2] == Row({"q": "q2", "n": None}, f"{path}:row 2")
    assert [row.data["q"] for row in rows] == ["q0", "q1", "q2", "q3", "q4"]


def test_file_that_is_not_parquet(tmp_path: Path):
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match=rf"^{path}: not a readable Parquet file \("):
        read(path)


def test_missing_file_raises_at_the_call(tmp_path: Path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as caught:
        iter_rows(SourceSpec(str(path)))  # not even iterated
    assert caught.value.lines == [f"{path}: no such file"]
    with pytest.raises(DataError, match="no such file"):
        source_fingerprint(SourceSpec(str(path)))


def test_unsupported_file_type(tmp_path: Path):
    path = tmp_path / "rows.xlsx"
    path.write_bytes(b"PK")
    with pytest.raises(DataError) as caught:
        read(path)
    assert caught.value.lines == [f"{path}: unsupported file type (expected .jsonl, .json, .csv, .tsv, .parquet)"]


def test_csv_and_tsv_rows_are_their_headers_text_with_the_line_each_starts_on(tmp_path: Path):
    path = tmp_path / "rows.csv"
    path.write_bytes(
        "\ufeffinstruction,input,output\r\n".encode()  # a spreadsheet's export: a byte-order mark, CRLF
        + b"Add 1 and 2.,,3\r\n"
        + b'"Say ""hi"", then\r\na new line",x,007\r\n'  # quotes, a line break inside a field, digits kept as text
        + b"one,too many,fields,here\r\n"
        + b"\r\n"
        + "été,,é\r\n".encode()
        + b"short,row"  # no final line end
    )
    assert read(path) == [
        Row({"instruction": "Add 1 and 2.", "input": "", "output": "3"}, f"{path}:2"),
        Row({"instruction": 'Say "hi", then\r\na new line', "input": "x", "output": "007"}, f"{path}:3"),
        BadRow(f"{path}:5", "4 fields where the header names 3"),
        Row({"instruction": "été", "input": "", "output": "é"}, f"{path}:7"),
        BadRow(f"{path}:8", "2 fields where the header names 3"),
    ]
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("instruction\toutput\nAdd, then say, 1\t2\n")
    assert read(tsv) == [Row({"instruction": "Add, then say, 1", "output": "2"}, f"{tsv}:2")]


def test_a_csv_file_that_cannot_be_read_is_one_line(tmp_path: Path):
    path = tmp_path / "rows.csv"
    for content, line in [
        (b"a,a\n1,2\n", f"{path}:1: the header must name every column once (got ['a', 'a']); fix the first line"),
        (b"a,\n1,2\n", f"{path}:1: the header must name every column once (got ['a', '']); fix the first line"),
        (b"a,b\n1,2\n3,\xff\n", f"{path}:3: not valid UTF-8 (invalid start byte at byte 3)"),
        (b'a,b\n"1,2\n', f"{path}:2: not readable as CSV (unexpected end of data)"),  # a quote never closed
        (b'a,b\n1,2\n"x"y,z\n', f"{path}:3: not readable as CSV (',' expected after '\"')"),
    ]:
        path.write_bytes(content)
        with pytest.raises(DataError) as caught:
            read(path)
        assert caught.value.lines == [line]
    path.write_bytes(b"")
    assert read(path) == []


def test_split_or_subset_on_a_file_is_refused(tmp_path: Path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}])
    message = f"{path}: split and subset apply to hub datasets and directories, not to a file"
    for spec in ({"split": "test"}, {"subset": "en"}):
        with pytest.raises(DataError) as caught:
            read(path, **spec)
        assert caught.value.lines == [message]


def test_file_fingerprint_follows_content_not_path(tmp_path: Path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"a": 1}])
    same = write_jsonl(tmp_path / "b.jsonl", [{"a": 1}])
    fingerprint = source_fingerprint(SourceSpec(str(first)))
    assert len(fingerprint) == 64 and fingerprint == source_fingerprint(SourceSpec(str(same)))
    write_jsonl(first, [{"a": 2}])
    assert source_fingerprint(SourceSpec(str(first))) != fingerprint


def test_reads_local_files_without_optional_packages_installed(tmp_path: Path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}])
    script = (
        "import sys\n"
        "sys.modules['datasets'] = sys.modules['pyarrow'] = None  # any import of them now fails\n"
        "from shardtune.data.sources import SourceSpec, iter_rows\n"
        "from shardtune.errors import DataError\n"
        f"print([row.data for row in iter_rows(SourceSpec({str(path)!r}))])\n"
        f"for source in ('org/name', {str(tmp_path)!r}, {str(path.with_suffix('.parquet'))!r}):\n"
        "    try:\n"
        "        iter_rows(SourceSpec(source))\n"
        "    except DataError as exc:\n"
        "        print(exc)\n"
    )
    path.with_suffix(".parquet").write_bytes(b"")  # exists: the missing package is the error, not the file
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[{'a': 1}]",
        "org/name: reading hub datasets and directories needs datasets: pip install datasets",
        f"{tmp_path}: reading hub datasets and directories needs datasets: pip install datasets",
        f"{path.with_suffix('.parquet')}: reading Parquet needs pyarrow: pip install pyarrow",
    ]


def test_directory_is_read_through_datasets(tmp_path: Path, datasets_cache: Path):
    directory = tmp_path / "my_dataset"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", [{"q": "a", "n": 1}, {"q": "b", "n": 2}])
    write_jsonl(directory / "test.jsonl", [{"q": "c", "n": 3}])
    label = f"{directory}[train]"
    assert read(directory) == [Row({"q": "a", "n": 1}, f"{label}:row 0"), Row({"q": "b", "n": 2}, f"{label}:row 1")]
    assert read(directory, split="test") == [Row({"q": "c", "n": 3}, f"{directory}[test]:row 0")]
    assert datasets_cache.is_dir()  # prepared where the fixture said, not in the user's cache


def test_directory_fingerprint_follows_content_and_split(tmp_path: Path, datasets_cache: Path):
    directory = tmp_path / "my_dataset"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", [{"q": "a"}])
    write_jsonl(directory / "test.jsonl", [{"q": "a"}])
    train = source_fingerprint(SourceSpec(str(directory)))
    assert len(train) == 64
    assert source_fingerprint(SourceSpec(str(directory))) == train
    assert source_fingerprint(SourceSpec(str(directory), split="test")) != train
    write_jsonl(directory / "train.jsonl", [{"q": "a"}, {"q": "b"}])
    assert source_fingerprint(SourceSpec(str(directory))) != train


def test_unknown_split_of_a_directory(tmp_path: Path, datasets_cache: Path):
    directory = tmp_path / "my_dataset"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", [{"q": "a"}])
    rows = iter_rows(SourceSpec(str(directory), split="validation"))
    with pytest.raises(DataError) as caught:
        next(rows)
    assert caught.value.lines == [f"{directory}[validation]: Unknown split \"validation\". Should be one of ['train']."]


def test_a_directory_of_files_with_other_columns_is_one_line(tmp_path: Path, datasets_cache: Path):
    directory = tmp_path / "my_dataset"
    directory.mkdir()
    write_jsonl(directory / "a.jsonl", [{"instruction": "a", "output": "b"}])
    write_jsonl(directory / "b.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError) as caught:
        read(directory)
    assert caught.value.lines == [
        f"{directory}[train]: An error occurred while generating the dataset (Couldn't cast ... because column "
        "names don't match); the data files of a directory must share one format and the same columns, else name "
        "one file"
    ]


def test_unreachable_hub_dataset_is_a_data_error(datasets_cache: Path):
    # conftest sets HF_HUB_OFFLINE, so this never touches the network; the id is named with split and subset.
    with pytest.raises(DataError, match=r"^no-such-org/no-such-dataset\[train, subset=en\]: "):
        read("no-such-org/no-such-dataset", subset="en")

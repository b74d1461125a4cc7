"""``shardtune convert``: exact messages lines, skipped rows counted by reason, column typos refused, files
that appear only when complete, and the command's output."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, write_jsonl

import shardtune.convert as convert_module
from shardtune.convert import ConvertReport, add_convert_parser, convert_to_messages
from shardtune.data.sources import Row, SourceSpec
from shardtune.errors import DataError


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")


def test_rows_become_user_and_assistant_messages(tmp_path: Path):
    source = write_jsonl(
        tmp_path / "src.jsonl",
        [
            {"question": "Capital of France?", "answer": "Paris.", "id": 1},
            {"question": "  indented\n", "answer": "Grüße, 東京 ✓"},
        ],
    )
    out = tmp_path / "out.jsonl"
    report = convert_to_messages(SourceSpec(str(source)), out, "question", "answer")
    assert report == ConvertReport(written=2, skipped=0, skipped_reasons={}, out=out, first_skipped={})
    # Text is written as it was (not stripped), non-ASCII as itself, one line per row, newline-terminated.
    assert lines(out) == [
        '{"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]}',
        '{"messages": [{"role": "user", "content": "  indented\\n"}, '
        '{"role": "assistant", "content": "Grüße, 東京 ✓"}]}',
        "",
    ]
    assert not list(tmp_path.glob(".out.jsonl.*"))


def test_system_prompt_opens_every_conversation(tmp_path: Path):
    source = write_jsonl(tmp_path / "src.jsonl", [{"in": "hi", "out": "hello"}])
    out = tmp_path / "out.jsonl"
    convert_to_messages(SourceSpec(str(source)), out, "in", "out", system_prompt="Be brief.")
    assert json.loads(out.read_text()) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    # An explicit empty system prompt is kept: it overrides a chat template's default one.
    convert_to_messages(SourceSpec(str(source)), out, "in", "out", system_prompt="", overwrite=True)
    assert json.loads(out.read_text())["messages"][0] == {"role": "system", "content": ""}


def write_mixed_source(path: Path) -> Path:
    rows = [
        '{"in": "q1", "out": "a1"}',
        '{"in": "q2"}',  # 2: missing out
        '{"out": "a3"}',  # 3: missing in
        '{"in": "q4", "out": "   "}',  # 4: blank out
        '{"in": "q5", "out": null}',  # 5: null out
        '{"in": 6, "out": "a6"}',  # 6: non-string in
        '{"in": "q7", "out": ',  # 7: bad JSON
        "[1]",  # 8: not an object
        '{"in": "q9", "out": ["a9"]}',  # 9: non-string out
        '{"in": "q10"}',  # 10: missing out
        "nope",  # 11: bad JSON, another message
        '{"in": "q12", "out": "a12"}',
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_unconvertible_rows_are_skipped_and_counted_by_reason(tmp_path: Path):
    source = write_mixed_source(tmp_path / "src.jsonl")
    out = tmp_path / "out.jsonl"
    report = convert_to_messages(SourceSpec(str(source)), out, "in", "out")
    assert [json.loads(line)["messages"][1]["content"] for line in out.read_text().splitlines()] == ["a1", "a12"]
    assert report.written == 2 and report.skipped == 10
    # Most frequent first, ties by name; a bad row's detail does not split its bucket.
    assert list(report.skipped_reasons.items()) == [
        ("empty 'out'", 2),
        ("missing column 'out'", 2),
        ("not valid JSON", 2),
        ("expected a JSON object, got list", 1),
        ("missing column 'in'", 1),
        ("non-string 'in'", 1),
        ("non-string 'out'", 1),
    ]
    assert report.first_skipped == {
        "empty 'out'": f"{source}:4: empty 'out'",
        "missing column 'out'": f"{source}:2: missing column 'out'",
        "not valid JSON": f"{source}:7: not valid JSON (Expecting value at column 21)",
        "expected a JSON object, got list": f"{source}:8: expected a JSON object, got list",
        "missing column 'in'": f"{source}:3: missing column 'in'",
        "non-string 'in'": f"{source}:6: non-string 'in'",
        "non-string 'out'": f"{source}:9: non-string 'out'",
    }


def test_limit_counts_written_rows(tmp_path: Path):
    source = write_mixed_source(tmp_path / "src.jsonl")
    out = tmp_path / "out.jsonl"
    report = convert_to_messages(SourceSpec(str(source)), out, "in", "out", limit=1)
    assert (report.written, report.skipped) == (1, 0)  # stopped at row 1, before reading any bad one
    assert len(out.read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="limit must be at least 1, got 0"):
        convert_to_messages(SourceSpec(str(source)), out, "in", "out", limit=0)


def test_column_no_row_has_is_a_typo_error(tmp_path: Path):
    source = write_jsonl(tmp_path / "src.jsonl", [{"instruction": "q", "output": "a", "id": 1}, {"input": ""}])
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError) as caught:
        convert_to_messages(SourceSpec(str(source)), out, "instrution", "output")
    assert caught.value.lines == [
        f"{source}: no row has a column 'instrution' (columns: 'id', 'input', 'instruction', 'output'); "
        "did you mean 'instruction'?"
    ]
    with pytest.raises(DataError) as caught:
        convert_to_messages(SourceSpec(str(source)), out, "prompt", "response")
    assert caught.value.lines == [
        f"{source}: no row has a column '{column}' (columns: 'id', 'input', 'instruction', 'output')"
        for column in ("prompt", "response")
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src.jsonl"]  # no empty output, no .tmp


def test_nothing_convertible_is_an_error_not_an_empty_file(tmp_path: Path):
    source = tmp_path / "src.jsonl"
    source.write_text('{"in": "q", "out": ""}\nnot json\n{"in": "q", "out": " "}\n')
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError) as caught:
        convert_to_messages(SourceSpec(str(source)), out, "in", "out")
    assert caught.value.lines == [f"{source}: no row to convert (skipped 3: empty 'out': 2, not valid JSON: 1)"]
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl.*"))


def test_a_failed_conversion_leaves_the_previous_output_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def rows_then_failure(spec: SourceSpec):
        yield Row({"in": "q", "out": "a"}, "src:1")
        raise DataError("src: broken after the first row")

    monkeypatch.setattr(convert_module, "iter_rows", rows_then_failure)
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    with pytest.raises(DataError, match="broken after the first row"):
        convert_to_messages(SourceSpec("src.jsonl"), out, "in", "out", overwrite=True)
    assert out.read_text() == "previous\n"
    assert not list(tmp_path.glob(".out.jsonl.*"))


def test_missing_source_creates_nothing(tmp_path: Path):
    out = tmp_path / "new_dir" / "out.jsonl"
    with pytest.raises(DataError) as caught:
        convert_to_messages(SourceSpec(str(tmp_path / "nope.jsonl")), out, "in", "out")
    assert caught.value.lines == [f"{tmp_path / 'nope.jsonl'}: no such file"]
    assert not out.parent.exists()


def test_output_directory_is_created(tmp_path: Path):
    source = write_jsonl(tmp_path / "src.jsonl", [{"in": "q", "out": "a"}])
    out = tmp_path / "a" / "b" / "out.jsonl"
    assert convert_to_messages(SourceSpec(str(source)), out, "in", "out").written == 1
    assert out.is_file()


def test_parquet_source_with_nulls(tmp_path: Path):
    import pyarrow as pa  # a dev dependency: not skipped when missing
    import pyarrow.parquet as pq

    source = tmp_path / "src.parquet"
    pq.write_table(pa.table({"in": ["q0", "q1", None], "out": ["a0", None, "a2"]}), source)
    out = tmp_path / "out.jsonl"
    report = convert_to_messages(SourceSpec(str(source)), out, "in", "out")
    assert (report.written, report.skipped_reasons) == (1, {"empty 'in'": 1, "empty 'out'": 1})
    assert report.first_skipped == {
        "empty 'in'": f"{source}:row 2: empty 'in'",
        "empty 'out'": f"{source}:row 1: empty 'out'",
    }


def test_directory_source_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / "ds"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", [{"in": "q-train", "out": "a"}])
    write_jsonl(directory / "test.jsonl", [{"in": "q-test", "out": "a"}])
    out = tmp_path / "out.jsonl"
    assert convert_to_messages(SourceSpec(str(directory), split="test"), out, "in", "out").written == 1
    assert json.loads(out.read_text())["messages"][0] == {"role": "user", "content": "q-test"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shardtune")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_handler_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    source = write_mixed_source(tmp_path / "src.jsonl")
    out = tmp_path / "out.jsonl"
    args = parse(["convert", str(source), "--out", str(out), "--input-col", "in", "--output-col", "out"])
    assert args.handler(args) == 0
    captured = capsys.readouterr()
    assert captured.out == (
        f"wrote 2 rows to {out}; skipped 10 (empty 'out': 2, missing column 'out': 2, not valid JSON: 2, "
        "expected a JSON object, got list: 1, missing column 'in': 1, non-string 'in': 1, non-string 'out': 1)\n"
    )
    # Where to look goes to stderr, one line per reason, so stdout stays one line.
    assert captured.err.splitlines()[:2] == [
        f"shardtune: first skipped: {source}:4: empty 'out'",
        f"shardtune: first skipped: {source}:2: missing column 'out'",
    ]
    assert len(captured.err.splitlines()) == 7


def test_cli_options_reach_the_conversion(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    source = write_jsonl(tmp_path / "src.jsonl", [{"in": f"q{i}", "out": f"a{i}"} for i in range(1500)])
    out = tmp_path / "out.jsonl"
    args = parse(
        ["convert", str(source), "--out", str(out), "--input-col", "in", "--output-col", "out"]
        + ["--system-prompt", "Be brief.", "--limit", "1234"]
    )
    assert (args.split, args.subset) == ("train", None)
    assert args.handler(args) == 0
    assert capsys.readouterr() == (f"wrote 1,234 rows to {out}\n", "")
    first = json.loads(out.read_text().splitlines()[0])
    assert first["messages"][0] == {"role": "system", "content": "Be brief."}
    assert len(out.read_text().splitlines()) == 1234

    args = parse(
        ["convert", str(source), "--out", str(out), "--input-col", "in", "--output-col", "out", "--limit", "1"]
        + ["--overwrite"]
    )
    args.handler(args)
    assert capsys.readouterr().out == f"wrote 1 row to {out}\n"


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        parse(["convert", "src.jsonl", "--out", "o.jsonl", "--input-col", "in", "--output-col", "out", "--limit", "0"])
    assert exited.value.code == 2
    assert "argument --limit: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["convert", "src.jsonl", "--input-col", "in", "--output-col", "out"])  # --out is required
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_convert_never_overwrites_its_source_and_replaces_an_output_only_with_overwrite(tmp_path: Path, capsys):
    from shardtune.cli import main

    source = write_jsonl(tmp_path / "qa.jsonl", [{"in": "q", "out": "a"}])
    original = source.read_text()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "shardtune", "convert", str(source), "--out", str(source)]
    columns = ["--input-col", "in", "--output-col", "out"]
    result = subprocess.run([*command, *columns, "--overwrite"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == f"shardtune: error: --out {source}: is the input {source}; choose another --out\n"
    assert source.read_text() == original

    out = tmp_path / "out.jsonl"
    out.write_text("mine\n")
    assert main(["convert", str(source), "--out", str(out), *columns]) == 2
    assert capsys.readouterr().err == (
        f"shardtune: error: --out {out}: already exists; choose another path, or pass --overwrite to replace it\n"
    )
    assert out.read_text() == "mine\n"
    assert main(["convert", str(source), "--out", str(out), *columns, "--overwrite"]) == 0
    assert json.loads(out.read_text())["messages"][1] == {"role": "assistant", "content": "a"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl", "qa.jsonl"]

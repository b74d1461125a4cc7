"""The pipeline as a whole: bad rows in both modes, mixing, summaries, and the cached token store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
from conftest import REPO, make_config, write_jsonl

from shardtune.data import prepare as prepare_module
from shardtune.data.prepare import prepare_dataset
from shardtune.errors import DataError

GOOD = [{"instruction": f"Add {i} and 1.", "input": "", "output": f"{i} plus 1 is {i + 1}."} for i in range(12)]


def _bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(row) for row in GOOD[:4]]
    lines.insert(1, '{"instruction": "broken", ')  # line 2: bad JSON
    lines.insert(3, json.dumps({"instruction": "no output"}))  # line 4: missing field
    lines.insert(5, json.dumps({"instruction": "blank", "output": " "}))  # line 6: empty response
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_row_stops_preparation_with_file_and_line(tmp_path, tokenizer):
    path = _bad_file(tmp_path)
    config = make_config(tmp_path, path)
    with pytest.raises(DataError) as error:
        prepare_dataset(config, tokenizer)
    assert str(error.value).startswith(f"{path}:2: not valid JSON")
    assert "data.on_bad_row: skip" in str(error.value)
    assert not any((tmp_path / "cache").glob("*/summary.json")), "nothing may be committed"


def test_bad_rows_skipped_and_counted(tmp_path, tokenizer):
    path = _bad_file(tmp_path)
    config = make_config(tmp_path, path, data={"on_bad_row": "skip"}, training={"per_device_train_batch_size": 1})
    data = prepare_dataset(config, tokenizer)
    summary = data.summary
    assert summary["rows_read"] == 7
    assert sum(summary["bad_rows"].values()) == 3
    assert summary["bad_row_locations"]["missing field 'output' (fields: ['instruction'])"] == [f"{path}:4"]
    assert summary["bad_row_locations"]["empty response in 'output'"] == [f"{path}:6"]
    assert summary["train"]["kept"] == len(data.train) == 4
    stored = json.loads((data.store / "summary.json").read_text())
    assert stored["bad_rows"] == summary["bad_rows"]


def test_bad_rows_of_an_eval_file_are_counted_with_the_rows_read_not_as_trains(tmp_path, tokenizer):
    from shardtune.data.prepare import describe

    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [GOOD[0], {"instruction": "no output"}])
    config = make_config(tmp_path, train, data={"eval_path": str(evaluation), "on_bad_row": "skip"})
    line = describe(prepare_dataset(config, tokenizer).summary)
    assert line.startswith("14 rows read (1 bad); train: 12 examples kept (0 truncated, dropped none), "), line
    assert line.endswith(f"; eval: 1 examples; rows dropped: bad row (missing field 'output' (fields: "
                         f"['instruction'])): {evaluation}:2")  # fmt: skip


def no_example_line(tmp_path: Path, tokenizer, train: Path, **data) -> list[str]:
    with pytest.raises(DataError) as error:
        prepare_dataset(make_config(tmp_path, train, data=data), tokenizer)
    return error.value.lines


def test_no_training_example_counts_the_training_sources_rows_and_names_the_setting_to_change(tmp_path, tokenizer):
    """The rows of data.eval_path are not the training sources' (an empty one read as "of 12 rows read: ;"), and rows
    that are all good but all held out or weighted away are not rows to fix."""
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    one = write_jsonl(tmp_path / "one.jsonl", GOOD[:1])
    assert no_example_line(tmp_path, tokenizer, empty, eval_path=str(good)) == [
        f"{empty}: no training example left of 0 rows read: the file holds no rows; fix or replace the rows"
    ]
    assert no_example_line(tmp_path, tokenizer, one, eval_split_ratio=0.05) == [
        f"{one}: no training example left of 1 rows read: 1 held out for evaluation (data.eval_split_ratio); lower "
        "data.eval_split_ratio (0.05: it holds out at least one row of each source), or name an eval file in "
        "data.eval_path"
    ]
    assert no_example_line(tmp_path, tokenizer, good, dataset_weights=[0.01]) == [
        f"{good}: no training example left of 12 rows read: no row selected by data.dataset_weights; raise "
        "data.dataset_weights"
    ]


def test_evaluation_asked_for_with_no_eval_example_is_one_line_with_the_reasons(tmp_path, tokenizer):
    """data.eval_path or data.eval_split_ratio, and not one example left to evaluate: the run used to go on without
    an evaluation, saying only "eval: 0 examples"."""
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    too_long = {"instruction": "word " * 300, "output": "cut off"}
    long_rows = write_jsonl(tmp_path / "long.jsonl", [too_long] * 2)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "no output"}])
    leave_out = "or leave data.eval_path out to train without evaluation"
    assert no_example_line(tmp_path, tokenizer, good, eval_path=str(empty)) == [
        f"{empty}: no eval example left of 0 rows read: the file holds no rows; fix or replace the rows, {leave_out}"
    ]
    assert no_example_line(tmp_path, tokenizer, good, eval_path=str(long_rows), truncation="drop") == [
        f"{long_rows}: no eval example left of 2 rows read: 2 longer than data.max_length with data.truncation: drop "
        f"(first: {long_rows}:1); fix or replace the rows, or raise data.max_length (128), {leave_out}"
    ]
    assert no_example_line(tmp_path, tokenizer, good, eval_path=str(bad), on_bad_row="skip") == [
        f"{bad}: no eval example left of 1 rows read: 1 bad (missing field 'output' (fields: ['instruction'])) "
        f"(first: {bad}:1); fix or replace the rows, {leave_out}"
    ]
    # Seed 0 holds out the second row of two: the one too long.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], too_long])
    assert no_example_line(tmp_path, tokenizer, mixed, eval_split_ratio=0.5) == [
        f"{mixed}: no eval example left of the 1 rows data.eval_split_ratio held out: 1 no target token left (e.g. "
        f"the response cut off by data.max_length) (first: {mixed}:2); fix or replace the rows, or raise "
        "data.max_length (128), or set data.eval_split_ratio: 0 to train without evaluation"
    ]


def test_unknown_role_in_messages_names_the_line(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = make_config(tmp_path, path, data={"format": "messages"})
    with pytest.raises(DataError, match=rf"{path}:2: message 1: unknown role 'bot'"):
        prepare_dataset(config, tokenizer)


def test_a_null_value_is_named_null_not_missing(tmp_path, tokenizer):
    """Parquet gives every row every column, null where a row has no value: the row has the field, it is null."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD[0], {**GOOD[1], "output": None}]), path)
    with pytest.raises(DataError) as error:
        prepare_dataset(make_config(tmp_path, path), tokenizer)
    assert error.value.lines == [f"{path}:row 1: field 'output' is null (set data.on_bad_row: skip to skip such rows)"]


def test_a_csv_file_trains_on_what_its_jsonl_twin_does(tmp_path, tokenizer, capsys):
    """The same rows as CSV (a spreadsheet's export: quotes, a comma and a line break in a field) and as JSONL give
    the same sequences; ``shardtune prepare`` reads the CSV from the command line."""
    import csv

    from shardtune.cli import main

    rows = [*GOOD, {"instruction": 'Say "a, b"\nthen stop.', "input": "", "output": "a, b"}]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    with open(tmp_path / "rows.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(rows)
    by_source = {}
    for path in (jsonl, tmp_path / "rows.csv"):
        data = prepare_dataset(make_config(tmp_path, path, data={"eval_split_ratio": 0.0}), tokenizer)
        by_source[path.suffix] = [data.train.sequence(i)[0].tolist() for i in range(len(data.train))]
    assert len(by_source[".csv"]) == len(rows) and by_source[".csv"] == by_source[".jsonl"]
    config = REPO / "examples/quickstart.yaml"
    overrides = [f"data.dataset_path={tmp_path / 'rows.csv'}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["prepare", str(config), *overrides, "data.eval_split_ratio=0"]) == 0
    assert f"{len(rows)} rows read; train: {len(rows)} examples kept" in capsys.readouterr().out


def test_prepare_into_a_cache_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """The line train and doctor say of the same data.cache_dir, not mkdir's traceback; the file stays as it was."""
    from shardtune.cli import main

    cache = tmp_path / "cache"
    cache.write_text("a file, not a directory\n")
    assert main(["prepare", str(REPO / "examples/quickstart.yaml"), f"data.cache_dir={cache / 'tokens'}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardtune: error: data.cache_dir: cannot write {cache / 'tokens'} (Not a directory); set data.cache_dir to "
        "a directory this user can create and write (on every node)"
    ]
    assert cache.read_text() == "a file, not a directory\n"


def test_mixing_weights_and_several_sources(tmp_path, tokenizer):
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"plain text number {i}"} for i in range(8)])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": f"parquet row {i}"} for i in range(6)]), tmp_path / "c.parquet")
    config = make_config(
        tmp_path,
        b,
        data={"dataset_path": [str(b), str(tmp_path / "c.parquet")], "dataset_weights": [2.0, 0.5], "format": "text"},
    )
    data = prepare_dataset(config, tokenizer)
    assert data.summary["train"]["kept"] == 8 * 2 + 3
    assert [source["rows"] for source in data.summary["sources"]] == [8, 6]


def test_store_is_reused_and_rebuilt_when_an_input_changes(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "train.jsonl", GOOD)
    builds = []
    real_build = prepare_module.build_splits
    monkeypatch.setattr(prepare_module, "build_splits", lambda *a: builds.append(1) or real_build(*a))
    config = make_config(tmp_path, path, training={"per_device_train_batch_size": 1})
    first = prepare_dataset(config, tokenizer)
    again = prepare_dataset(config, tokenizer)
    assert len(builds) == 1 and again.store == first.store
    assert again.train.input_ids.tolist() == first.train.input_ids.tolist()

    def changed(**sections):
        return make_config(tmp_path, path, **{"training": {"per_device_train_batch_size": 1}, **sections})

    variants = {
        "max_length": (changed(data={"max_length": 64}), tokenizer),
        "packing": (changed(data={"packing": True}), tokenizer),
        "train_on_prompt": (changed(data={"train_on_prompt": True}), tokenizer),
        "truncation": (changed(data={"truncation": "drop"}), tokenizer),
        "seed": (changed(training={"per_device_train_batch_size": 1, "seed": 7}), tokenizer),
        "eval split": (changed(data={"eval_split_ratio": 0.25}), tokenizer),
    }
    other_tokenizer = deepcopy(tokenizer)
    other_tokenizer.chat_template = "{{ messages }}"
    variants["template"] = (config, other_tokenizer)
    vocab_tokenizer = deepcopy(tokenizer)
    vocab_tokenizer.add_tokens(["<extra>"])
    variants["tokenizer"] = (config, vocab_tokenizer)
    stores = {first.store}
    for name, (variant, tok) in variants.items():
        store = prepare_dataset(variant, tok).store
        assert store not in stores, f"changing {name} must give a new store"
        stores.add(store)
    # The source file's content is hashed, not its name or date.
    path.write_text(path.read_text().replace("plus", "and"))
    assert prepare_dataset(config, tokenizer).store not in stores
    assert len(builds) == 2 + len(variants)


def test_two_prepare_commands_racing_build_once(tmp_path):
    """Two processes prepare one config on one cache at once: one builds, the other waits and reuses."""
    cache = tmp_path / "cache"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "shardtune", "prepare", "examples/quickstart.yaml", f"data.cache_dir={cache}"]
    processes = [
        subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    logs = [err for _, err in outputs]
    assert sum("building token store" in log for log in logs) == 1
    assert sum("reusing token store" in log for log in logs) == 1
    assert outputs[0][0].splitlines()[0] == outputs[1][0].splitlines()[0]  # the same store path
    assert len([entry for entry in cache.iterdir() if entry.is_dir()]) == 1

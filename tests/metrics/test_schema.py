"""The log schema: what it accepts and rejects, and docs/logs.md documents every field as the code defines it."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardtune.metrics.schema import (
    EVAL_FIELDS,
    EXPERT_USAGE_FIELDS,
    LAYER_FIELDS,
    NONFINITE_FIELDS,
    SCHEMA_VERSION,
    TRAIN_FIELDS,
    make_row,
    markdown_table,
    validate,
)


def eval_row(**changes) -> dict:
    row = {"schema_version": SCHEMA_VERSION, "step": 4, "eval_loss": 2.5, "eval_perplexity": 12.18,
           "eval_tokens": 100, "eval_time_s": 0.5}  # fmt: skip
    return {**row, **changes}


def test_a_complete_row_passes_and_make_row_adds_version_and_step():
    validate("eval", eval_row())
    values = {key: value for key, value in eval_row().items() if key not in ("step", "schema_version")}
    assert make_row("eval", 4, values) == eval_row()


def test_every_problem_of_a_row_is_named():
    row = eval_row(eval_tokens=1.5, extra=1)
    del row["eval_time_s"]
    with pytest.raises(ValueError) as error:
        validate("eval", row)
    assert str(error.value) == (
        "eval_log.jsonl row of step 4: extra: not a field of the schema; eval_tokens: expected int, got 1.5; "
        "eval_time_s: missing"
    )
    with pytest.raises(ValueError, match="step: expected int, got True"):
        validate("eval", eval_row(step=True))
    with pytest.raises(ValueError, match="eval_loss: null"):
        validate("eval", eval_row(eval_loss=None))
    with pytest.raises(ValueError, match="schema_version: 0, this shardtune writes 1"):
        validate("eval", eval_row(schema_version=0))


def test_nullable_optional_and_nested_fields():
    train = {field.name: 1.0 for field in TRAIN_FIELDS if not field.optional}
    ints = ("schema_version", "step", "interval_steps", "tokens", "target_tokens", "slowest_rank")
    train.update({name: 1 for name in ints}, slowest_host="node0", mfu=None)
    validate("train", train)  # MFU unknown (CPU), MoE fields absent
    with pytest.raises(ValueError, match="slowest_host: expected str"):
        validate("train", {**train, "slowest_host": 3})
    layer = {"layer": 0, "counts": [3, 1], "max_mean_ratio": 1.5, "entropy": 0.6, "normalized_entropy": 0.9}
    usage = {"schema_version": 1, "step": 2, "tokens": 2, "top_k": 2, "num_experts": 2, "balance_loss": 2.0,
             "layers": [layer]}  # fmt: skip
    validate("expert_usage", usage)
    with pytest.raises(ValueError, match=r"layers\[1\]\.counts: expected list\[int\], got \[1\.5\]"):
        validate("expert_usage", {**usage, "layers": [layer, {**layer, "counts": [1.5]}]})


def test_docs_describe_every_field_as_the_code_does():
    docs = (REPO / "docs" / "logs.md").read_text()
    for fields in (TRAIN_FIELDS, EVAL_FIELDS, EXPERT_USAGE_FIELDS, LAYER_FIELDS, NONFINITE_FIELDS):
        assert markdown_table(fields) in docs
    assert f"schema version {SCHEMA_VERSION}" in docs


def test_read_rows_names_the_file_line_and_what_a_bad_row_lacks(tmp_path):
    from shardtune.errors import InputError
    from shardtune.metrics.schema import read_rows

    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": NaN}\n')
    assert [row["step"] for row in read_rows(log, "a log row")] == [1, 2]
    for line, problem in [('{"loss": 2.0}', "step: expected int, got None"), ("[1, 2]", "expected a JSON object"),
                          ('{"step": 3', "Expecting")]:  # fmt: skip
        log.write_text('{"step": 1}\n' + line + "\n")
        with pytest.raises(InputError) as error:
            read_rows(log, "a log row")
        assert f"{log}:2: not a log row ({problem}" in str(error.value)
    usage = tmp_path / "expert_usage.jsonl"
    usage.write_text('{"step": 1, "layers": [{"layer": 0, "counts": [3, "x"]}]}\n')
    with pytest.raises(InputError, match=r"expert_usage.jsonl:1: not a record \(layers\[0\].counts: expected"):
        read_rows(usage, "a record", needs_layers=True)


def test_a_log_line_cut_short_by_a_kill_is_dropped_on_resume_and_earlier_rows_kept(tmp_path):
    from shardtune.metrics.sinks import JsonlSink

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    (logs / "eval_log.jsonl").write_text('{"step": 2, "eval_loss": 1.0}\n')
    JsonlSink(logs, resume_step=2).close()
    assert (logs / "train_log.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    assert (logs / "eval_log.jsonl").read_text() == '{"step": 2, "eval_loss": 1.0}\n'
    # A run that starts afresh keeps no old row, and does not stop on old rows it cannot read.
    (logs / "train_log.jsonl").write_text("not json\n")
    JsonlSink(logs, resume_step=0).close()
    assert (logs / "train_log.jsonl").read_text() == ""

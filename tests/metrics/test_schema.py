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

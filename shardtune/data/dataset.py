"""Read the configured dataset files and turn them into tokenized train and eval examples."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from shardtune.config import DataConfig, TrainingConfig
from shardtune.data.alpaca import render_alpaca
from shardtune.data.tokenize import ExampleTokenizer, TokenizedExample
from shardtune.errors import DataError

log = logging.getLogger(__name__)

ALPACA_REQUIRED = ("instruction", "output")


@dataclass
class DataSummary:
    rows_read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    tokens: int = 0
    target_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "rows_read": self.rows_read,
            "kept": self.kept,
            "truncated": self.truncated,
            "dropped": dict(self.dropped),
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
        }


@dataclass
class PreparedData:
    train: list[TokenizedExample]
    eval: list[TokenizedExample]
    train_summary: DataSummary
    eval_summary: DataSummary | None


def read_alpaca_jsonl(path: str | Path) -> list[dict]:
    """Rows of an alpaca JSONL file; any malformed row stops with file:line and the reason."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in ALPACA_REQUIRED:
                if not isinstance(row.get(key), str):
                    raise DataError(f"{where}: alpaca row needs a string field '{key}' (fields: {sorted(row)})")
            if not isinstance(row.get("input", ""), (str, type(None))):
                raise DataError(f"{where}: alpaca field 'input' must be a string")
            if not row["output"].strip():
                raise DataError(f"{where}: empty 'output' (nothing to train on)")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def tokenize_rows(rows: list[dict], tokenizer: ExampleTokenizer) -> tuple[list[TokenizedExample], DataSummary]:
    summary = DataSummary(rows_read=len(rows))
    examples = []
    for row in rows:
        text = render_alpaca(row)
        example, truncated = tokenizer(text.prompt, text.response)
        summary.truncated += truncated
        if example is None:
            summary.dropped["no_target_tokens_after_truncation"] += 1
            continue
        examples.append(example)
        summary.tokens += len(example.input_ids)
        summary.target_tokens += example.num_targets
    summary.kept = len(examples)
    return examples, summary


def prepare_data(data: DataConfig, training: TrainingConfig, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Train and eval examples as configured.

    Order of selection: ``subset_size`` picks a seeded sample of the file's rows, then
    ``eval_split_ratio`` holds out a seeded share of those, then ``eval_subset_size`` picks a seeded,
    fixed subset of the eval rows, so every evaluation of a run sees the same examples.
    """
    rows = read_alpaca_jsonl(data.dataset_path)
    rng = random.Random(training.seed)
    if data.subset_size is not None and data.subset_size < len(rows):
        rows = [rows[i] for i in sorted(rng.sample(range(len(rows)), data.subset_size))]
    eval_rows: list[dict] = []
    if data.eval_path:
        eval_rows = read_alpaca_jsonl(data.eval_path)
    elif data.eval_split_ratio > 0:
        held_out = set(rng.sample(range(len(rows)), max(1, round(len(rows) * data.eval_split_ratio))))
        eval_rows = [row for i, row in enumerate(rows) if i in held_out]
        rows = [row for i, row in enumerate(rows) if i not in held_out]
    if training.eval_subset_size is not None and training.eval_subset_size < len(eval_rows):
        chosen = random.Random(training.seed + 1).sample(range(len(eval_rows)), training.eval_subset_size)
        eval_rows = [eval_rows[i] for i in sorted(chosen)]

    example_tokenizer = ExampleTokenizer(tokenizer, data.max_length)
    train, train_summary = tokenize_rows(rows, example_tokenizer)
    eval_examples, eval_summary = tokenize_rows(eval_rows, example_tokenizer) if eval_rows else ([], None)
    if not train:
        raise DataError(f"{data.dataset_path}: no example has a response token left within max_length")
    return PreparedData(train, eval_examples, train_summary, eval_summary)

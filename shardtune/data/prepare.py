"""The data pipeline: sources -> rows -> rendered segments -> tokens -> packed or single sequences,
written once to a token store keyed by everything that can change its content.

Selection order (all seeded by ``training.seed``): each source's rows are read and rendered
(bad rows stop preparation, or are skipped and counted); a held-out share of each source becomes
eval data (``data.eval_split_ratio``) unless ``data.eval_path`` names an eval file; each source's
training rows are repeated or sampled by its weight (2.0: every row twice, 0.5: a seeded half);
``data.subset_size`` then samples the training rows and ``training.eval_subset_size`` the eval rows,
so every evaluation of a run sees the same examples.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune import __version__
from shardtune.config import Config
from shardtune.data.formats import Rendered, RowError, render_row
from shardtune.data.packing import pack_examples, unpacked
from shardtune.data.sources import BadRow, SourceSpec, iter_rows, source_fingerprint
from shardtune.data.store import SequenceArrays, TokenStore, build_once, store_key
from shardtune.data.tokenize import ExampleTokenizer, Outcome
from shardtune.errors import DataError

log = logging.getLogger("shardtune")

# Bump when a change to this package changes the tokens (or the summary) it produces for the same inputs.
PIPELINE_VERSION = 2
TOKENIZE_CHUNK = 1024


@dataclass
class SplitSummary:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    dropped_rows: dict[str, list[str]] = field(default_factory=dict)  # reason -> the rows (file:line) dropped
    tokens: int = 0
    target_tokens: int = 0
    sequences: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "kept": self.kept,
            "truncated": self.truncated,
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_rows": dict(sorted(self.dropped_rows.items())),
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "sequences": self.sequences,
        }


@dataclass
class PreparedData:
    train: SequenceArrays
    eval: SequenceArrays
    summary: dict[str, Any]
    store: Path


@dataclass
class _Example:
    rendered: Rendered | None  # None: read, not rendered (no tokenizer)
    where: str


class _RowReader:
    """Reads and renders rows, applying ``data.on_bad_row`` and counting what it skipped. Without a tokenizer
    rows are read but not rendered (``shardtune plan`` counts rows where the model's tokenizer is not at hand)."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None):
        self.data = config.data
        self.tokenizer = tokenizer
        self.rows_read = 0
        self.bad_rows: Counter = Counter()
        self.bad_row_locations: dict[str, list[str]] = {}

    def read(self, spec: SourceSpec) -> list[_Example]:
        examples = []
        for row in iter_rows(spec):
            self.rows_read += 1
            if isinstance(row, BadRow):
                self._bad(row.where, row.reason)
                continue
            if self.tokenizer is None:
                examples.append(_Example(None, row.where))
                continue
            try:
                rendered = render_row(
                    row.data, self.data.format, self.data.columns, self.tokenizer, self.data.train_on_prompt
                )
            except RowError as exc:
                self._bad(row.where, str(exc))
                continue
            examples.append(_Example(rendered, row.where))
        return examples

    def _bad(self, where: str, reason: str) -> None:
        if self.data.on_bad_row == "error":
            raise DataError(f"{where}: {reason} (set data.on_bad_row: skip to skip such rows)")
        self.bad_rows[reason] += 1
        self.bad_row_locations.setdefault(reason, []).append(where)


def _sample(items: list, count: int, rng: random.Random) -> list:
    """``count`` items in their original order, chosen by ``rng``."""
    return [items[i] for i in sorted(rng.sample(range(len(items)), count))]


def _weighted(items: list, weight: float, rng: random.Random) -> list:
    whole, fraction = divmod(weight, 1.0)
    return items * int(whole) + _sample(items, round(fraction * len(items)), rng)


@dataclass
class Selection:
    """The training and eval rows of a run, and what reading them found: ``read`` for the store's summary (every
    row read), and each part's own reader (the training sources', the eval file's) to say why a split is empty."""

    train: list[_Example]
    eval: list[_Example]
    read: dict[str, Any]
    sources: _RowReader
    eval_file: _RowReader | None
    left_out_of_eval: int  # by training.eval_subset_size


def select_rows(config: Config, tokenizer: PreTrainedTokenizerBase | None) -> Selection:
    """The training and eval rows of a run, chosen as its token store chooses them (see the module docstring).
    ``tokenizer`` None: the rows are read and chosen, not rendered."""
    data, training = config.data, config.training
    rng = random.Random(training.seed)
    reader = _RowReader(config, tokenizer)
    train: list[_Example] = []
    eval_rows: list[_Example] = []
    sources = []
    for path, weight in zip(data.paths, data.weights, strict=True):
        rows = reader.read(SourceSpec(path, data.dataset_split, data.dataset_subset, weight))
        if data.eval_split_ratio > 0 and not data.eval_path and rows:
            held_out = set(rng.sample(range(len(rows)), max(1, round(len(rows) * data.eval_split_ratio))))
            eval_rows += [row for i, row in enumerate(rows) if i in held_out]
            rows = [row for i, row in enumerate(rows) if i not in held_out]
        sources.append({"path": path, "weight": weight, "rows": len(rows)})
        train += _weighted(rows, weight, rng)
    held_out_for_eval = 0 if data.eval_path else len(eval_rows)
    eval_reader = None
    if data.eval_path:
        eval_reader = _RowReader(config, tokenizer)
        eval_rows = eval_reader.read(SourceSpec(data.eval_path))
    left_out_by_subset = 0
    if data.subset_size is not None and data.subset_size < len(train):
        left_out_by_subset = len(train) - data.subset_size
        train = _sample(train, data.subset_size, rng)
    left_out_of_eval = 0
    if training.eval_subset_size is not None and training.eval_subset_size < len(eval_rows):
        left_out_of_eval = len(eval_rows) - training.eval_subset_size
        eval_rows = _sample(eval_rows, training.eval_subset_size, random.Random(training.seed + 1))
    readers = [reader, *([eval_reader] if eval_reader else [])]
    bad_row_locations: dict[str, list[str]] = {}
    for each in readers:
        for reason, rows in each.bad_row_locations.items():
            bad_row_locations.setdefault(reason, []).extend(rows)
    read = {
        "rows_read": sum(each.rows_read for each in readers),
        "bad_rows": dict(sum((each.bad_rows for each in readers), Counter())),
        "bad_row_locations": bad_row_locations,
        "sources": sources,
        "held_out_for_eval": held_out_for_eval,
        "left_out_by_subset": left_out_by_subset,
    }
    return Selection(train, eval_rows, read, reader, eval_reader, left_out_of_eval)


def _tokenize_split(
    examples: list[_Example], tokenizer: ExampleTokenizer, packing: bool, max_length: int
) -> tuple[SequenceArrays, SplitSummary]:
    summary = SplitSummary(rows=len(examples))
    kept = []
    for start in range(0, len(examples), TOKENIZE_CHUNK):
        chunk = examples[start : start + TOKENIZE_CHUNK]
        for item, (example, outcome) in zip(chunk, tokenizer.tokenize([item.rendered for item in chunk]), strict=True):
            if example is None:
                summary.dropped[outcome.value] += 1
                rows = summary.dropped_rows.setdefault(outcome.value, [])
                if item.where not in rows:  # a row weighted to appear twice is one row to fix
                    rows.append(item.where)
                continue
            summary.truncated += outcome == Outcome.TRUNCATED
            summary.tokens += len(example.input_ids)
            summary.target_tokens += example.num_targets
            kept.append(example)
    summary.kept = len(kept)
    sequences = pack_examples(kept, max_length) if packing else [unpacked(example) for example in kept]
    summary.sequences = len(sequences)
    return SequenceArrays.from_sequences(sequences), summary


def build_splits(config: Config, tokenizer: PreTrainedTokenizerBase) -> tuple[dict, dict, dict]:
    """Read, render, tokenize and pack: the arrays and summary a token store holds."""
    started = time.perf_counter()
    data = config.data
    selection = select_rows(config, tokenizer)
    example_tokenizer = ExampleTokenizer(tokenizer, data.max_length, data.truncation)
    train, train_summary = _tokenize_split(selection.train, example_tokenizer, data.packing, data.max_length)
    eval_split, eval_summary = _tokenize_split(selection.eval, example_tokenizer, False, data.max_length)
    if len(train) == 0:
        raise DataError(no_training_example(config, selection, train_summary))
    # Evaluation asked for and nothing to evaluate: a run would go on without one eval_loss, unnoticed.
    if len(eval_split) == 0 and (data.eval_path or data.eval_split_ratio > 0):
        raise DataError(no_eval_example(config, selection, eval_summary))
    summary = {
        **selection.read,
        "train": train_summary.as_dict(),
        "eval": eval_summary.as_dict(),
        "packing": config.data.packing,
        "prepare_time_s": round(time.perf_counter() - started, 3),
    }
    return {"train": train, "eval": eval_split}, summary, {}


DROP_REASONS = {
    Outcome.TOO_LONG.value: "longer than data.max_length with data.truncation: drop",
    Outcome.NO_TARGET_TOKENS.value: "no target token left (e.g. the response cut off by data.max_length)",
}


def no_training_example(config: Config, selection: Selection, train: SplitSummary) -> str:
    """Why no training example is left of the rows the training sources hold, counted by reason, with the first row
    of each and what to change."""
    data, read, sources = config.data, selection.read, selection.sources
    counts, first = _why_none(sources, train)
    if not sources.rows_read:
        counts.append("the file holds no rows" if len(data.paths) == 1 else "the files hold no rows")
    fixes = _fixes(config, train) if counts else []
    if read["held_out_for_eval"]:
        counts.append(f"{read['held_out_for_eval']:,} held out for evaluation (data.eval_split_ratio)")
    if read["left_out_by_subset"]:
        counts.append(f"{read['left_out_by_subset']:,} left out by data.subset_size ({data.subset_size:,})")
    selected = sum(source["rows"] for source in read["sources"])
    if read["held_out_for_eval"] and not selected:
        fixes.append(
            f"lower data.eval_split_ratio ({data.eval_split_ratio:g}: it holds out at least one row of each source), "
            "or name an eval file in data.eval_path"
        )
    if selected and not train.rows:
        counts.append("no row selected by data.dataset_weights")
        fixes.append("raise data.dataset_weights")
    return (
        f"{', '.join(data.paths)}: no training example left of {sources.rows_read:,} rows read: "
        f"{'; '.join(counts)}{_first(first)}; {', or '.join(fixes)}"
    )


def no_eval_example(config: Config, selection: Selection, evaluation: SplitSummary) -> str:
    """Why no eval example is left of the eval file's rows (``data.eval_path``) or of those ``data.eval_split_ratio``
    held out, counted by reason as ``no_training_example`` counts them."""
    data = config.data
    if selection.eval_file is not None:
        counts, first = _why_none(selection.eval_file, evaluation)
        if not selection.eval_file.rows_read:
            counts.append("the file holds no rows")
        of = f"{data.eval_path}: no eval example left of {selection.eval_file.rows_read:,} rows read"
        instead = "leave data.eval_path out"
    else:  # bad rows are left out before any is held out: only examples dropped
        counts, first = _why_none(None, evaluation)
        held_out = selection.read["held_out_for_eval"]
        of = f"{', '.join(data.paths)}: no eval example left of the {held_out:,} rows data.eval_split_ratio held out"
        instead = "set data.eval_split_ratio: 0"
    if selection.left_out_of_eval:
        subset = config.training.eval_subset_size
        counts.append(f"{selection.left_out_of_eval:,} left out by training.eval_subset_size ({subset:,})")
    fixes = [*_fixes(config, evaluation), f"{instead} to train without evaluation"]
    return f"{of}: {'; '.join(counts)}{_first(first)}; {', or '.join(fixes)}"


def _why_none(reader: _RowReader | None, split: SplitSummary) -> tuple[list[str], list[str]]:
    """What became of the rows of a split that has no example, counted by reason (the bad rows ``reader`` skipped,
    then the examples the split dropped), and the first row of each reason."""
    counts: list[str] = []
    first: list[str] = []
    for reason, count in sorted(reader.bad_rows.items() if reader is not None else []):
        counts.append(f"{count:,} bad ({reason})")
        first.append(reader.bad_row_locations[reason][0])
    for reason, count in sorted(split.dropped.items()):
        counts.append(f"{count:,} {DROP_REASONS.get(reason, reason)}")
        first.append(split.dropped_rows[reason][0])
    return counts, first


def _fixes(config: Config, split: SplitSummary) -> list[str]:
    """What to change about rows that made no example of ``split``."""
    fixes = ["fix or replace the rows"]
    if split.dropped.get(Outcome.TOO_LONG.value) or split.dropped.get(Outcome.NO_TARGET_TOKENS.value):
        fixes.append(f"raise data.max_length ({config.data.max_length})")
    return fixes


def _first(rows: list[str]) -> str:
    return f" (first: {', '.join(rows)})" if rows else ""


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Everything of the tokenizer that decides the ids: vocabulary, merges, normalizers, specials, template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    digest.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    digest.update(str(tokenizer.chat_template or "").encode())
    digest.update(repr(tokenizer.encode("a", add_special_tokens=True)).encode())
    return digest.hexdigest()


def store_inputs(config: Config, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Every input the store's content depends on; any change makes a new store."""
    data, training = config.data, config.training
    return {
        "pipeline_version": PIPELINE_VERSION,
        "sources": [
            source_fingerprint(SourceSpec(path, data.dataset_split, data.dataset_subset, weight))
            for path, weight in zip(data.paths, data.weights, strict=True)
        ],
        "weights": data.weights,
        "eval_source": source_fingerprint(SourceSpec(data.eval_path)) if data.eval_path else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": data.model_dump(
            mode="json",
            include={"format", "columns", "train_on_prompt", "max_length", "truncation", "on_bad_row", "packing"},
        ),
        "selection": {
            "seed": training.seed,
            "subset_size": data.subset_size,
            "eval_split_ratio": data.eval_split_ratio,
            "eval_subset_size": training.eval_subset_size,
        },
    }


def prepare_dataset(
    config: Config, tokenizer: PreTrainedTokenizerBase, *, is_builder: bool = True, timeout_s: float = 3600.0
) -> PreparedData:
    """The run's token store: reused when it exists, else built (by ``is_builder``) and committed."""
    inputs = store_inputs(config, tokenizer)
    key = store_key(inputs)

    def build() -> tuple[dict, dict, dict]:
        splits, summary, _ = build_splits(config, tokenizer)
        return splits, summary, {"inputs": inputs, "shardtune": __version__}

    store: TokenStore = build_once(
        config.data.resolved_cache_dir, key, build, is_builder=is_builder, timeout_s=timeout_s
    )
    return PreparedData(store.splits["train"], store.splits["eval"], store.summary, store.path)


def describe(summary: dict[str, Any]) -> str:
    """One line for the log: what preparation read, kept and dropped."""
    train, evaluation = summary["train"], summary["eval"]
    # Bad rows are read before the split: counted with the rows read, not as train's (an eval file has its own).
    bad = sum(summary["bad_rows"].values())
    read = f"{summary['rows_read']:,} rows read" + (f" ({bad:,} bad)" if bad else "")
    rows = {
        **{f"bad row ({reason})": rows for reason, rows in summary["bad_row_locations"].items()},
        **{f"{name} {reason}": rows for name, split in (("train", train), ("eval", evaluation))
           for reason, rows in split["dropped_rows"].items()},
    }  # fmt: skip
    listed = [f"{reason}: {_some(where)}" for reason, where in rows.items()]
    return (
        f"{read}; train: {train['kept']:,} examples kept ({train['truncated']:,} truncated, dropped "
        f"{train['dropped'] or 'none'}), {train['tokens']:,} tokens, "
        f"{train['target_tokens']:,} target tokens, {train['sequences']:,} sequences"
        f"{' (packed)' if summary['packing'] else ''}; eval: {evaluation['kept']:,} examples"
        + (f"; rows dropped: {'; '.join(listed)}" if listed else "")
    )


def _some(rows: list[str], shown: int = 10) -> str:
    """The first rows of a list, and how many more there are (every one is in the store's summary.json)."""
    more = f" and {len(rows) - shown} more (summary.json)" if len(rows) > shown else ""
    return ", ".join(rows[:shown]) + more

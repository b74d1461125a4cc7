"""The schema of the run directory's JSONL logs: every field of ``logs/train_log.jsonl``,
``logs/eval_log.jsonl``, ``logs/expert_usage.jsonl`` and ``logs/nonfinite.jsonl``, its type, unit and
meaning, in one place.

Every row carries ``schema_version``. A change that renames, removes or redefines a field raises
``SCHEMA_VERSION``; adding an optional field does not. ``docs/logs.md`` holds the tables ``markdown_table``
renders from this module (a test keeps them equal), so the documentation cannot drift from the code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.errors import InputError

SCHEMA_VERSION = 1
LOG_FILES = {
    "train": "train_log.jsonl",
    "eval": "eval_log.jsonl",
    "expert_usage": "expert_usage.jsonl",
    "nonfinite": "nonfinite.jsonl",
}


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # "int", "float", "str", "list[int]" or "list[layer]" (rows of LAYER_FIELDS)
    unit: str
    description: str
    optional: bool = False  # may be absent from a row
    nullable: bool = False  # may be null


_COMMON = [
    Field("schema_version", "int", "", f"version of this schema ({SCHEMA_VERSION})"),
    Field("step", "int", "steps", "optimizer step after which the row was written (eval: 0 is before training)"),
]

TRAIN_FIELDS = [
    *_COMMON,
    Field("epoch", "float", "epochs", "passes over the training set so far (fractional)"),
    Field("loss", "float", "nats/token", "mean LM loss over every target token of the interval, all ranks"),
    Field("lr", "float", "", "learning rate of the row's step"),
    Field("grad_norm", "float", "", "global gradient norm of the row's step, before clipping"),
    Field("interval_steps", "int", "steps", "optimizer steps since the previous row (the interval)"),
    Field("tokens", "int", "tokens", "real (non-padding) tokens trained in the interval, all ranks"),
    Field("target_tokens", "int", "tokens", "tokens that carry a loss in the interval, all ranks"),
    Field("tokens_per_s", "float", "tokens/s", "tokens / the interval's training time (see below), all ranks together"),
    Field(
        "target_tokens_per_s", "float", "tokens/s", "target_tokens / the interval's training time, all ranks together"
    ),
    Field("tokens_per_s_per_device", "float", "tokens/s", "tokens_per_s / world size"),
    Field("target_tokens_per_s_per_device", "float", "tokens/s", "target_tokens_per_s / world size"),
    Field(
        "tflops_per_device",
        "float",
        "TFLOP/s",
        "model FLOPs per device and second, by shardtune/metrics/flops.py (as shardtune bench)",
    ),
    Field(
        "mfu",
        "float",
        "fraction",
        "tflops_per_device / the device's dense bf16 peak; null when the peak is unknown (CPU) and "
        "logging.peak_tflops is not set",
        nullable=True,
    ),
    Field("peak_memory_gib", "float", "GiB", "highest peak memory of any rank since training started"),
    Field(
        "data_wait_s",
        "float",
        "s",
        "mean time per step spent fetching and collating batches, on the rank that waited most",
    ),
    Field("step_time_s_min", "float", "s", "mean step time of the fastest rank over the interval"),
    Field("step_time_s_median", "float", "s", "median over ranks of their mean step times"),
    Field("step_time_s_max", "float", "s", "mean step time of the slowest rank over the interval"),
    Field("slowest_rank", "int", "rank", "global rank with step_time_s_max"),
    Field("slowest_host", "str", "", "hostname of slowest_rank"),
    Field("elapsed_s", "float", "s", "wall time since the training loop started (evaluations included)"),
    Field("moe_balance_loss", "float", "", "MoE: mean load-balancing loss of the interval", optional=True),
    Field("moe_max_mean_ratio", "float", "", "MoE: the worst layer's busiest-expert / mean load", optional=True),
]

EVAL_FIELDS = [
    *_COMMON,
    Field("eval_loss", "float", "nats/token", "mean loss over every target token of the eval set"),
    Field("eval_perplexity", "float", "", "exp(eval_loss)"),
    Field("eval_tokens", "int", "tokens", "target tokens evaluated"),
    Field("eval_time_s", "float", "s", "wall time of the evaluation"),
]

LAYER_FIELDS = [
    Field("layer", "int", "", "decoder layer index"),
    Field("counts", "list[int]", "tokens", "tokens routed to each expert (once per chosen expert), all ranks"),
    Field("max_mean_ratio", "float", "", "busiest expert's count / mean count (1.0: even)"),
    Field("entropy", "float", "nats", "mean over tokens of the router distribution's entropy"),
    Field("normalized_entropy", "float", "", "entropy / ln(num_experts) (1.0: the router cannot tell experts apart)"),
]

EXPERT_USAGE_FIELDS = [
    *_COMMON,
    Field("tokens", "int", "tokens", "real tokens routed in the interval, all ranks"),
    Field("top_k", "int", "experts", "experts each token is routed to"),
    Field("num_experts", "int", "experts", "routed experts per MoE layer"),
    Field("balance_loss", "float", "", "mean load-balancing loss of the interval's micro-batches"),
    Field("layers", "list[layer]", "", "one object per MoE layer, fields below"),
]

NONFINITE_FIELDS = [
    *_COMMON,
    Field("loss_ranks", "list[int]", "ranks", "ranks whose loss of the step was NaN or inf"),
    Field("gradient_ranks", "list[int]", "ranks", "ranks whose gradient norm of the step was NaN or inf"),
    Field("consecutive", "int", "steps", "non-finite steps in a row, this one included"),
    Field("action", "str", "", "skip (the update was not applied), or stop (and the run stopped)"),
]

SCHEMAS = {
    "train": TRAIN_FIELDS,
    "eval": EVAL_FIELDS,
    "expert_usage": EXPERT_USAGE_FIELDS,
    "nonfinite": NONFINITE_FIELDS,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_error(value: Any, type_name: str) -> str | None:
    if type_name == "int":
        ok = _is_int(value)
    elif type_name == "float":
        # JSON writes 2.0 as 2.0 but a Python int as 2; NaN is legal (an empty interval's ratio).
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif type_name == "str":
        ok = isinstance(value, str)
    elif type_name == "list[int]":
        # One pass with no call of _type_error per item: an expert usage record has 6,144 of them (48 layers x
        # 128 experts), checked while the device waits for the next step.
        ok = isinstance(value, list) and all(map(_is_int, value))
    else:  # list[layer]: checked field by field by the caller
        ok = isinstance(value, list) and all(isinstance(item, dict) for item in value)
    return None if ok else f"expected {type_name}, got {value!r:.80}"


def _problems(row: dict[str, Any], fields: list[Field], where: str) -> list[str]:
    problems = []
    known = {field.name for field in fields}
    for name in sorted(set(row) - known):
        problems.append(f"{where}{name}: not a field of the schema")
    for field in fields:
        if field.name not in row:
            if not field.optional:
                problems.append(f"{where}{field.name}: missing")
            continue
        value = row[field.name]
        if value is None:
            if not field.nullable:
                problems.append(f"{where}{field.name}: null")
            continue
        error = _type_error(value, field.type)
        if error:
            problems.append(f"{where}{field.name}: {error}")
        elif field.type == "list[layer]":
            for index, layer in enumerate(value):
                problems.extend(_problems(layer, LAYER_FIELDS, f"{where}{field.name}[{index}]."))
    return problems


def validate(kind: str, row: dict[str, Any]) -> None:
    """Raise ValueError naming every field of ``row`` that does not match the ``kind`` log's schema."""
    problems = _problems(row, SCHEMAS[kind], "")
    if not problems and row["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version: {row['schema_version']}, this shardtune writes {SCHEMA_VERSION}")
    if problems:
        raise ValueError(f"{LOG_FILES[kind]} row of step {row.get('step')}: " + "; ".join(problems))


def make_row(kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
    """The row a log gets for ``values`` at ``step``, checked against the schema (a mismatch is a bug)."""
    row = {"schema_version": SCHEMA_VERSION, "step": step, **values}
    validate(kind, row)
    return row


def read_rows(path: Path, what: str, needs_layers: bool = False) -> list[dict[str, Any]]:
    """The rows of a JSONL log, each checked for what every reader relies on: a JSON object with an
    integer ``step`` (and, with ``needs_layers``, per-layer expert ``counts``). Other fields are not
    checked, so a plot of a run written by an older schema still draws what it has. A bad line raises
    ``InputError`` naming the file, the line and ``what`` was expected there. Every row is written with its
    newline, so a last line without one was cut short by a kill in mid-write (a crashed run), or is being
    written now: it is left out, and the rows before it read."""
    text = path.read_text()
    rows = []
    for number, line in enumerate(text[: text.rfind("\n") + 1].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            problem = str(exc)
        else:
            problem = _read_problem(row, needs_layers)
        if problem:
            raise InputError(f"{path}:{number}: not {what} ({problem})")
        rows.append(row)
    return rows


def _read_problem(row: Any, needs_layers: bool) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {row!r:.80}"
    problem = _type_error(row.get("step"), "int")
    if problem:
        return f"step: {problem}"
    if needs_layers:
        layers = row.get("layers")
        if not isinstance(layers, list) or not layers:
            return f"layers: expected a list of MoE layers, got {layers!r:.80}"
        for index, layer in enumerate(layers):
            problem = _type_error(layer.get("counts") if isinstance(layer, dict) else None, "list[int]")
            if problem:
                return f"layers[{index}].counts: {problem}"
    return None


def is_number(value: Any) -> bool:
    """A value TensorBoard and W&B can plot: an int or float, not a bool, string, list or null."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def markdown_table(fields: list[Field]) -> str:
    """The documentation table of ``fields`` (``docs/logs.md`` holds these verbatim)."""
    lines = ["| field | type | unit | meaning |", "| --- | --- | --- | --- |"]
    for field in fields:
        type_name = field.type + (" or null" if field.nullable else "") + (", optional" if field.optional else "")
        lines.append(f"| `{field.name}` | {type_name} | {field.unit} | {field.description} |")
    return "\n".join(lines)

"""The data of ``shardtune bench``: full-length random sequences, or alpaca-like examples of random words.

The bench tokenizer is word-level (``w0`` ... ``w4094``), so a text of N words is exactly N tokens and
the lengths below are token counts.

``alpaca-like`` imitates the length distribution of instruction data such as alpaca-cleaned, which is
what the seeds trained on: short instructions, an input for about 40% of the rows, and responses with a
long tail. Each length is log-normal (median, sigma) and clipped; about 200 tokens per example in all,
about 160 of them in the response, the part that carries the loss. At seq 512 most of a padded batch is
padding; packing fills it with several examples.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

SYNTHETIC_VOCAB = 4096  # words of the synthetic tokenizer; every shape's vocabulary is larger
WORDS = [f"w{i}" for i in range(SYNTHETIC_VOCAB - 1)]

# (median, sigma, low, high) of the log-normal word counts of each alpaca field.
ALPACA_INSTRUCTION = (14, 0.5, 3, 80)
ALPACA_INPUT = (25, 0.8, 1, 400)
ALPACA_INPUT_SHARE = 0.4
ALPACA_OUTPUT = (110, 0.85, 1, 1500)
ALPACA_MEAN_TOKENS = 150  # a lower bound of the mean tokens per rendered example, for sizing the dataset


def write_synthetic_data(path: Path, rows: int, seq: int) -> None:
    """``rows`` texts of ``seq`` random words: each becomes one full sequence (no padding)."""
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=seq))}) + "\n")


def alpaca_like_rows(sequences: int, seq: int) -> int:
    """Rows enough to pack ``sequences`` sequences of ``seq`` tokens (and to give a padded run as many)."""
    return sequences * max(1, math.ceil(1.2 * seq / ALPACA_MEAN_TOKENS))


def write_alpaca_like_data(path: Path, rows: int) -> None:
    """``rows`` alpaca rows (instruction, input, output) of random words with alpaca-like lengths."""
    rng = random.Random(0)

    def words(median: int, sigma: float, low: int, high: int) -> str:
        count = round(rng.lognormvariate(math.log(median), sigma))
        return " ".join(rng.choices(WORDS, k=min(max(count, low), high)))

    with path.open("w") as handle:
        for _ in range(rows):
            row = {
                "instruction": words(*ALPACA_INSTRUCTION),
                "input": words(*ALPACA_INPUT) if rng.random() < ALPACA_INPUT_SHARE else "",
                "output": words(*ALPACA_OUTPUT),
            }
            handle.write(json.dumps(row) + "\n")

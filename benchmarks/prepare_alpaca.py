"""Examples per second to prepare alpaca-like rows: read, render, tokenize, (pack), write the token store.

    python benchmarks/prepare_alpaca.py --rows 100000 [--packing] [--tokenizer DIR]

It writes a deterministic JSONL of ``--rows`` alpaca-like rows (instruction, optional input, a
multi-sentence output) to a temporary directory, then times ``prepare_dataset`` end to end into an
empty cache, and a second call that reuses the store.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from shardtune.config import Config
from shardtune.data.prepare import prepare_dataset

REPO = Path(__file__).resolve().parent.parent
# One string split once: a word list written out would take 30 lines.
WORDS = str.split(
    "the model learns to follow instructions from examples written by people who care about clear answers "
    "data quality matters more than quantity when fine tuning large language models on small budgets"
)


def write_rows(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w") as handle:
        for i in range(rows):
            sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."  # noqa: E731
            row = {
                "instruction": sentence(rng.randint(5, 20)),
                "input": sentence(rng.randint(3, 15)) if i % 3 == 0 else "",
                "output": " ".join(sentence(rng.randint(5, 25)) for _ in range(rng.randint(1, 6))),
            }
            handle.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--tokenizer", default=str(REPO / "examples" / "tiny-llama"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        write_rows(data, args.rows)
        config = Config.model_validate(
            {
                "model": {"name_or_path": args.tokenizer},
                "data": {
                    "dataset_path": str(data),
                    "max_length": args.max_length,
                    "packing": args.packing,
                    "cache_dir": str(Path(tmp) / "cache"),
                },
            }
        )
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        started = time.perf_counter()
        prepared = prepare_dataset(config, tokenizer)
        elapsed = time.perf_counter() - started
        started = time.perf_counter()
        prepare_dataset(config, tokenizer)
        reuse = time.perf_counter() - started
        train = prepared.summary["train"]
        print(
            json.dumps(
                {
                    "rows": args.rows,
                    "packing": args.packing,
                    "tokens": train["tokens"],
                    "sequences": train["sequences"],
                    "prepare_s": round(elapsed, 2),
                    "examples_per_s": round(args.rows / elapsed),
                    "tokens_per_s": round(train["tokens"] / elapsed),
                    "reuse_s": round(reuse, 3),
                }
            )
        )


if __name__ == "__main__":
    main()

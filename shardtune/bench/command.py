"""``shardtune bench``: the real training path on a named model shape with random weights and synthetic
tokens, then (``--baseline hf``) HF Trainer + PEFT on the same model shape and the same tokens.

Everything a run needs is written into the output directory: a model directory (the shape's config and
a word-level tokenizer whose ids are the words ``w0``, ``w1``, ... so text of N words is exactly N
tokens), a dataset of random words, and ``config.yaml``. Training is ``shardtune train`` on that config
(``section.key=value`` overrides apply), logging every step; the first ``--warmup`` steps are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import yaml

from shardtune.errors import InputError

SYNTHETIC_VOCAB = 4096  # words of the synthetic tokenizer; every shape's vocabulary is larger


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from shardtune.bench.shapes import SHAPES

    parser = commands.add_parser("bench", help="throughput and memory on a real-shaped model (random weights)")
    parser.add_argument("--shape", required=True, help=f"{', '.join(SHAPES)}, or a config.json / model directory")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per device and step")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    parser.add_argument("--full", action="store_true", help="full fine-tuning (default: LoRA)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument(
        "--lora-targets", default=None, help="all-linear, or module names joined by commas (default: as train)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp"])
    parser.add_argument("--nproc", type=int, default=None, help="workers (default: one per GPU, 1 on CPU)")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none", help="hf: also HF Trainer + PEFT")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/bench-SHAPE)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config values")
    parser.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from shardtune.bench.report import format_report, summarize_hf, summarize_shardtune
    from shardtune.bench.shapes import shape_config
    from shardtune.launch.elastic import default_nproc

    for name in ("seq", "batch", "steps", "lora_r"):
        if getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        raise InputError(f"--warmup: must be 0 or more, got {args.warmup}")
    model_config = shape_config(args.shape)
    out: Path = args.out or Path("runs") / f"bench-{Path(args.shape).name}"
    out.mkdir(parents=True, exist_ok=True)
    nproc = args.nproc or default_nproc()
    model_dir = write_model_dir(out / "model", model_config)
    rows = (args.warmup + args.steps) * args.batch * nproc
    write_synthetic_data(out / "data.jsonl", rows, args.seq)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(bench_config(args, out, model_dir), sort_keys=False))

    results = {"shape": args.shape, "seq": args.seq, "batch_per_device": args.batch, "nproc": nproc}
    command = [sys.executable, "-m", "shardtune", "train", str(config_path), "--nproc", str(nproc), *args.overrides]
    _run(command, out / "shardtune.log", "shardtune train")
    results["shardtune"] = summarize_shardtune(out / "shardtune", args.warmup, model_config, args.seq)
    results["shardtune"]["command"] = " ".join(command[1:])
    if args.baseline == "hf":
        runner = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc-per-node={nproc}"]  # fmt: skip
        command = [*runner, "-m", "shardtune.bench.hf_baseline", str(config_path), str(out / "hf"), *args.overrides]
        _run(command, out / "hf.log", "the HF Trainer + PEFT baseline")
        results["hf"] = summarize_hf(out / "hf", args.warmup, model_config, args.seq)
        results["hf"]["command"] = " ".join(command[1:])
        results["ratio"] = results["shardtune"]["tokens_per_s_per_device"] / results["hf"]["tokens_per_s_per_device"]
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print(format_report(results))
    print(f"wrote {out / 'bench.json'}")
    return 0


def bench_config(args: argparse.Namespace, out: Path, model_dir: Path) -> dict:
    targets = args.lora_targets if args.lora_targets in (None, "all-linear") else args.lora_targets.split(",")
    return {
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "auto"},
        "data": {"dataset_path": str(out / "data.jsonl"), "format": "text", "max_length": args.seq,
                 "packing": True, "cache_dir": str(out / "cache")},
        "training": {"output_dir": str(out / "shardtune"), "overwrite_output_dir": True,
                     "max_steps": args.warmup + args.steps, "per_device_train_batch_size": args.batch,
                     "learning_rate": 1e-5 if args.full else 1e-4, "logging_steps": 1,
                     "gradient_checkpointing": args.gradient_checkpointing},
        "lora": {"enabled": not args.full, "r": args.lora_r, "lora_alpha": 2 * args.lora_r, "lora_dropout": 0.0,
                 "target_modules": targets},
        "parallel": {"strategy": args.strategy},
        "logging": {"progress_bar": False},
    }  # fmt: skip


def write_model_dir(directory: Path, model_config) -> Path:
    """The shape's config and a word-level tokenizer (``w0`` ... ``w4095`` and ``<eos>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    if model_config.vocab_size <= SYNTHETIC_VOCAB:
        raise InputError(f"--shape: vocabulary of {model_config.vocab_size} tokens; bench needs > {SYNTHETIC_VOCAB}")
    model_config.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(SYNTHETIC_VOCAB - 1)} | {"<eos>": SYNTHETIC_VOCAB - 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<eos>")
    tokenizer.save_pretrained(directory)
    return directory


def write_synthetic_data(path: Path, rows: int, seq: int) -> None:
    """``rows`` texts of ``seq`` random words: each becomes one full sequence (no padding)."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(SYNTHETIC_VOCAB - 1)]
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(rng.choices(words, k=seq))}) + "\n")


def _run(command: list[str], log: Path, what: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise InputError([f"{what} failed (exit {result.returncode}); the end of {log}:", *tail])

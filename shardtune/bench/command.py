"""``shardtune bench``: the real training path on a named model shape with random weights and synthetic
tokens, then (``--baseline hf``) HF Trainer + PEFT on the same model shape and the same tokens.

Everything a run needs is written into the output directory: a model directory (the shape's config and
a word-level tokenizer whose ids are the words ``w0``, ``w1``, ... so text of N words is exactly N
tokens), the data (full-length random sequences, alpaca-like examples, or a given file), and
``config.yaml``. Training is ``shardtune train`` on that config (``section.key=value`` overrides apply),
logging every step; the first ``--warmup`` steps are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import yaml

from shardtune.bench.data import (
    SYNTHETIC_VOCAB,
    alpaca_like_rows,
    write_alpaca_like_data,
    write_synthetic_data,
)
from shardtune.config import Routing, add_override_arguments, load_config
from shardtune.errors import InputError


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from shardtune.bench.shapes import SHAPES

    parser = commands.add_parser("bench", help="throughput and memory on a real-shaped model (random weights)")
    parser.add_argument("--shape", required=True, help=f"{', '.join(SHAPES)}, or a config.json / model directory")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per device and step")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    parser.add_argument(
        "--epoch-examples",
        type=int,
        default=None,
        metavar="N",
        help="instead of --steps: one epoch over N generated examples (synthetic or alpaca-like), timed whole",
    )
    parser.add_argument(
        "--layers", type=int, default=None, metavar="N", help="the shape with its first N decoder layers only"
    )
    parser.add_argument(
        "--routing",
        choices=typing.get_args(Routing),
        default="skewed",
        help="MoE router weights: skewed (a trained-like long tail, the default), balanced (an even expert load) "
        "or random (as drawn: a few experts take most tokens); see shardtune/model/init_routing.py",
    )
    parser.add_argument("--full", action="store_true", help="full fine-tuning (default: LoRA)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument(
        "--lora-targets", default=None, help="all-linear, or module names joined by commas (default: as train)"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="checkpoint every decoder layer, on both sides (default: shardtune's auto, and the HF baseline "
        "without, or with if it runs out of memory without)",
    )
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp"])
    parser.add_argument("--nproc", type=int, default=None, help="workers (default: one per GPU, 1 on CPU)")
    parser.add_argument(
        "--data",
        default="synthetic",
        help="synthetic (full-length random sequences), alpaca-like (random words, alpaca lengths), or a file",
    )
    parser.add_argument(
        "--data-format", default="alpaca", choices=["alpaca", "messages", "text"], help="of --data FILE"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="with --data FILE: a tokenizer directory (default: word-level)"
    )
    parser.add_argument("--baseline", choices=["none", "hf"], default="none", help="hf: also HF Trainer + PEFT")
    parser.add_argument(
        "--hf-padding",
        choices=["max_length", "longest"],
        default="max_length",
        help="the baseline's examples, one per sequence: padded to --seq (as the seeds) or to the batch's longest",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/bench-SHAPE)")
    add_override_arguments(parser)
    parser.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from shardtune.bench.report import format_report, summarize_hf, summarize_shardtune
    from shardtune.bench.shapes import shape_config
    from shardtune.launch.elastic import default_nproc
    from shardtune.launch.local import check_worker_count

    for name in ("seq", "batch", "steps", "lora_r"):
        if getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        raise InputError(f"--warmup: must be 0 or more, got {args.warmup}")
    if args.epoch_examples is not None:
        if args.epoch_examples <= 0:
            raise InputError(f"--epoch-examples: must be positive, got {args.epoch_examples}")
        if args.data not in ("synthetic", "alpaca-like"):
            raise InputError(f"--epoch-examples: generates its examples; not with --data {args.data}")
        if args.baseline != "none":
            raise InputError("--epoch-examples: the HF baseline runs a fixed number of steps; not with --baseline")
    nproc = default_nproc() if args.nproc is None else args.nproc
    check_worker_count(nproc, "--nproc")  # the run it starts warns where CPU workers outnumber the cores
    model_config = shape_config(args.shape, layers=args.layers)
    out: Path = args.out or Path("runs") / f"bench-{Path(args.shape).name}"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir(out / "model", model_config, args.tokenizer)
    data_path, data_format = write_data(args, out, sequences=(args.warmup + args.steps) * args.batch * nproc)
    config_path = out / "config.yaml"
    config = bench_config(args, out, model_dir, data_path, data_format, model_config)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # The overrides are the train command's: a mistake in one is its one line now, not a failed run's log after it.
    load_config(config_path, args.overrides, check_paths=False)

    results = {
        "shape": args.shape,
        "seq": args.seq,
        "batch_per_device": args.batch,
        "warmup": args.warmup,
        "nproc": nproc,
        "data": args.data,
        "layers": model_config.get_text_config().num_hidden_layers,
        # bench_config sets the router weights of an MoE shape alone (a dense one keeps the default)
        "routing": config["model"].get("init_routing"),
    }
    command = [sys.executable, "-m", "shardtune", "train", str(config_path), "--nproc", str(nproc), *args.overrides]
    _run(command, out / "shardtune.log", "shardtune train")
    results["shardtune"] = summarize_shardtune(out / "shardtune", args.warmup, model_config, args.seq)
    results["shardtune"]["command"] = " ".join(command[1:])
    if args.epoch_examples is not None:
        metrics = json.loads((out / "shardtune" / "metrics.json").read_text())
        results["epoch"] = {"examples": args.epoch_examples, "steps": metrics["steps"],
                            "train_time_s": metrics["train_time_s"], "wall_time_s": metrics["wall_time_s"]}  # fmt: skip
    if args.baseline == "hf":
        runner = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc-per-node={nproc}"]  # fmt: skip
        command = [*runner, "-m", "shardtune.bench.hf_baseline", str(config_path), str(out / "hf"), args.hf_padding,
                   *args.overrides]  # fmt: skip
        command, checkpointing, fits = run_hf_baseline(command, out / "hf.log", args.gradient_checkpointing)
        hf = summarize_hf(out / "hf", args.warmup, model_config, args.seq) if fits else {"out_of_memory": True}
        results["hf"] = {**hf, "command": " ".join(command[1:]), "gradient_checkpointing": checkpointing,
                         "padding": args.hf_padding}  # fmt: skip
        if fits:
            shardtune = results["shardtune"]
            results["ratio"] = shardtune["tokens_per_s_per_device"] / hf["tokens_per_s_per_device"]
            results["target_ratio"] = shardtune["target_tokens_per_s_per_device"] / hf["target_tokens_per_s_per_device"]
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print(format_report(results))
    print(f"wrote {out / 'bench.json'}")
    return 0


def run_hf_baseline(command: list[str], log: Path, checkpointing: bool) -> tuple[list[str], bool, bool]:
    """Runs the HF baseline ``command`` at its best setting that fits: HF checkpoints every layer or none,
    so without ``checkpointing`` (shardtune then chose its own, auto) none if that fits, else every layer.
    Returns the command that ran last, whether it checkpointed, and whether it fit (a run that did not fit
    even checkpointed leaves shardtune's side without a ratio; any other failure stops bench)."""
    if not checkpointing:
        status = _run_logged(command, log)
        if not status:
            return command, False, True
        if not _out_of_memory(log):
            _fail(log, "the HF Trainer + PEFT baseline", status)
        print("the HF baseline ran out of memory without gradient checkpointing; running it with", flush=True)
        command = [*command, "training.gradient_checkpointing=true"]
    status = _run_logged(command, log)
    if status and not _out_of_memory(log):
        _fail(log, "the HF Trainer + PEFT baseline", status)
    if status:
        print(f"the HF baseline ran out of memory with every layer checkpointed too (see {log}): no ratio", flush=True)
    return command, True, not status


def write_data(args: argparse.Namespace, out: Path, sequences: int) -> tuple[Path, str]:
    """The dataset file and its format: enough rows for ``sequences`` sequences of ``--seq`` tokens, or
    ``--epoch-examples`` rows."""
    epoch = args.epoch_examples
    if args.data == "synthetic":
        write_synthetic_data(out / "data.jsonl", epoch or sequences, args.seq)
        return out / "data.jsonl", "text"
    if args.data == "alpaca-like":
        write_alpaca_like_data(out / "data.jsonl", epoch or alpaca_like_rows(sequences, args.seq))
        return out / "data.jsonl", "alpaca"
    path = Path(args.data)
    if not path.is_file():
        raise InputError(f"--data {args.data}: neither synthetic, alpaca-like nor an existing file")
    return path.resolve(), args.data_format


def is_moe(model_config) -> bool:
    """Whether a shape has routed experts: MoE blocks in the model it describes, built on the meta device and found
    as training finds them (``moe.find_moe_blocks``; a config key would miss DBRX's ``ffn_config.moe_num_experts``)."""
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.metrics.flops import as_model
    from shardtune.model.moe import find_moe_blocks

    model = as_model(model_config)
    return bool(find_moe_blocks(model, decoder_layers(model)))


def bench_config(
    args: argparse.Namespace, out: Path, model_dir: Path, data_path: Path, data_format: str, model_config
) -> dict:
    from shardtune.model.load import attention_runs  # here: transformers takes a second to import

    targets = args.lora_targets if args.lora_targets in (None, "all-linear") else args.lora_targets.split(",")
    return {
        # Synthetic sequences are one document each: plain causal attention, sdpa's fastest kernel, where the
        # architecture runs it (GPT-OSS's sinks and Gemma 2's capped scores: auto, FlexAttention on a GPU).
        "model": {"name_or_path": str(model_dir), "init": "random", "dtype": "auto",
                  "attn_implementation": "sdpa" if args.data == "synthetic" and attention_runs(model_config, "sdpa")
                  else "auto",
                  **({"init_routing": args.routing} if is_moe(model_config) else {})},
        "data": {"dataset_path": str(data_path), "format": data_format, "max_length": args.seq,
                 "packing": True, "cache_dir": str(out / "cache")},
        "training": {"output_dir": str(out / "shardtune"), "overwrite_output_dir": True,
                     "max_steps": -1 if args.epoch_examples else args.warmup + args.steps, "num_train_epochs": 1,
                     "per_device_train_batch_size": args.batch,
                     "learning_rate": 1e-5 if args.full else 1e-4, "logging_steps": 1,
                     "gradient_checkpointing": True if args.gradient_checkpointing else "auto"},
        "lora": {"enabled": not args.full, "r": args.lora_r, "lora_alpha": 2 * args.lora_r, "lora_dropout": 0.0,
                 "target_modules": targets},
        "parallel": {"strategy": args.strategy},
        "logging": {"progress_bar": False},
    }  # fmt: skip


def write_model_dir(directory: Path, model_config, tokenizer_dir: str | None = None) -> Path:
    """The shape's config and a word-level tokenizer (``w0`` ... ``w4094`` and ``<eos>``), or the given one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    if model_config.vocab_size <= SYNTHETIC_VOCAB:
        raise InputError(f"--shape: vocabulary of {model_config.vocab_size} tokens; bench needs > {SYNTHETIC_VOCAB}")
    model_config.save_pretrained(directory)
    if tokenizer_dir is not None:
        given = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(given) > model_config.vocab_size:
            raise InputError(
                f"--tokenizer {tokenizer_dir}: {len(given)} tokens, more than the shape's {model_config.vocab_size}"
            )
        given.save_pretrained(directory)
        return directory
    vocab = {f"w{i}": i for i in range(SYNTHETIC_VOCAB - 1)} | {"<eos>": SYNTHETIC_VOCAB - 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<eos>")
    tokenizer.save_pretrained(directory)
    return directory


def _run_logged(command: list[str], log: Path) -> int:
    """Run ``command`` with its output in ``log``; its exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as handle:
        return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode


def _run(command: list[str], log: Path, what: str) -> None:
    status = _run_logged(command, log)
    if status:
        _fail(log, what, status)


def _fail(log: Path, what: str, status: int) -> None:
    tail = log.read_text().splitlines()[-15:]
    raise InputError([f"{what} failed (exit {status}); the end of {log}:", *tail])


def _out_of_memory(log: Path) -> bool:
    """Whether the run logged in ``log`` ended for want of device memory."""
    text = log.read_text()
    return "torch.OutOfMemoryError" in text or "CUDA out of memory" in text

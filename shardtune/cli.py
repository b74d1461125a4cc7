"""``shardtune`` command line: parse, validate, then hand over to the command's module.

Bad input (config keys, values, files, data rows) exits with status 2 and one line per problem,
before any model is loaded. A fault the run meets (``shardtune.errors.RunFault``: non-finite losses,
a checkpoint that cannot be written) and Ctrl-C end with one line too, printed by global rank 0 only,
and an exit status of their own (see ``shardtune.errors``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune import __version__, rank_zero_log
from shardtune.bench import add_bench_parser
from shardtune.config import Config, add_config_arguments, load_config
from shardtune.convert import add_convert_parser
from shardtune.doctor import add_doctor_parser
from shardtune.errors import EXIT_INTERRUPTED, EXIT_LOST_PEER, InputError, RunFault
from shardtune.launch.elastic import add_node_arguments
from shardtune.launch.local import close_unless_worker, say_once
from shardtune.launch.slurm import add_slurm_parser
from shardtune.metrics.expert_heatmap import add_expert_usage_parser
from shardtune.metrics.plot import add_plot_parser
from shardtune.plan import add_plan_parser

if TYPE_CHECKING:
    from shardtune.evaluate import EvalRequest

log = logging.getLogger("shardtune")


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    rank_zero_log.install()
    # transformers' and PEFT's own progress bars and advice would interleave with ours.
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # huggingface_hub prints its warnings (a hub out of reach, its retries) with a handler of its own: without
    # this, the root logger's handler printed each a second time.
    import huggingface_hub.utils.logging

    huggingface_hub.utils.logging.disable_propagation()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def cmd_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    return _run_workers(args.nproc, ["train", args.config, *args.overrides], config, lambda: _train_here(config))


def _run_workers(nproc: int | None, worker: list[str], config: Config, run_here: Callable[[], int]) -> int:
    """``run_here`` in this process, or (``nproc`` > 1) in ``nproc`` workers started with the command ``worker``.

    The input is known to be good: the workers validate it again, but cannot fail on it.
    """
    from shardtune.launch.elastic import NodeSpec, default_nproc, launch_node
    from shardtune.launch.local import check_worker_count, running_as_worker

    if running_as_worker():
        return run_here()
    nproc = nproc if nproc is not None else default_nproc()
    warning = check_worker_count(nproc, "--nproc")
    if warning:
        sys.stderr.write(f"shardtune: warning: {warning}\n")
    if nproc > 1:
        return launch_node(NodeSpec(nproc_per_node=nproc), worker, config.network)
    return run_here()


def cmd_launch(args: argparse.Namespace) -> int:
    """One node's part of a multi-node run: this node's workers join the others at the rendezvous."""
    config = load_config(args.config, args.overrides)
    from shardtune.launch.elastic import launch_node, node_spec_from_args

    spec = node_spec_from_args(args)
    setup_logging(True)
    return launch_node(spec, ["train", args.config, *args.overrides], config.network)


def _as_continuation(config: Config) -> tuple[Config, str | None]:
    """A run started again after it failed: a restart by the launcher (``SHARDTUNE_RESTART_COUNT``) or a requeued
    Slurm job (``SHARDTUNE_REQUEUE_COUNT``, set by the sbatch script). It carries on from the newest checkpoint of
    its output directory complete on every node (``auto``): its own, which may have gone past the checkpoint it
    was resumed from. The config's own setting is where it starts if it has saved none yet (the second value): from
    the start, or from the checkpoint it was resumed from, as its first attempt did. Any other run is as
    configured."""
    resume = config.training.resume_from_checkpoint
    attempts = (os.environ.get(name, "0") for name in ("SHARDTUNE_RESTART_COUNT", "SHARDTUNE_REQUEUE_COUNT"))
    if resume == "auto" or not any(int(count) for count in attempts):
        return config, None
    training = config.training.model_copy(update={"resume_from_checkpoint": "auto"})
    return config.model_copy(update={"training": training}), resume


def _train_here(config: Config) -> int:
    """This process's part of the training: a worker, or the only process."""
    # Heavy imports only after the config is known to be good: errors above come back in a second.
    from shardtune.distributed.env import DistributedEnv
    from shardtune.peer_stop import lost_peer_line, peer_stop_status
    from shardtune.train.loop import NothingToTrain, run_training
    from shardtune.train.preemption import INTERRUPTED_LINE, Preempted, catch_interrupts, interrupted
    from shardtune.train.preflight import preflight
    from shardtune.train.watchdog import HANG_EXIT_CODE, enable_flight_recorder, wait_for_the_hang_report

    catch_interrupts()
    restarts = int(os.environ.get("SHARDTUNE_RESTART_COUNT", "0"))
    config, resume_otherwise = _as_continuation(config)
    if config.hang_timeout_s > 0:
        enable_flight_recorder()  # before the process group exists: it records from its creation
    env = DistributedEnv.from_environment(config.parallel.timeout_s, config.parallel.expert_parallel_size)
    setup_logging(env.is_main)
    if "SHARDTUNE_NNODES" in os.environ and env.local_rank == 0:
        ranks = env.mesh.node_ranks
        print(
            f"shardtune: {socket.gethostname()}: node {os.environ.get('SHARDTUNE_NODE_RANK')} of "
            f"{os.environ['SHARDTUNE_NNODES']}, local ranks 0-{env.local_world_size - 1} = global ranks "
            f"{ranks.start}-{ranks.stop - 1} of world size {env.world_size}, rendezvous "
            f"{os.environ.get('SHARDTUNE_RDZV_ENDPOINT')}, restart {restarts}",
            file=sys.stderr,
            flush=True,
        )
    try:
        # Every rank, before anything is written or loaded: all stop with the same line (printed once).
        preflight(config, env.device, env.world_size)
        run_training(config, env, sys.argv, resume_otherwise)
    except Preempted as stopped:
        # Every rank stops alike; one line for the run.
        say_once([stopped.line()], every_rank_says_it=True)
        return stopped.exit_code
    except NothingToTrain as done:
        log.info("%s", done)  # rank 0 alone logs at this level
        return 0
    except (KeyboardInterrupt, Exception) as error:
        # After Ctrl-C, a rank whose peer was interrupted first fails in the collective it shared with it;
        # likewise after a peer stopped alone (out of memory, rank 0's W&B login), which said so itself.
        if not isinstance(error, KeyboardInterrupt) and not interrupted():
            if wait_for_the_hang_report():
                return HANG_EXIT_CODE
            status = peer_stop_status(error, env)
            if status is not None:
                return status
            if lost := lost_peer_line(error):
                say_once([lost])  # every surviving rank meets it: said once under shardtune's launcher
                return EXIT_LOST_PEER
            raise
        say_once([INTERRUPTED_LINE], every_rank_says_it=True)
        return EXIT_INTERRUPTED
    finally:
        close_unless_worker(env)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Build (or find) the token store of a config, on any machine, before training."""
    config = load_config(args.config, args.overrides)
    setup_logging(True)
    from shardtune.data.prepare import describe, prepare_dataset
    from shardtune.model.load import load_tokenizer
    from shardtune.train.preflight import check_writable

    # A cache that cannot be written is the one line train and doctor say (not mkdir's traceback), said first.
    check_writable("data.cache_dir", config.data.resolved_cache_dir)
    data = prepare_dataset(config, load_tokenizer(config.model), timeout_s=config.data.prepare_timeout_s)
    print(f"token store: {data.store}")
    print(describe(data.summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardtune.checkpoint.export_checkpoint import export_checkpoint

    setup_logging(True)
    print(f"wrote {export_checkpoint(Path(args.checkpoint), Path(args.out), args.merge, args.overwrite)}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss and perplexity of trained weights, in one process or ``--nproc`` workers."""
    config = load_config(args.config, args.overrides)
    from shardtune.evaluate import check_request

    request = check_request(config, args.config, args.checkpoint, args.data, args.out, args.overwrite)
    options = ["--checkpoint", args.checkpoint, *(["--data", args.data] if args.data else [])]
    options += [*(["--out", args.out] if args.out else []), *(["--overwrite"] if args.overwrite else [])]
    worker = ["eval", args.config, *options, *args.overrides]
    return _run_workers(args.nproc, worker, config, lambda: _eval_here(request))


def _eval_here(request: EvalRequest) -> int:
    from shardtune.distributed.env import DistributedEnv
    from shardtune.errors import OutOfMemory
    from shardtune.evaluate import run_eval
    from shardtune.out_of_memory import EVAL_ADVICE, is_out_of_memory, out_of_memory_line
    from shardtune.peer_stop import peer_stop_status

    env = DistributedEnv.from_environment(
        request.config.parallel.timeout_s, request.config.parallel.expert_parallel_size
    )
    setup_logging(env.is_main)
    try:
        run_eval(request, env)
    except Exception as error:
        stop = (
            OutOfMemory(out_of_memory_line(error, env.rank, "in evaluation", EVAL_ADVICE))
            if is_out_of_memory(error)
            else error
        )
        # A peer that stopped alone said so itself; this rank's collective failed as it left.
        status = peer_stop_status(stop, env)
        if status is not None:
            return status
        if stop is error:
            raise
        raise stop from None
    finally:
        close_unless_worker(env)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shardtune.generate import generate_response

    setup_logging(True)
    answer = generate_response(
        args.model_dir, args.instruction, args.input, args.max_new_tokens, args.base, args.system, args.format
    )
    print(answer)
    if not answer:  # an empty line alone reads as a failure
        print(
            "shardtune: the answer is empty: the model ended it before any text (its end-of-sequence token, or "
            "special tokens only); a model trained longer, or another prompt, may answer",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardtune", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"shardtune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="fine-tune a model as a config describes")
    add_config_arguments(train)
    train.add_argument(
        "--nproc", type=int, default=None, help="workers on this machine (default: one per GPU, 1 on CPU)"
    )
    train.set_defaults(handler=cmd_train)

    launch = commands.add_parser("launch", help="one node's part of a multi-node run (every node runs this)")
    add_config_arguments(launch)
    add_node_arguments(launch)
    launch.set_defaults(handler=cmd_launch)

    add_slurm_parser(commands)
    add_doctor_parser(commands)
    add_plan_parser(commands)

    prepare = commands.add_parser("prepare", help="tokenize, validate and cache the dataset ahead of training")
    add_config_arguments(prepare)
    prepare.set_defaults(handler=cmd_prepare)

    add_convert_parser(commands)
    add_expert_usage_parser(commands)
    add_plot_parser(commands)
    add_bench_parser(commands)

    export = commands.add_parser("export", help="a checkpoint -> PEFT adapter, merged model, or HF model")
    export.add_argument("checkpoint", help="a checkpoint-<step> directory, or with --merge a final/ adapter directory")
    export.add_argument("--out", required=True, help="directory to write")
    export.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base weights")
    export.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out (never a run, a checkpoint or the input)"
    )
    export.set_defaults(handler=cmd_export)

    evaluate = commands.add_parser("eval", help="loss and perplexity of a checkpoint or final/ on eval data")
    add_config_arguments(evaluate)
    evaluate.add_argument("--checkpoint", required=True, help="a checkpoint-<step>/ or final/ directory")
    evaluate.add_argument(
        "--data", default=None, help="evaluate on this file, prepared like the config's data (default: its eval data)"
    )
    evaluate.add_argument("--out", default=None, help="the JSON result (default: CHECKPOINT/eval.json)")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an existing result file")
    evaluate.add_argument("--nproc", type=int, default=None, help="workers on this machine (default: as train)")
    evaluate.set_defaults(handler=cmd_eval)

    generate = commands.add_parser("generate", help="answer one instruction with a trained model (final/)")
    generate.add_argument("model_dir", help="a final/ directory: PEFT adapter or full model, with tokenizer")
    generate.add_argument(
        "--instruction", required=True, help="the instruction, user message, or (text format) text to continue"
    )
    generate.add_argument("--input", default="", help="alpaca format: optional input for the instruction")
    generate.add_argument("--system", default=None, help="messages format: a system message before the user's")
    generate.add_argument(
        "--format",
        choices=("alpaca", "messages", "text"),
        default=None,
        help="the data format the model was trained on (default: from the run's config.yaml)",
    )
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--base", default=None, help="base model for an adapter (default: from adapter_config)")
    generate.set_defaults(handler=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command line; its bad input and faults end as their lines. Ctrl-C: ``shardtune.entry.main``,
    which runs this."""
    parser = build_parser()
    # Overrides may come after options (``train cfg.yaml --nproc 2 lora.r=8``): argparse leaves such
    # trailing positionals unparsed, so they are collected here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.handler(args)
    except InputError as exc:
        say_once([f"shardtune: error: {line}" for line in exc.lines])
        return exc.exit_code
    except RunFault as exc:
        # Most faults every rank raises with the same words (they agree on it first): one says it.
        say_once([f"shardtune: error: {line}" for line in exc.lines], every_rank_says_it=exc.every_rank_raises_it)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""The training loop: the one path every run takes, from one CPU process up.

Read top to bottom: set up (data, model, optimizer), then for each optimizer step run this rank's
micro-batches, normalize the summed token loss by the step's global target-token count, clip, step,
log, evaluate; finally evaluate, export ``final/`` and write ``metrics.json``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from shardtune.checkpoint.checkpointer import Checkpointer, RunTotals, find_resume_checkpoint
from shardtune.checkpoint.export import save_final
from shardtune.checkpoint.merge import save_merged
from shardtune.config import Config
from shardtune.data.collate import Batch, collate
from shardtune.data.prepare import PreparedData, describe, prepare_dataset
from shardtune.data.sampler import GlobalBatchSampler, rank_micro_batches
from shardtune.data.store import SequenceArrays
from shardtune.distributed.compile import LayerCompiler
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.layer_graphs import installed_graphs, replayed_layers
from shardtune.distributed.parallelize import (
    clip_gradients,
    decoder_layers,
    full_state_dict,
    gradient_sync,
    local_parameter_bytes,
    parallelize,
    plan_checkpointing,
    plan_parallelism,
    unwrap,
)
from shardtune.distributed.storage import is_builder, storage_domains
from shardtune.doctor.report import size
from shardtune.errors import ConfigError, OutOfMemory
from shardtune.faults import install_faults
from shardtune.metrics.flops import peak_flops
from shardtune.metrics.memory import peak_memory_gib, start_training_peak
from shardtune.metrics.profiler import StepProfiler
from shardtune.metrics.progress import EvalProgress, Progress
from shardtune.metrics.sinks import MetricSink, open_sinks
from shardtune.metrics.train_interval import TrainInterval
from shardtune.model.fused_moe import identity_experts, use_fused_experts
from shardtune.model.init_routing import set_init_routing
from shardtune.model.load import Precision, build_model, load_tokenizer
from shardtune.model.moe import find_moe_blocks
from shardtune.out_of_memory import EVAL_ADVICE, TRAINING_ADVICE, is_out_of_memory, out_of_memory_line
from shardtune.plan.memory import micro_batch_tokens
from shardtune.plan.shape import read_model_shape
from shardtune.run_dir import claim_output_dir, package_versions, write_metrics, write_run_start
from shardtune.run_manifest import describe_world
from shardtune.train.eval import evaluate
from shardtune.train.loss import (
    SoftmaxGradient,
    compiled_softmax_gradient,
    describe_loss,
    softmax_compiles_right_on,
    summed_token_loss,
)
from shardtune.train.nonfinite import NonFiniteGuard
from shardtune.train.optim import build_optimizer
from shardtune.train.preemption import Preempted, PreemptionWatch
from shardtune.train.preflight import check_model, check_token_ids
from shardtune.train.routing import RouterTraining
from shardtune.train.schedule import build_scheduler, warmup_steps_for
from shardtune.train.watchdog import start_heartbeat

log = logging.getLogger("shardtune")


def total_steps_for(config: Config, sampler: GlobalBatchSampler) -> int:
    if config.training.max_steps > 0:
        return config.training.max_steps
    return max(1, math.ceil(config.training.num_train_epochs * sampler.batches_per_epoch))


def prepare_run_data(
    config: Config, env: DistributedEnv, tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig
) -> PreparedData:
    """The run's token store, built by one process and read by every rank, its ids checked against the model."""
    # Tokenizing a large dataset can take far longer than any collective should: the wait for the
    # builder has its own, generous timeout, and nobody waits inside a collective meanwhile.
    builder = is_builder(env, config.data.resolved_cache_dir, config.parallel.timeout_s)
    data = prepare_dataset(config, tokenizer, is_builder=builder, timeout_s=config.data.prepare_timeout_s)
    log.info("data: %s", describe(data.summary))
    check_token_ids(data, model_config, config, tokenizer.pad_token_id)  # every rank reads the same store
    return data


def build_run_model(config: Config, env: DistributedEnv) -> tuple[torch.nn.Module, list]:
    """The model as the run trains it, before ``parallelize``, and its MoE blocks (fused where they run).

    Only global rank 0 reads the weights; the others build an empty replica, which ``parallelize``
    fills from rank 0's. ``shardtune eval`` builds its model here too, so it evaluates what training did.
    """
    model = build_model(config, env.device, training=True, materialize=env.is_main)
    moe_blocks = find_moe_blocks(model, decoder_layers(model))
    # The other ranks' replicas receive rank 0's weights.
    set_init_routing(model, moe_blocks, config.model.init_routing, config.training.seed, materialized=env.is_main)
    if config.training.moe_aux_loss_coef > 0 and not moe_blocks:
        name = type(model.get_base_model() if config.lora.enabled else model).__name__
        raise ConfigError(f"training.moe_aux_loss_coef: {name} has no MoE layers; leave it at 0")
    expert_counts = [(block.num_experts, identity_experts(block.experts)) for block in moe_blocks]
    env.mesh.check_model(expert_counts, config.model.name_or_path)
    blocks = use_fused_experts(
        model, decoder_layers(model), config.model.experts_implementation, config.model.grouped_gemm, env.device
    )
    return model, blocks


def evaluate_run_model(
    model: torch.nn.Module,
    examples: SequenceArrays,
    config: Config,
    env: DistributedEnv,
    precision: Precision,
    pad_token_id: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """The run's evaluation (its batch size and loss settings): during training and in ``shardtune eval``.
    ``on_batch`` runs after each batch, with the batches done and in all (``evaluate``)."""
    training = config.training
    return evaluate(
        model,
        examples,
        training.per_device_eval_batch_size or training.per_device_train_batch_size,
        pad_token_id,
        env,
        precision.autocast,
        training.loss_chunk_tokens,
        config.model.liger_kernel,
        on_batch=on_batch,
    )


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    env: DistributedEnv,
    autocast: torch.dtype | None,
    routing: RouterTraining | None = None,
    loss_chunk_tokens: int | str = 0,
    fused_loss: bool = False,
    softmax_gradient: SoftmaxGradient | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward this rank's micro-batches of one optimizer step.

    The loss of a step is (sum of token losses over every micro-batch on every rank) divided by the
    step's total target tokens, so each token weighs the same however the examples were split into
    micro-batches or ranks. The count is known before any forward pass: one all-reduce per step.
    Data-parallel wrappers average gradients over ranks, so each rank's loss is scaled by the world
    size to make the reduced gradient the gradient of that global sum (the data-parallel size: every rank,
    expert-parallel ones included, reads its own micro-batches; the routed experts' gradients are divided
    by it too, see ``parallelize``). Gradients are reduced only on
    the last micro-batch. MoE models add the routers' load-balancing term (see ``RouterTraining``).
    Returns this rank's (summed token loss, target tokens) on the device: the LM loss alone.
    """
    local_targets = torch.tensor(
        float(sum(batch.num_targets for batch in micro_batches)), dtype=torch.float64, device=env.device
    )
    global_targets = env.all_reduce_sum(local_targets.clone()).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    for index, batch in enumerate(micro_batches):
        with gradient_sync(model, sync=index == len(micro_batches) - 1):
            batch = batch.to(env.device)
            with routing.forward(batch) if routing else contextlib.nullcontext():
                batch_loss = summed_token_loss(model, batch, autocast, loss_chunk_tokens, fused_loss, softmax_gradient)
            objective = batch_loss * (env.mesh.dp_size / global_targets)
            balance = routing.balance_term(len(micro_batches)) if routing else None
            (objective if balance is None else objective + balance).backward()
        loss_sum += batch_loss.detach().double()
    return loss_sum, local_targets


class NothingToTrain(Exception):
    """The checkpoint to resume is already at (or past) the last step: the run directory stays as it is."""


@dataclass
class TrainingResult:
    metrics: dict[str, Any]  # as written to metrics.json
    model: torch.nn.Module  # the trained model (a PeftModel for LoRA), still on its device


def freeze_long_lived_objects() -> None:
    """After the first step, which built and compiled what the run keeps (modules, compiled graphs and their
    caches): one full collection, then every object still alive is moved out of the cyclic garbage collector's
    reach (``gc.freeze``), so that its later full collections walk only what later steps made.

    Python starts a full collection once enough objects have outlived two younger ones, and until then each one
    walks every object the process holds: after Qwen3-30B-A3B's 48 layers compiled, 280-520 ms on the host of
    one H200, while the device, whose kernels the host launches, waited. One fell in a measured step in four of
    five 15-19 step runs of ``shardtune bench`` (that step 2.5 times as long; a 16-step measurement 8.5% lower),
    never in runs with the objects frozen. An object frozen is still freed when its last reference goes; only
    a reference cycle among frozen objects is not reclaimed."""
    gc.collect()
    gc.freeze()


def run_training(
    config: Config, env: DistributedEnv, argv: list[str], resume_otherwise: str | None = None
) -> TrainingResult:
    """Train as configured; ``final/`` and ``metrics.json`` are written by global rank 0. ``resume_otherwise``: the
    checkpoint to start from where ``resume_from_checkpoint: auto`` finds none (a restarted run's first start)."""
    # However the run ends (done, an error, a preemption), what watches it stops with it.
    with contextlib.ExitStack() as on_exit:
        # What freeze_long_lived_objects froze goes back to the collector with the run (a caller training again
        # in this process, the interpreter's exit).
        on_exit.callback(gc.unfreeze)
        run = types.SimpleNamespace(heartbeat=None)  # where the run is, once its steps begin
        try:
            return _train(config, env, argv, resume_otherwise, on_exit, run)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            heartbeat = run.heartbeat
            if heartbeat is None:
                line = out_of_memory_line(error, env.rank, "while loading the model", TRAINING_ADVICE)
                raise OutOfMemory(line) from None
            where = f"in step {heartbeat.step} ({heartbeat.phase.replace('_', ' ')})"
            advice = EVAL_ADVICE if heartbeat.phase.startswith("eval") else TRAINING_ADVICE
            raise OutOfMemory(out_of_memory_line(error, env.rank, where, advice)) from None


def _train(
    config: Config,
    env: DistributedEnv,
    argv: list[str],
    resume_otherwise: str | None,
    on_exit: contextlib.ExitStack,
    run: types.SimpleNamespace,
) -> TrainingResult:
    training = config.training
    output_dir = Path(training.output_dir)
    # Every rank checks the same inputs the same way, before any collective: all stop with one error.
    model_config = check_model(config)
    # Before anything there is removed or written: every copy of the output directory is this run's alone.
    output_domains = storage_domains(env, output_dir, config.parallel.timeout_s, purpose="output-dir")
    lock = claim_output_dir(env, training, output_domains)
    if lock is not None:
        on_exit.callback(lock.release)
    transformers.set_seed(training.seed)
    hostnames = env.hostnames()
    world = describe_world(env, hostnames)  # a collective
    # Before anything is written or loaded: the checkpoint this run continues, if any, and whether it may.
    resume = find_resume_checkpoint(config, env, resume_otherwise)

    precision = Precision.resolve(config, env.device)
    tokenizer = load_tokenizer(config.model)
    data = prepare_run_data(config, env, tokenizer, model_config)
    micro_batch_size = training.per_device_train_batch_size
    global_batch_size = micro_batch_size * training.gradient_accumulation_steps * env.mesh.dp_size
    sampler = GlobalBatchSampler(len(data.train), global_batch_size, training.seed)
    total_steps = total_steps_for(config, sampler)
    if resume and resume.step >= total_steps:
        raise NothingToTrain(
            f"{resume.path} is at step {resume.step} and this run ends at step {total_steps}: nothing to train, "
            "nothing changed; to train on, raise training.max_steps (or num_train_epochs); for the model, "
            f"shardtune export {resume.path} --out DIR"
        )
    if env.is_main:
        write_run_start(output_dir, config, argv, world)

    model, moe_blocks = build_run_model(config, env)
    routing = RouterTraining(moe_blocks, training.moe_aux_loss_coef, env.device) if moe_blocks else None
    shape = read_model_shape(model, config, precision)
    trainable, total = shape.trainable, shape.total
    log.info("parameters: %s trainable of %s (%.2f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    plan = plan_parallelism(shape, config, env)
    log.info("%s", plan.describe(env.world_size))
    vocab, tokens = shape.loss_head_vocab, micro_batch_tokens(config)
    compiler = LayerCompiler()
    # The chunked loss's softmax compiles with the layers, by the same compiler (and its eager fallback).
    softmax_compiled = config.parallel.compiles_on(env.device.type) and softmax_compiles_right_on(env.device.type)
    softmax_gradient = compiled_softmax_gradient(compiler) if softmax_compiled else None
    loss_kind = describe_loss(training.loss_chunk_tokens, vocab, tokens, config.model.liger_kernel, softmax_compiled)
    log.info("%s", loss_kind)
    checkpointing = plan_checkpointing(shape, config, env, plan)
    model = parallelize(model, plan, config, env, precision.compute, materialized=env.is_main, compiler=compiler,
                        checkpointing=checkpointing)  # fmt: skip
    model.train()
    install_faults(env.rank).attach(model)

    warmup = warmup_steps_for(total_steps, training.warmup_ratio, training.warmup_steps)
    optimizer = build_optimizer(model, training, env.device)
    scheduler = build_scheduler(optimizer, total_steps, warmup, training.min_lr_ratio)
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    max_norm = training.max_grad_norm if training.max_grad_norm > 0 else math.inf
    log.info(
        "training: %d steps, global batch %d (%d per device x %d accumulation x %d ranks), warmup %d steps",
        total_steps,
        global_batch_size,
        micro_batch_size,
        training.gradient_accumulation_steps,
        env.world_size,
        warmup,
    )

    checkpointer = Checkpointer(
        config, env, model, optimizer, scheduler, sampler, tokenizer, plan.strategy, output_domains
    )
    preemption = PreemptionWatch(env)
    on_exit.callback(preemption.restore_handlers)
    checkpointer.remove_partial()
    start_step = checkpointer.load(resume.path) if resume else 0
    start_training_peak(env.device)

    sinks: list[MetricSink] = open_sinks(config, output_dir, start_step) if env.is_main else []
    progress = Progress(total_steps, config.logging.progress_bar, enabled=env.is_main)
    pad_id = tokenizer.pad_token_id
    eval_results: list[dict[str, float]] = []
    heartbeat, watchdog = start_heartbeat(
        output_dir, env.rank, env.world_size, config.hang_timeout_s, training.heartbeat_interval_s
    )
    on_exit.callback(watchdog.close)
    run.heartbeat = heartbeat

    def run_eval(step: int) -> None:
        if len(data.eval) == 0:
            return
        heartbeat.beat(step, "eval")
        started = time.perf_counter()
        said = EvalProgress(progress.message)

        def on_batch(done: int, total: int) -> None:
            heartbeat.progress("eval.batch")
            said(done, total)

        result = evaluate_run_model(model, data.eval, config, env, precision, pad_id, on_batch=on_batch)
        result = {**result, "eval_time_s": time.perf_counter() - started}
        eval_results.append(result)
        for sink in sinks:
            sink.log("eval", step, result)
        progress.message(
            f"eval at step {step}: loss {result['eval_loss']:.4f}, perplexity {result['eval_perplexity']:.2f}"
        )

    if training.eval_on_start and start_step == 0:
        run_eval(0)

    # Per-step sums of the logging interval; one all-gather per logging step (see TrainInterval).
    peak = peak_flops(env.device_name(), config.logging.peak_tflops)
    interval = TrainInterval(env, hostnames, shape.flops, peak)
    last_loss = float("nan")

    def saving(step: int, phase: str) -> contextlib.AbstractContextManager:
        """A save's heartbeat phase: beats while any rank's save writes (see ``SaveTicker``)."""
        return heartbeat.saving(step, phase, env.store(), output_dir, watchdog.poll_s)

    nonfinite = NonFiniteGuard(env, training.on_nonfinite, training.max_nonfinite_steps, output_dir, optimizer)
    run_started = time.perf_counter()

    def segment_totals(tokens_per_rank: list[int], wall_time_s: float) -> RunTotals:
        """This segment's share of the run's totals (each resume starts a segment)."""
        first_eval_loss = eval_results[0]["eval_loss"] if eval_results else None
        return RunTotals(tokens_per_rank, interval.run_train_time_so_far_s(), wall_time_s, first_eval_loss)

    checkpointer.segment_totals = lambda: segment_totals([interval.run_tokens], time.perf_counter() - run_started)
    profiler = StepProfiler(config.logging.profile_steps, output_dir, env.rank, env.device, config.logging.profile_host)
    # The decoder layers' CUDA graphs, where installed: the step that captures them costs the capture's time,
    # which `bench` must not take for the replayed steps' rate.
    layer_graphs, graphs_captured_in_step = installed_graphs(model), None
    for step in range(start_step + 1, total_steps + 1):
        profiler.step_begins(step)
        interval.start_step()
        heartbeat.beat(step, "forward_backward")
        micro_batches = [
            collate([data.train.sequence(i) for i in indices], pad_id, config.data.packing, config.data.batch_length)
            for indices in rank_micro_batches(sampler.next_global_batch(), env.mesh, micro_batch_size)
        ]
        interval.data_ready(micro_batches)
        loss_sum, step_targets = accumulate_gradients(
            model,
            micro_batches,
            env,
            precision.autocast,
            routing,
            training.loss_chunk_tokens,
            config.model.liger_kernel,
            softmax_gradient,
        )
        if layer_graphs is not None and graphs_captured_in_step is None and layer_graphs.graphs is not None:
            graphs_captured_in_step = step
        heartbeat.beat(step, "optimizer")
        grad_norm = clip_gradients(trainable_params, max_norm, env.mesh)
        # A non-finite step changes neither the weights nor the logged loss, on every rank alike.
        update, counted = nonfinite.check(step, loss_sum, grad_norm)
        interval.add_loss(loss_sum, step_targets, counted)

        lr = optimizer.param_groups[0]["lr"]
        if update:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == start_step + 1:  # counted in the first step's time, as its compilation is
            freeze_long_lived_objects()
            compiler.log_compile_time()
        interval.end_step()
        profiler.step_ends(step)
        progress.advance()

        if step % training.logging_steps == 0 or step == total_steps:
            nonfinite.settle()  # at no cost here: the logging waits for the device anyway
            measured = interval.reduce()  # the host sync of this interval
            last_loss = measured["loss"]
            record = {
                "epoch": round(sampler.epoch_progress, 4),
                "loss": last_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                **measured,
                "elapsed_s": time.perf_counter() - run_started,
            }
            usage = routing.interval_record(env, step) if routing else None
            if usage:
                record["moe_balance_loss"] = usage["balance_loss"]
                record["moe_max_mean_ratio"] = max(layer["max_mean_ratio"] for layer in usage["layers"])
            for sink in sinks:
                sink.log("train", step, record)
                if usage:
                    sink.log("expert_usage", step, {key: value for key, value in usage.items() if key != "step"})
            progress.report(step, record)

        if training.eval_steps and step % training.eval_steps == 0 and step != total_steps:
            run_eval(step)
        saved = None
        if training.save_steps and (step % training.save_steps == 0 or step == total_steps):
            nonfinite.settle()  # a run that must stop saves nothing more
            with saving(step, "checkpoint"):
                saved = checkpointer.save(step)
        heartbeat.beat(step, "end_of_step")
        stop = preemption.requested() if step < total_steps else None
        if stop:
            # Ctrl-C saves only in a run that saves checkpoints anyway; a preemption always saves. Whatever
            # checkpoint_mode says, in full: a resumed run must continue exactly where this one stopped.
            wanted = stop != "SIGINT" or bool(training.save_steps)
            nonfinite.settle()
            if wanted and (saved is None or training.checkpoint_mode != "full"):
                with saving(step, "stop_checkpoint"):
                    saved = checkpointer.save(step, mode="full")
            for sink in sinks:
                sink.close()
            progress.close()
            preemption.close()
            raise Preempted(stop, step, None if saved is None else str(saved))
    preemption.close()
    nonfinite.settle()
    heartbeat.beat(total_steps, "final")

    wall_time = time.perf_counter() - run_started
    run_eval(total_steps)
    progress.close()

    with saving(total_steps, "final_save"):
        # A collective when the weights are sharded. An adapter's files need only the trained tensors; merging
        # a random init's adapter also needs its base weights, which are in no file.
        adapter_only = config.lora.enabled and not (training.merge_final and config.model.init == "random")
        state = full_state_dict(model, env.mesh, trainable_only=adapter_only)
        if env.is_main:
            if state is not None:
                gathered = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
                which = "the trained weights" if adapter_only else "every weight"
                log.info("final save: gathered %s to rank 0 (%s)", which, size(gathered))
            save_final(unwrap(model), tokenizer, output_dir / "final", precision.compute, state, config)
            log.info("saved %s to %s", "LoRA adapter" if config.lora.enabled else "model", output_dir / "final")
            if training.merge_final:
                merged_bytes = save_merged(unwrap(model), tokenizer, output_dir / "final-merged", config, state)
                log.info("saved the merged model to %s (%s)", output_dir / "final-merged", size(merged_bytes))
        env.barrier()  # the others wait for rank 0's write inside the save, beating with its progress

    # A resumed run counts the segments before it too (their totals came with the checkpoint).
    segment = segment_totals([int(t) for t in env.all_gather_floats(interval.run_tokens)], wall_time)
    run = checkpointer.earlier_totals.plus(segment)
    train_time, tokens_per_rank = run.train_time_s, run.tokens_per_rank
    rates_per_rank = [tokens / max(train_time, 1e-9) for tokens in tokens_per_rank]
    peak_per_rank = env.all_gather_floats(peak_memory_gib(env.device))
    parameter_bytes = [int(b) for b in env.all_gather_floats(local_parameter_bytes(model))]
    metrics: dict[str, Any] = {
        "wall_time_s": run.wall_time_s,
        "train_time_s": train_time,
        "steps": total_steps,
        "epochs": round(sampler.epoch_progress, 4),
        "tokens": sum(tokens_per_rank),
        "tokens_per_rank": tokens_per_rank,
        "tokens_per_s": sum(rates_per_rank),
        "tokens_per_s_per_rank": rates_per_rank,
        "target_tokens": int(data.summary["train"]["target_tokens"]),
        "peak_memory_gib_per_rank": peak_per_rank,
        "parameter_bytes_per_rank": parameter_bytes,
        "world_size": env.world_size,
        "hostnames": hostnames,
        "gpu": env.device_name(),
        "peak_tflops": peak / 1e12 if peak else None,
        **{name: version for name, version in package_versions().items() if name in ("torch", "transformers", "peft")},
        "model": config.model.name_or_path,
        "dataset": config.data.dataset_path,
        "use_lora": config.lora.enabled,
        "dtype": str(precision.compute).removeprefix("torch."),
        "bf16": precision.autocast == torch.bfloat16,
        "gradient_checkpointing": training.gradient_checkpointing,
        "checkpointed_layers": checkpointing.count,
        "checkpointed_parts": checkpointing.counts(),
        "cuda_graph_layers": replayed_layers(model),
        "cuda_graphs_captured_in_step": graphs_captured_in_step,
        "loss": loss_kind,
        "strategy": plan.strategy,
        "trainable_params": trainable,
        "total_params": total,
        "routed_expert_trainable_params": shape.routed_trainable,
        "global_batch_size": global_batch_size,
        "train_loss": last_loss,
        "data": {"store": str(data.store), **data.summary},
        "packing": config.data.packing,
    }
    if eval_results:
        metrics.update(
            first_eval_loss=run.first_eval_loss,
            eval_loss=eval_results[-1]["eval_loss"],
            eval_perplexity=eval_results[-1]["eval_perplexity"],
        )
    if env.is_main:
        write_metrics(output_dir, metrics)
        for sink in sinks:
            sink.close()
        log.info(
            "done: %d steps in %.1f s, %s tokens/s, final train loss %.4f%s",
            total_steps,
            run.wall_time_s,
            f"{metrics['tokens_per_s']:,.0f}",
            last_loss,
            f", eval loss {metrics['eval_loss']:.4f}" if eval_results else "",
        )
    return TrainingResult(metrics, model)

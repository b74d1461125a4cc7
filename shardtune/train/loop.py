"""The training loop: the one path every run takes, from one CPU process up.

Read top to bottom: set up (data, model, optimizer), then for each optimizer step run this rank's
micro-batches, normalize the summed token loss by the step's global target-token count, clip, step,
log, evaluate; finally evaluate, export ``final/`` and write ``metrics.json``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from shardtune.checkpoint.checkpointer import Checkpointer
from shardtune.checkpoint.export import save_final
from shardtune.config import Config
from shardtune.data.collate import Batch, collate
from shardtune.data.prepare import describe, prepare_dataset
from shardtune.data.sampler import GlobalBatchSampler, rank_micro_batches
from shardtune.distributed.env import DistributedEnv
from shardtune.distributed.parallelize import (
    decoder_layers,
    full_norm,
    full_state_dict,
    gradient_sync,
    local_parameter_bytes,
    parallelize,
    plan_parallelism,
    unwrap,
)
from shardtune.distributed.storage import is_builder
from shardtune.errors import ConfigError
from shardtune.faults import install_faults
from shardtune.metrics.flops import peak_flops, run_token_flops
from shardtune.metrics.memory import peak_memory_gib, start_training_peak
from shardtune.metrics.profiler import StepProfiler
from shardtune.metrics.progress import Progress
from shardtune.metrics.sinks import MetricSink, open_sinks
from shardtune.metrics.train_interval import TrainInterval
from shardtune.model.load import Precision, build_model, load_tokenizer
from shardtune.model.lora import count_parameters
from shardtune.model.moe import find_moe_blocks
from shardtune.run_dir import package_versions, write_metrics, write_run_start
from shardtune.run_manifest import describe_world
from shardtune.train.eval import evaluate
from shardtune.train.loss import summed_token_loss
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


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    env: DistributedEnv,
    autocast: torch.dtype | None,
    routing: RouterTraining | None = None,
    loss_chunk_tokens: int = 0,
    fused_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward this rank's micro-batches of one optimizer step.

    The loss of a step is (sum of token losses over every micro-batch on every rank) divided by the
    step's total target tokens, so each token weighs the same however the examples were split into
    micro-batches or ranks. The count is known before any forward pass: one all-reduce per step.
    Data-parallel wrappers average gradients over ranks, so each rank's loss is scaled by the world
    size to make the reduced gradient the gradient of that global sum. Gradients are reduced only on
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
                batch_loss = summed_token_loss(model, batch, autocast, loss_chunk_tokens, fused_loss)
            objective = batch_loss * (env.world_size / global_targets)
            balance = routing.balance_term(len(micro_batches)) if routing else None
            (objective if balance is None else objective + balance).backward()
        loss_sum += batch_loss.detach().double()
    return loss_sum, local_targets


@dataclass
class TrainingResult:
    metrics: dict[str, Any]  # as written to metrics.json
    model: torch.nn.Module  # the trained model (a PeftModel for LoRA), still on its device


def run_training(config: Config, env: DistributedEnv, argv: list[str]) -> TrainingResult:
    """Train as configured; ``final/`` and ``metrics.json`` are written by global rank 0."""
    # However the run ends (done, an error, a preemption), what watches it stops with it.
    with contextlib.ExitStack() as on_exit:
        return _train(config, env, argv, on_exit)


def _train(config: Config, env: DistributedEnv, argv: list[str], on_exit: contextlib.ExitStack) -> TrainingResult:
    training = config.training
    output_dir = Path(training.output_dir)
    # Every rank checks the same inputs the same way, before any collective: all stop with one error.
    model_config = check_model(config)
    transformers.set_seed(training.seed)
    hostnames = env.hostnames()
    world = describe_world(env, hostnames)  # a collective
    if env.is_main:
        write_run_start(output_dir, config, argv, world)

    precision = Precision.resolve(config, env.device)
    tokenizer = load_tokenizer(config.model)
    # Tokenizing a large dataset can take far longer than any collective should: the wait for the
    # builder has its own, generous timeout, and nobody waits inside a collective meanwhile.
    builder = is_builder(env, config.data.resolved_cache_dir, config.parallel.timeout_s)
    data = prepare_dataset(config, tokenizer, is_builder=builder, timeout_s=config.data.prepare_timeout_s)
    log.info("data: %s", describe(data.summary))
    check_token_ids(data, model_config, config, tokenizer.pad_token_id)  # every rank reads the same store

    # Only global rank 0 reads the weights; the others build an empty replica and receive them.
    model = build_model(config, env.device, training=True, materialize=env.is_main)
    moe_blocks = find_moe_blocks(model, decoder_layers(model))
    if training.moe_aux_loss_coef > 0 and not moe_blocks:
        name = type(model.get_base_model() if config.lora.enabled else model).__name__
        raise ConfigError(f"training.moe_aux_loss_coef: {name} has no MoE layers; leave it at 0")
    routing = RouterTraining(moe_blocks, training.moe_aux_loss_coef, env.device) if moe_blocks else None
    trainable, total = count_parameters(model)
    log.info("parameters: %s trainable of %s (%.2f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    plan = plan_parallelism(model, config, env)
    log.info("%s", plan.describe(env.world_size))
    model = parallelize(model, plan, config, env, precision.compute, materialized=env.is_main)
    model.train()
    install_faults(env.rank).attach(model)

    micro_batch_size = training.per_device_train_batch_size
    global_batch_size = micro_batch_size * training.gradient_accumulation_steps * env.world_size
    sampler = GlobalBatchSampler(len(data.train), global_batch_size, training.seed)
    total_steps = total_steps_for(config, sampler)
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

    checkpointer = Checkpointer(config, env, model, optimizer, scheduler, sampler, tokenizer, plan.strategy)
    preemption = PreemptionWatch(env)
    checkpointer.remove_partial()
    resume_path = checkpointer.resume_path()
    start_step = checkpointer.load(resume_path) if resume_path else 0
    start_training_peak(env.device)

    sinks: list[MetricSink] = open_sinks(config, output_dir, start_step) if env.is_main else []
    progress = Progress(total_steps, config.logging.progress_bar, enabled=env.is_main)
    pad_id = tokenizer.pad_token_id
    # max_length: every batch has the same shape, so compiled layers never meet a new sequence length.
    pad_to_length = config.data.max_length if config.data.pad_to == "max_length" else None
    eval_results: list[dict[str, float]] = []

    def run_eval(step: int) -> None:
        if len(data.eval) == 0:
            return
        started = time.perf_counter()
        result = evaluate(
            model,
            data.eval,
            training.per_device_eval_batch_size or micro_batch_size,
            pad_id,
            env,
            precision.autocast,
            training.loss_chunk_tokens,
            config.model.liger_kernel,
        )
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
    flops = run_token_flops(unwrap(model), config.data.max_length, config.lora.enabled, trainable, total)
    peak = peak_flops(env.device_name(), config.logging.peak_tflops)
    interval = TrainInterval(env, hostnames, flops, peak)
    last_loss = float("nan")
    heartbeat, watchdog = start_heartbeat(
        output_dir, env.rank, env.world_size, config.hang_timeout_s, training.heartbeat_interval_s
    )
    on_exit.callback(watchdog.close)
    nonfinite = NonFiniteGuard(env, training.on_nonfinite, training.max_nonfinite_steps, output_dir)
    run_started = time.perf_counter()
    profiler = StepProfiler(config.logging.profile_steps, output_dir, env.rank, env.device)
    for step in range(start_step + 1, total_steps + 1):
        profiler.step_begins(step)
        interval.start_step()
        heartbeat.beat(step, "forward_backward")
        micro_batches = [
            collate([data.train.sequence(i) for i in indices], pad_id, config.data.packing, pad_to_length)
            for indices in rank_micro_batches(sampler.next_global_batch(), env.rank, env.world_size, micro_batch_size)
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
        )
        heartbeat.beat(step, "optimizer")
        grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(trainable_params, max_norm))
        # A non-finite step changes neither the weights nor the logged loss, on every rank alike.
        update = nonfinite.step_is_finite(step, loss_sum, grad_norm)
        if update:
            interval.add_loss(loss_sum, step_targets)

        lr = optimizer.param_groups[0]["lr"]
        if update:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        interval.end_step()
        profiler.step_ends(step)
        progress.advance()

        if step % training.logging_steps == 0 or step == total_steps:
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
            heartbeat.beat(step, "eval")
            run_eval(step)
        saved = None
        if training.save_steps and (step % training.save_steps == 0 or step == total_steps):
            heartbeat.beat(step, "checkpoint")
            saved = checkpointer.save(step)
        heartbeat.beat(step, "end_of_step")
        if step < total_steps and preemption.requested():
            # Whatever checkpoint_mode says: a requeued job must continue exactly where this one stopped.
            if saved is None or training.checkpoint_mode != "full":
                saved = checkpointer.save(step, mode="full")
            log.warning("%s: stopping after step %d; %s holds the run", preemption.signal_name, step, saved)
            for sink in sinks:
                sink.close()
            progress.close()
            preemption.close()
            raise Preempted(step, str(saved))
    preemption.close()
    heartbeat.beat(total_steps, "final")

    wall_time = time.perf_counter() - run_started
    run_eval(total_steps)
    progress.close()

    state = full_state_dict(model)  # a collective when the weights are sharded
    if env.is_main:
        save_final(unwrap(model), tokenizer, output_dir / "final", precision.compute, state)
        log.info("saved %s to %s", "LoRA adapter" if config.lora.enabled else "model", output_dir / "final")

    train_time = interval.run_train_time_s
    tokens_per_rank = [int(t) for t in env.all_gather_floats(interval.run_tokens)]
    rates_per_rank = env.all_gather_floats(interval.run_tokens / max(train_time, 1e-9))
    peak_per_rank = env.all_gather_floats(peak_memory_gib(env.device))
    parameter_bytes = [int(b) for b in env.all_gather_floats(local_parameter_bytes(model))]
    metrics: dict[str, Any] = {
        "wall_time_s": wall_time,
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
        "strategy": plan.strategy,
        "trainable_params": trainable,
        "total_params": total,
        "global_batch_size": global_batch_size,
        "train_loss": last_loss,
        "data": {"store": str(data.store), **data.summary},
        "packing": config.data.packing,
    }
    if eval_results:
        metrics.update(
            first_eval_loss=eval_results[0]["eval_loss"],
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
            wall_time,
            f"{metrics['tokens_per_s']:,.0f}",
            last_loss,
            f", eval loss {metrics['eval_loss']:.4f}" if eval_results else "",
        )
    return TrainingResult(metrics, model)

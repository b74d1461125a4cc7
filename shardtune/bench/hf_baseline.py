"""The comparison of ``shardtune bench --baseline hf``: HF Trainer + PEFT, as the seeds trained, on the
same model shape, random weights, LoRA settings and examples as the shardtune run.

    python -m shardtune.bench.hf_baseline CONFIG OUT_DIR PADDING [section.key=value ...]
    (under torchrun for several devices: Trainer runs DDP)

The seeds trained one example per sequence, padded (``PADDING`` ``max_length``: to the sequence length,
as seed 002 did; ``longest``: to the longest of the batch), with the loss on the same tokens as shardtune
(the store's targets: responses for instruction data). Full-length synthetic sequences are the same
sequences shardtune trains. Attention is transformers' default, sdpa (eager where an architecture has no sdpa:
GPT-OSS); shardtune's own switches
(compile, liger-kernel, chunked loss, ...) do not apply here.

Each step is timed with the device synchronized at its end; ``OUT_DIR/steps.json`` gets the times, the
real (non-padding) and target tokens of each step on all ranks, peak memory and versions. MoE models get
the routers of ``model.init_routing`` (the same as the shardtune run's; their digest goes to steps.json)
and ``OUT_DIR/expert_usage.jsonl``, their routing counted per step as shardtune's training counts it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.metrics.expert_usage import USAGE_FILE, ExpertUsage
from shardtune.model.moe import RoutingRecorder, load_balancing_loss


def hf_labels(targets: np.ndarray) -> np.ndarray:
    """shardtune's targets (``targets[i]`` follows position i) as HF labels (models shift labels left)."""
    labels = np.full(len(targets), IGNORE_INDEX, dtype=np.int64)
    labels[1:] = targets[:-1]
    return labels


class RoutingStatistics:
    """The MoE routing of every training forward, counted as shardtune's runs count it (``RoutingRecorder``
    and ``ExpertUsage``, over the real tokens of each micro-batch), one ``expert_usage.jsonl`` record a step."""

    def __init__(self, model: torch.nn.Module, blocks: list, device: torch.device):
        self.recorder = RoutingRecorder(blocks)
        self.usage = ExpertUsage(blocks, device)
        self.rows: list[dict] = []
        self._recording = contextlib.ExitStack()
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        model.register_forward_hook(self._finish)

    def _start(self, module, args, kwargs) -> None:
        self._recording.enter_context(self.recorder.recording(kwargs.get("attention_mask")))

    @torch.no_grad()
    def _finish(self, module, args, output) -> None:
        self._recording.close()
        records = self.recorder.records
        if records:
            self.usage.add(records, load_balancing_loss(records))
        self.recorder.records = []

    def end_step(self, step: int) -> None:
        """Reduce the step's counts over the Trainer's ranks (every rank calls it) into one record."""
        self.rows.append(self.usage.reduce(_TrainerRanks(), step))


# transformers' MoE experts that fail under HF Trainer's bf16 autocast, by class name: DBRX's experts add each expert's
# rows, scaled by the routing weights, into a tensor of the hidden states' dtype with index_add_. Under CUDA autocast
# the router's softmax and p-norm run in fp32, so the scaled rows are fp32 and index_add_ refuses them ("self
# (BFloat16) and source (Float) must have the same scalar type"; transformers 5.17 and 5.24). Every other MoE of
# transformers casts its routing weights to the hidden states' dtype first; the baseline does that for these.
ROUTING_WEIGHTS_CAST = ("DbrxExperts",)


def cast_routing_weights(model: torch.nn.Module) -> list[str]:
    """Give every experts module of ``ROUTING_WEIGHTS_CAST`` in ``model`` its routing weights (its third argument) in
    the hidden states' dtype, so that the baseline trains under autocast; returns the classes it did this for."""

    def cast(module, args):
        hidden_states, top_k_index, top_k_weights = args
        return hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype)

    patched = set()
    for module in model.modules():
        if type(module).__name__ in ROUTING_WEIGHTS_CAST:
            module.register_forward_pre_hook(cast)
            patched.add(type(module).__name__)
    return sorted(patched)


class _TrainerRanks:
    """What ``ExpertUsage.reduce`` needs of a ``DistributedEnv``: a sum over the Trainer's ranks, if several."""

    @staticmethod
    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def main(argv: list[str]) -> int:
    import peft
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardtune.config import load_config
    from shardtune.data.prepare import prepare_dataset
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.metrics.flops import routed_expert_trainable
    from shardtune.metrics.memory import peak_memory_gib
    from shardtune.model.init_routing import router_weights_digest, set_init_routing
    from shardtune.model.load import load_model, load_tokenizer, resolve_dtype
    from shardtune.model.lora import apply_lora
    from shardtune.model.moe import find_moe_blocks

    config_path, out, padding = argv[0], Path(argv[1]), argv[2]
    # One example per sequence, as the seeds trained; transformers' default attention: sdpa, or eager where the
    # architecture has no sdpa (GPT-OSS); auto picks it for unpacked data.
    config = load_config(config_path, [*argv[3:], "data.packing=false", "model.attn_implementation=auto"])
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tokenizer = load_tokenizer(config.model)
    data = prepare_dataset(config, tokenizer, timeout_s=config.data.prepare_timeout_s)
    dtype = resolve_dtype(config.model.dtype, device)
    model = load_model(config.model, dtype, config.training.seed, random_init_device=device if cuda else None)
    moe_blocks = find_moe_blocks(model, decoder_layers(model))
    # The same routers as the shardtune run: model.init_routing's weights depend only on the seed.
    set_init_routing(model, moe_blocks, config.model.init_routing, config.training.seed)
    routers = router_weights_digest(moe_blocks) if moe_blocks else None  # as set up, before any training
    if workarounds := cast_routing_weights(model):
        print(f"baseline: routing weights cast to the hidden states' dtype in {', '.join(workarounds)}", flush=True)
    if config.lora.enabled:
        # The same PEFT adapters as the shardtune run (plain get_peft_model; the same target modules).
        model = apply_lora(model, config.lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    routed_trainable = routed_expert_trainable(moe_blocks, model)
    total = sum(p.numel() for p in model.parameters())

    class Examples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(data.train)

        def __getitem__(self, index: int) -> dict[str, np.ndarray]:
            ids, targets, _ = data.train.sequence(index)
            return {"input_ids": np.asarray(ids, dtype=np.int64), "labels": hf_labels(targets)}

    pending: list[tuple[int, int]] = []  # (real tokens, target tokens) of each collated micro-batch

    def pad(examples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        length = config.data.max_length if padding == "max_length" else max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            ids[row, :n] = torch.from_numpy(example["input_ids"])
            labels[row, :n] = torch.from_numpy(example["labels"])
            mask[row, :n] = 1
        pending.append((int(mask.sum()), int((labels != IGNORE_INDEX).sum())))
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    training = config.training
    arguments = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=training.per_device_train_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        max_steps=training.max_steps,
        learning_rate=training.learning_rate,
        bf16=dtype == torch.bfloat16,
        # HF checkpoints every layer or none: bench runs it without first and, out of memory, with (see
        # bench.command); shardtune's "auto" has no counterpart here.
        gradient_checkpointing=training.gradient_checkpointing is True,
        gradient_checkpointing_kwargs={"use_reentrant": False} if training.gradient_checkpointing is True else None,
        logging_steps=max(training.max_steps, 1),
        save_strategy="no",
        report_to=[],
        ddp_find_unused_parameters=False,
        dataloader_drop_last=True,
        seed=training.seed,
        use_cpu=not cuda,
    )

    steps: list[dict] = []
    routing = RoutingStatistics(model, moe_blocks, device) if moe_blocks else None

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.started
            # The step's micro-batches were collated before it began; later ones may be queued already.
            taken = pending[: args.gradient_accumulation_steps]
            del pending[: args.gradient_accumulation_steps]
            steps.append({"step": state.global_step, "seconds": seconds,
                          "tokens": sum(t for t, _ in taken), "target_tokens": sum(t for _, t in taken)})  # fmt: skip
            if routing is not None:
                routing.end_step(state.global_step)

    trainer = Trainer(model=model, args=arguments, train_dataset=Examples(), data_collator=pad, callbacks=[StepTimer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    peak = peak_memory_gib(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Each rank counted its own examples: a step's tokens are the sum over ranks.
        counts = torch.tensor([[s["tokens"], s["target_tokens"]] for s in steps], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        for step, (tokens, targets) in zip(steps, counts.tolist(), strict=True):
            step["tokens"], step["target_tokens"] = int(tokens), int(targets)
    if trainer.args.process_index == 0:
        record = {
            "steps": steps,
            "world_size": trainer.args.world_size,
            "padding": padding,
            "use_lora": config.lora.enabled,
            "trainable_params": trainable,
            "routed_expert_trainable_params": routed_trainable,
            "total_params": total,
            "peak_memory_gib": peak,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "peak_tflops": config.logging.peak_tflops,
            "router_weights_sha256": routers,
            "routing_weights_cast": workarounds,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
            },
        }
        (out / "steps.json").write_text(json.dumps(record, indent=2))
        if routing is not None:
            (out / USAGE_FILE).write_text("".join(json.dumps(row) + "\n" for row in routing.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

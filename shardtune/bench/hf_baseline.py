"""The comparison of ``shardtune bench --baseline hf``: HF Trainer + PEFT, as the seeds trained, on the
same model shape, random weights, LoRA settings and token sequences as the shardtune run.

    python -m shardtune.bench.hf_baseline CONFIG OUT_DIR [section.key=value ...]
    (under torchrun for several devices: Trainer runs DDP)

Each step is timed with the device synchronized at its end; ``OUT_DIR/steps.json`` gets the times, the
tokens per step on all ranks, peak memory and versions.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    import peft
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardtune.config import load_config
    from shardtune.data.prepare import prepare_dataset
    from shardtune.metrics.memory import peak_memory_gib
    from shardtune.model.load import load_model, load_tokenizer, resolve_dtype
    from shardtune.model.lora import apply_lora

    config_path, out = argv[0], Path(argv[1])
    config = load_config(config_path, argv[2:])
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tokenizer = load_tokenizer(config.model)
    data = prepare_dataset(config, tokenizer, timeout_s=config.data.prepare_timeout_s)
    dtype = resolve_dtype(config.model.dtype, device)
    model = load_model(config.model, dtype, config.training.seed, random_init_device=device if cuda else None)
    if config.lora.enabled:
        # The same PEFT adapters as the shardtune run (plain get_peft_model; the same target modules).
        model = apply_lora(model, config.lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(data.train)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids, _, _ = data.train.sequence(index)
            ids = torch.as_tensor(ids, dtype=torch.long)
            return {"input_ids": ids, "labels": ids.clone()}  # Trainer's models shift labels themselves

    training = config.training
    arguments = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=training.per_device_train_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        max_steps=training.max_steps,
        learning_rate=training.learning_rate,
        bf16=dtype == torch.bfloat16,
        gradient_checkpointing=training.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if training.gradient_checkpointing else None,
        logging_steps=max(training.max_steps, 1),
        save_strategy="no",
        report_to=[],
        ddp_find_unused_parameters=False,
        dataloader_drop_last=True,
        seed=training.seed,
        use_cpu=not cuda,
    )

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            tokens = arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps
            tokens *= config.data.max_length * arguments.world_size
            # Causal LM labels: every token but the first of a sequence is a target.
            targets = tokens - tokens // config.data.max_length
            steps.append({"step": state.global_step, "seconds": time.perf_counter() - self.started,
                          "tokens": tokens, "target_tokens": targets})  # fmt: skip

    trainer = Trainer(model=model, args=arguments, train_dataset=Sequences(), callbacks=[StepTimer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    peak = peak_memory_gib(device)
    if trainer.args.process_index == 0:
        record = {
            "steps": steps,
            "world_size": trainer.args.world_size,
            "use_lora": config.lora.enabled,
            "trainable_params": trainable,
            "total_params": total,
            "peak_memory_gib": peak,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "peak_tflops": config.logging.peak_tflops,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
            },
        }
        (out / "steps.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

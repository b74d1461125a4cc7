"""The training loop: token-weighted loss normalization, evaluation, and what a run leaves behind."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import peft
import pytest
import torch
from cli_runs import schema_checked_logs
from conftest import REPO, make_config
from transformers import AutoModelForCausalLM

from shardtune.config import TrainingConfig
from shardtune.data.collate import collate
from shardtune.data.prepare import prepare_dataset
from shardtune.metrics.schema import SCHEMA_VERSION
from shardtune.model.load import load_model, load_tokenizer
from shardtune.run_dir import prepare_output_dir, previous_run_problem
from shardtune.train.loop import accumulate_gradients, run_training


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_batch_of_four_equals_four_batches_of_one(tmp_path, alpaca_file, world):
    """Sum of token losses / step target tokens: the split into micro-batches must not matter."""
    config = make_config(tmp_path, alpaca_file)
    tokenizer = load_tokenizer(config.model)
    train = prepare_dataset(config, tokenizer).train
    examples = [train.sequence(i) for i in range(4)]
    lengths = {len(ids) for ids, _, _ in examples}
    assert len(lengths) > 1, "the check needs examples of different lengths"
    model = load_model(config.model, torch.float32, seed=0)

    def gradients(micro_batches):
        model.zero_grad(set_to_none=True)
        loss_sum, targets = accumulate_gradients(model, micro_batches, world, autocast=None)
        grads = [p.grad.clone() for p in model.parameters()]
        return (loss_sum / targets).item(), grads

    pad = tokenizer.pad_token_id
    loss_one, grads_one = gradients([collate(examples, pad, packed=False)])
    loss_four, grads_four = gradients([collate([example], pad, packed=False) for example in examples])
    assert loss_one == pytest.approx(loss_four, rel=1e-6, abs=1e-6)
    for a, b in zip(grads_one, grads_four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A mean of per-batch means would weigh short examples' tokens more: make sure that differs.
    means = []
    for example in examples:
        model.zero_grad(set_to_none=True)
        loss_sum, targets = accumulate_gradients(model, [collate([example], pad, packed=False)], world, autocast=None)
        means.append((loss_sum / targets).item())
    assert abs(sum(means) / 4 - loss_one) > 1e-4


def test_accumulation_split_gives_the_same_run(tmp_path, alpaca_file, world):
    """4 examples per micro-batch x 1 step of accumulation == 1 x 4, over a whole short run."""
    runs = {}
    for micro, accum in ((4, 1), (1, 4)):
        config = make_config(
            tmp_path / f"{micro}x{accum}",
            alpaca_file,
            training={"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, "max_steps": 3},
        )
        result = run_training(config, world, ["test"])
        runs[(micro, accum)] = (
            [row["loss"] for row in _lines(Path(config.training.output_dir) / "logs/train_log.jsonl")],
            {name: p.detach().clone() for name, p in result.model.named_parameters() if p.requires_grad},
        )
    (losses_a, params_a), (losses_b, params_b) = runs[(4, 1)], runs[(1, 4)]
    assert len(losses_a) == 3
    assert losses_a == pytest.approx(losses_b, rel=1e-6)
    # Adam turns float-rounding-sized gradient differences on near-zero gradients into ~1e-6 weight
    # differences; a wrongly normalized loss moves weights by the learning rate (1e-3).
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], rtol=1e-4, atol=1e-5)


PEAK_TFLOPS = 0.05


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A short LoRA run with evaluation, shared by the run-directory tests."""
    from conftest import TINY_DATA

    from shardtune.distributed.env import DistributedEnv

    tmp_path = tmp_path_factory.mktemp("lora")
    config = make_config(
        tmp_path,
        TINY_DATA,
        data={"eval_split_ratio": 0.1, "subset_size": 400},
        training={"max_steps": 6, "logging_steps": 2, "eval_steps": 2, "eval_subset_size": 16, "eval_on_start": True},
        # A peak for the CPU, so that MFU is a number that reaches every sink.
        logging={"tensorboard": True, "peak_tflops": PEAK_TFLOPS},
    )
    env = DistributedEnv.from_environment(timeout_s=60)
    try:
        result = run_training(config, env, ["shardtune", "train", "test.yaml"])
    finally:
        env.close()
    return config, result


def test_run_directory_layout(lora_run):
    config, result = lora_run
    out = Path(config.training.output_dir)
    assert (out / "config.yaml").is_file()
    run_args = json.loads((out / "run_args.json").read_text())
    assert run_args["world_size"] == 1 and len(run_args["hostnames"]) == 1 and run_args["devices"] == ["cpu"]
    assert {"torch", "transformers", "peft", "shardtune", "numpy", "cuda"} <= set(run_args["versions"])
    assert run_args["config_hash"] == hashlib.sha256((out / "config.yaml").read_bytes()).hexdigest()
    assert run_args["log_schema_version"] == SCHEMA_VERSION
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # the tests run from a checkout: the manifest names its commit
        assert run_args["git_commit"] == head.stdout.strip() and isinstance(run_args["git_dirty"], bool)
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "wall_time_s",
        "tokens",
        "tokens_per_rank",
        "tokens_per_s",
        "tokens_per_s_per_rank",
        "world_size",
        "gpu",
        "torch",
        "transformers",
        "model",
        "dataset",
        "use_lora",
        "bf16",
        "gradient_checkpointing",
        "strategy",
    ):
        assert key in metrics, key
    assert metrics["steps"] == 6 and metrics["use_lora"] is True and metrics["bf16"] is False
    # The default checkpointing (auto) checkpoints nothing on CPU: host memory is not what it runs out of.
    assert metrics["gradient_checkpointing"] == "auto" and metrics["checkpointed_layers"] == 0
    assert metrics["tokens"] == sum(metrics["tokens_per_rank"]) > 0
    assert metrics["tokens_per_s"] > 0 and metrics["gpu"] == "cpu"
    assert metrics == result.metrics

    logs = schema_checked_logs(out)
    train_log = logs["train"]
    assert [row["step"] for row in train_log] == [2, 4, 6]
    for row in train_log:
        assert row["loss"] > 0 and row["peak_memory_gib"] > 0 and row["interval_steps"] == 2
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] / PEAK_TFLOPS, rel=1e-9)
        assert row["target_tokens_per_s"] == pytest.approx(row["tokens_per_s"] * row["target_tokens"] / row["tokens"])
        assert row["step_time_s_min"] == row["step_time_s_median"] == row["step_time_s_max"] > 0
        assert row["slowest_rank"] == 0 and 0 < row["data_wait_s"] < row["step_time_s_max"]
        # throughput is over the interval's wall time up to the logging sync: at least its 2 steps' host time
        assert row["tokens"] / row["tokens_per_s"] >= 2 * row["step_time_s_max"]
    assert metrics["peak_tflops"] == PEAK_TFLOPS
    assert metrics["tokens"] == sum(row["tokens"] for row in train_log)

    eval_log = logs["eval"]
    assert [row["step"] for row in eval_log] == [0, 2, 4, 6]
    # The same deterministic eval subset at every evaluation: identical target-token counts.
    assert len({row["eval_tokens"] for row in eval_log}) == 1
    for row in eval_log:
        assert row["eval_perplexity"] == pytest.approx(torch.tensor(row["eval_loss"]).exp().item(), rel=1e-6)
    assert metrics["eval_loss"] == eval_log[-1]["eval_loss"]
    assert metrics["first_eval_loss"] == eval_log[0]["eval_loss"]

    final = out / "final"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert list(out.glob(".*tmp*")) == []


def test_tensorboard_receives_the_scalars(lora_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, _ = lora_run
    out = Path(config.training.output_dir)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [2, 4, 6]
    assert [event.step for event in events.Scalars("eval/eval_loss")] == [0, 2, 4, 6]
    # The same metrics as the JSONL rows: every number of a row, the host name excepted.
    logs = schema_checked_logs(out)
    for kind in ("train", "eval"):
        numeric = {name for name, value in logs[kind][-1].items() if name not in ("step", "schema_version")}
        tags = {tag.split("/", 1)[1] for tag in events.Tags()["scalars"] if tag.startswith(f"{kind}/")}
        assert tags == numeric - {"slowest_host"}
    mfu = [event.value for event in events.Scalars("train/mfu")]
    assert mfu == pytest.approx([row["mfu"] for row in logs["train"]], rel=1e-6)


def test_final_adapter_gives_the_trained_logits(lora_run, tiny_model_dir):
    config, result = lora_run
    trained = result.model.eval()
    reloaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), Path(config.training.output_dir) / "final"
    ).eval()
    input_ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=input_ids).logits
        got = reloaded(input_ids=input_ids).logits
    assert not torch.allclose(
        expected, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=input_ids).logits, atol=1e-4
    ), "training should have changed the model"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_full_finetuning_exports_a_loadable_model(tmp_path, alpaca_file, world, tiny_model_dir):
    config = make_config(tmp_path, alpaca_file, lora={"enabled": False}, training={"max_steps": 2})
    result = run_training(config, world, ["test"])
    assert result.metrics["use_lora"] is False
    assert result.metrics["trainable_params"] == result.metrics["total_params"]
    final = Path(config.training.output_dir) / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    assert json.loads((final / "config.json").read_text())["use_cache"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(final).eval()
    input_ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=input_ids).logits, result.model.eval()(input_ids=input_ids).logits, rtol=1e-5, atol=1e-5
        )


def test_eval_subset_is_seeded_and_fixed(tmp_path, alpaca_file, tokenizer):
    config = make_config(tmp_path, alpaca_file, data={"eval_split_ratio": 0.2}, training={"eval_subset_size": 10})
    first = prepare_dataset(config, tokenizer)
    assert len(first.eval) == 10 and len(first.train) == 160
    first_eval = [first.eval.sequence(i)[0].tolist() for i in range(10)]
    other = config.model_copy(update={"training": config.training.model_copy(update={"seed": 1})})
    other_eval = prepare_dataset(other, tokenizer).eval
    assert [other_eval.sequence(i)[0].tolist() for i in range(10)] != first_eval
    assert first.store != prepare_dataset(other, tokenizer).store


def test_existing_run_is_not_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.json").write_text("{}")
    (out / "run_args.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert previous_run_problem(TrainingConfig(output_dir=str(out))) == (
        f"training.output_dir: {out} already holds a run (metrics.json, run_args.json); choose another output_dir "
        "or set training.overwrite_output_dir=true"
    )
    prepare_output_dir(out, overwrite=False)
    assert (out / "metrics.json").exists()
    assert previous_run_problem(TrainingConfig(output_dir=str(out), overwrite_output_dir=True)) is None
    prepare_output_dir(out, overwrite=True)
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt"]


def test_full_model_is_exported_in_the_compute_dtype(tmp_path, tiny_model_dir, tokenizer):
    """fp32 master weights trained under bf16 autocast are saved as bf16, and say so."""
    from safetensors import safe_open

    from shardtune.checkpoint.export import save_final

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_final(model, tokenizer, tmp_path / "final", torch.bfloat16)
    assert json.loads((tmp_path / "final/config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "final/model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    assert model.dtype == torch.float32  # the trained model itself is untouched


def test_the_objects_of_the_first_step_are_frozen_until_the_run_ends(tmp_path, alpaca_file, world, monkeypatch):
    """After the first step (which compiles on GPUs) everything alive is out of the garbage collector's full
    collections; the run's end hands it back, so the model and graphs go with the run."""
    import gc

    from shardtune.train import loop

    frozen: list[bool] = []
    original = loop.accumulate_gradients

    def accumulate(*args, **kwargs):
        frozen.append(gc.get_freeze_count() > 0)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "accumulate_gradients", accumulate)
    config = make_config(tmp_path, alpaca_file)
    run_training(config, world, ["test"])
    assert frozen == [False, True, True, True]
    assert gc.get_freeze_count() == 0


def test_a_run_that_stops_on_an_error_gives_the_signals_back(tmp_path, alpaca_file, world, monkeypatch):
    """The step loop records SIGTERM, SIGUSR1 and SIGINT for a checkpoint-and-stop; once the run has stopped
    (here: out of memory in step 2) they act as before again, instead of being recorded for nobody."""
    import signal

    from shardtune.errors import OutOfMemory

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    monkeypatch.setenv("SHARDTUNE_FAULT", "forward_backward:oom:step=2")
    config = make_config(tmp_path, alpaca_file)
    with pytest.raises(OutOfMemory, match="rank 0: out of memory in step 2"):
        run_training(config, world, ["test"])
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers

"""MFU arithmetic against hand computations, and `shardtune bench` end to end on a CPU with the HF Trainer +
PEFT baseline beside it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.bench.report import format_report
from shardtune.bench.shapes import shape_config
from shardtune.cli import main
from shardtune.metrics.flops import active_matmul_params, peak_flops, token_flops


def test_dense_matmul_parameters_are_all_weights_but_embedding_and_norms():
    config = shape_config("mistral-7b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    embedding = model.get_input_embeddings().weight.numel()
    assert active_matmul_params(config) == total - embedding - norms == 7_110_393_856


def test_mfu_of_a_known_run_matches_a_hand_computation():
    # Mistral-7B, LoRA with 40M adapter parameters, seq 4096, 10,000 tokens/s on an H100 SXM.
    # Frozen weights: forward + input gradients (4); adapters: 6; attention scores in full.
    flops = token_flops(shape_config("mistral-7b"), 4096, adapter_params=40_000_000)
    assert flops.per_token == 4 * 7_110_393_856 + 6 * 40_000_000 + 12 * 32 * 4096 * 4096
    assert 10_000 * flops.per_token / peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(0.35515, abs=1e-5)
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("cpu") is None


def test_bench_runs_shardtune_and_the_hf_baseline(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--shape", "llama-tiny", "--seq", "64", "--batch", "2", "--steps", "3", "--warmup", "1"]
    # A peak for the CPU makes MFU a number; 0.002 TFLOP/s is the tiny model's scale.
    peak_tflops = 0.002
    overrides = ["training.seed=3", f"logging.peak_tflops={peak_tflops}"]
    assert main([*args, "--baseline", "hf", "--out", str(out), *overrides]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "bench.json").read_text())
    assert "shardtune / HF Trainer + PEFT (padding: max_length)" in printed and f"wrote {out / 'bench.json'}" in printed
    # By hand, llama-tiny (hidden 64, 2 layers, 4 heads x 16, 2 KV heads, MLP 128, vocabulary 8192, untied
    # head) at 64 tokens per sequence: 6 x matmul weights + 12 x layers x attention width x sequence.
    # LoRA: 4 FLOPs per frozen weight, 6 per adapter weight, attention scores in full.
    matmul_weights = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 8192 * 64
    lora_flops = 4 * matmul_weights + 6 * results["shardtune"]["trainable_params"] + 12 * 2 * 64 * 64
    for name in ("shardtune", "hf"):
        run = results[name]
        assert run["measured_steps"] == 3
        # every step trains 2 full sequences of 64 tokens, 63 of them targets
        assert run["tokens_per_s_per_device"] * run["step_time_s"] == pytest.approx(2 * 64)
        assert run["target_tokens_per_s_per_device"] * run["step_time_s"] == pytest.approx(2 * 63)
        assert run["flops_per_token"] == pytest.approx(lora_flops, rel=1e-12)
        assert run["tflops_per_device"] == pytest.approx(run["tokens_per_s_per_device"] * lora_flops / 1e12)
        assert run["mfu"] == pytest.approx(run["tflops_per_device"] / peak_tflops) and run["device"] == "cpu"
        assert run["peak_memory_gib_per_device"] > 0
    # Every step the training run logged has the same MFU, from the same formula.
    rows = [json.loads(line) for line in (out / "shardtune/logs/train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert results["shardtune"]["losses"] == [row["loss"] for row in rows]
    wait = results["shardtune"]["data_wait_s_per_step"]
    assert wait == pytest.approx(sum(row["data_wait_s"] for row in rows[1:]) / 3)
    assert 0 < wait < results["shardtune"]["step_time_s"] and "shardtune data wait: " in printed
    # A CPU run has no CUDA graphs. On a GPU, the step that captured them is named when it was measured.
    run = results["shardtune"]
    assert run["cuda_graph_layers"] == 0 and run["cuda_graphs_captured_in_step"] is None
    assert "CUDA graphs" not in printed
    results["shardtune"]["cuda_graphs_captured_in_step"] = 1
    assert "CUDA graphs" not in format_report(results)
    results["shardtune"]["cuda_graphs_captured_in_step"] = 3
    assert (
        "shardtune captured its layers' CUDA graphs in measured step 3, whose time counts the capture; --warmup 3 or "
        "more measures the replayed steps alone"
    ) in format_report(results).splitlines()
    for row in rows:
        assert row["tflops_per_device"] == pytest.approx(row["tokens_per_s_per_device"] * lora_flops / 1e12)
        assert row["mfu"] == pytest.approx(row["tokens_per_s_per_device"] * lora_flops / (peak_tflops * 1e12))
    # The same model and adapters on both sides.
    assert results["hf"]["trainable_params"] == results["shardtune"]["trainable_params"]
    assert results["hf"]["total_params"] == results["shardtune"]["total_params"]
    assert results["ratio"] == pytest.approx(
        results["shardtune"]["tokens_per_s_per_device"] / results["hf"]["tokens_per_s_per_device"]
    )
    config = (out / "config.yaml").read_text()
    assert "max_steps: 4" in config and "max_length: 64" in config


@pytest.mark.variants
def test_a_baseline_that_does_not_fit_leaves_shardtunes_run_without_a_ratio(tmp_path, capsys, monkeypatch):
    """HF + PEFT out of device memory without checkpointing and with it (Qwen3-30B-A3B with LoRA on the routed
    experts at batch 2 on an 80 GB GPU): bench keeps shardtune's measured run and says so, where it used to stop
    with the baseline's error. A CPU cannot run out of device memory, so the baseline's two runs end as they
    did on the GPU (its error in the log, a failed exit); shardtune's run is real."""
    from shardtune.bench import command

    real = command._run_logged
    baselines = []

    def run_logged(argv: list[str], log):
        if "shardtune.bench.hf_baseline" not in argv:
            return real(argv, log)
        baselines.append(argv)
        log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB.\n")
        return 1 if len(baselines) == 1 else -6  # the second one aborted on the way out, as on the H100

    monkeypatch.setattr(command, "_run_logged", run_logged)
    out = tmp_path / "bench"
    args = ["bench", "--shape", "llama-tiny", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert main([*args, "--baseline", "hf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "bench.json").read_text())
    assert [argv[-1] for argv in baselines] == ["max_length", "training.gradient_checkpointing=true"]
    assert results["shardtune"]["measured_steps"] == 2 and results["shardtune"]["tokens_per_s_per_device"] > 0
    assert results["hf"]["out_of_memory"] and results["hf"]["gradient_checkpointing"]
    assert "ratio" not in results and "tokens_per_s_per_device" not in results["hf"]
    assert "hf          out of memory (every layer checkpointed too)" in printed
    assert f"the HF baseline ran out of memory with every layer checkpointed too (see {out / 'hf.log'})" in printed


@pytest.mark.variants
def test_alpaca_like_bench_packs_for_shardtune_and_pads_for_the_baseline(tmp_path):
    """At the seed's setting the baseline trains one padded example per sequence; shardtune packs several."""
    out = tmp_path / "bench"
    args = ["bench", "--shape", "llama-tiny", "--seq", "256", "--batch", "2", "--steps", "3", "--warmup", "1"]
    assert main([*args, "--data", "alpaca-like", "--baseline", "hf", "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"instruction", "input", "output"} and len(rows) >= 4 * 2 * 3
    hf_steps = json.loads((out / "hf" / "steps.json").read_text())["steps"]
    shardtune_steps = [
        json.loads(line) for line in (out / "shardtune" / "logs" / "train_log.jsonl").read_text().splitlines()
    ]
    assert len(hf_steps) == len(shardtune_steps) == 4
    for hf, ours in zip(hf_steps, shardtune_steps, strict=True):
        assert 0 < hf["target_tokens"] < hf["tokens"] <= 2 * 256
        assert 2 * 256 * 0.75 < ours["tokens"] <= 2 * 256 and 0 < ours["target_tokens"] < ours["tokens"]
    # Two examples of about 200 tokens (some cut to 256) per step, against two sequences packed nearly full.
    assert sum(step["tokens"] for step in shardtune_steps) > 1.3 * sum(step["tokens"] for step in hf_steps)
    run, baseline = results["shardtune"], results["hf"]
    measured = hf_steps[1:]
    assert baseline["tokens_per_s_per_device"] * baseline["step_time_s"] == pytest.approx(
        sum(step["tokens"] for step in measured) / len(measured)
    )
    assert results["target_ratio"] == pytest.approx(
        run["target_tokens_per_s_per_device"] / baseline["target_tokens_per_s_per_device"]
    )
    assert baseline["padding"] == "max_length" and results["data"] == "alpaca-like"


@pytest.mark.variants
def test_bench_on_a_given_file_with_its_own_tokenizer(tmp_path, tiny_model_dir, alpaca_file):
    out = tmp_path / "bench"
    args = ["bench", "--shape", "llama-tiny", "--seq", "128", "--batch", "2", "--steps", "2", "--warmup", "1"]
    data = ["--data", str(alpaca_file), "--data-format", "alpaca", "--tokenizer", str(tiny_model_dir)]
    assert main([*args, *data, "--out", str(out)]) == 0
    config = (out / "config.yaml").read_text()
    assert f"dataset_path: {alpaca_file}" in config and "format: alpaca" in config
    # The given tokenizer, not the word-level one, tokenized the data.
    from transformers import AutoTokenizer

    given, written = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(out / "model")
    assert len(written) == len(given) and written.get_vocab() == given.get_vocab()
    results = json.loads((out / "bench.json").read_text())
    assert results["data"] == str(alpaca_file) and results["shardtune"]["measured_steps"] == 2


def test_bench_bad_input(tmp_path, capsys):
    assert main(["bench", "--shape", "gpt-17", "--out", str(tmp_path)]) == 2
    assert "--shape gpt-17: neither a named shape (llama3.2-1b, llama3-8b, mistral-7b" in capsys.readouterr().err
    assert main(["bench", "--shape", "llama-tiny", "--seq", "0", "--out", str(tmp_path)]) == 2
    assert "--seq: must be positive, got 0" in capsys.readouterr().err
    # 0 workers is no default: one line, and nothing written
    assert main(["bench", "--shape", "llama-tiny", "--nproc", "0", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["shardtune: error: --nproc: must be at least 1, got 0"]
    assert not (tmp_path / "none").exists()
    assert main(["bench", "--shape", "llama-tiny", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert (
        f"--data {tmp_path / 'none.jsonl'}: neither synthetic, alpaca-like nor an existing file"
        in capsys.readouterr().err
    )
    # --layers keeps the first N: more than the shape has is one line, nothing written
    assert main(["bench", "--shape", "llama-tiny", "--layers", "3", "--out", str(tmp_path / "more")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "shardtune: error: --layers 3: llama-tiny has 2 decoder layers; --layers keeps the first N of them"
    ]
    assert not (tmp_path / "more").exists()
    # A mistake in an override of the train command is its one line, before any run starts
    assert main(["bench", "--shape", "llama-tiny", "training.bogus=1", "--out", str(tmp_path / "bogus")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["shardtune: error: training.bogus: unknown key"]
    assert not (tmp_path / "bogus" / "shardtune.log").exists()


@pytest.mark.variants
def test_bench_times_one_epoch_of_a_given_number_of_examples(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--shape", "llama-tiny", "--seq", "128", "--batch", "2", "--warmup", "1", "--data", "alpaca-like"]
    assert main([*args, "--epoch-examples", "30", "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())
    assert len((out / "data.jsonl").read_text().splitlines()) == 30
    rows = [json.loads(line) for line in (out / "shardtune/logs/train_log.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "shardtune/metrics.json").read_text())
    # One epoch and no more: the last row ends it, and every step is in the log.
    assert rows[-1]["epoch"] == 1.0 and rows[-2]["epoch"] < 1.0
    assert results["epoch"] == {"examples": 30, "steps": len(rows), "train_time_s": metrics["train_time_s"],
                                "wall_time_s": metrics["wall_time_s"]}  # fmt: skip
    assert results["shardtune"]["measured_steps"] == len(rows) - 1
    assert f"one epoch of 30 examples: {len(rows)} steps in" in capsys.readouterr().out
    assert main([*args, "--epoch-examples", "30", "--baseline", "hf", "--out", str(tmp_path / "other")]) != 0
    assert "--epoch-examples: the HF baseline runs a fixed number of steps" in capsys.readouterr().err


def test_bench_of_an_architecture_without_sdpa_takes_what_it_runs(tmp_path, capsys):
    """GPT-OSS has no sdpa (its attention sinks): shardtune's run takes auto's choice and the baseline
    transformers' default for it, eager, on the fused block against transformers' experts."""
    from tiny_models import tiny_config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gpt_oss" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no GPT-OSS")
    config = tiny_config("gpt_oss")
    config.vocab_size = 8192  # bench's synthetic tokenizer
    model_dir = tmp_path / "gpt-oss"
    config.save_pretrained(model_dir)
    out = tmp_path / "bench"
    args = ["bench", "--shape", str(model_dir), "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    assert main([*args, "--baseline", "hf", "--out", str(out)]) == 0, capsys.readouterr().err[-3000:]
    results = json.loads((out / "bench.json").read_text())
    assert results["ratio"] > 0
    log = (out / "shardtune.log").read_text()
    assert "attention: eager" in log and "moe experts: fused" in log


def test_the_hf_baseline_casts_the_routing_weights_autocast_leaves_dbrx_in_fp32():
    """Under HF Trainer's bf16 autocast on a GPU, DBRX's router takes its softmax and p-norm in fp32, and
    transformers' DBRX experts then refuse to index_add_ the fp32-weighted rows into bf16 hidden states: the
    baseline's first DBRX run on an H200 stopped there. The baseline casts the weights to the hidden states' dtype,
    as every other transformers MoE does itself, and the experts' output is the one bf16 weights give."""
    from tiny_models import MORE_FUSED_MOE_ARCHITECTURES, tiny_config

    from shardtune.bench.hf_baseline import cast_routing_weights

    if "dbrx" not in MORE_FUSED_MOE_ARCHITECTURES:
        pytest.skip("this transformers has no DBRX")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("dbrx"), dtype=torch.bfloat16)
    experts = model.transformer.blocks[0].ffn.experts
    hidden = torch.randn(6, model.config.d_model, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(6)])
    weights = torch.rand(6, 2).softmax(-1)  # fp32, as autocast's softmax leaves them
    with pytest.raises(RuntimeError, match="must have the same scalar type"):
        experts(hidden, index, weights)
    expected = experts(hidden, index, weights.bfloat16())
    assert cast_routing_weights(model) == ["DbrxExperts"]
    torch.testing.assert_close(experts(hidden, index, weights), expected, rtol=0, atol=0)

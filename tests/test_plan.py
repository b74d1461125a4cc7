"""``shardtune plan`` as a user runs it: each recipe with its own cluster, the quickstart with its local data, a
run that does not fit and what it says to change, bad input; and the estimate against every measured peak
memory in benchmarks/RESULTS.md, recomputed from the bench.json files, so that table cannot go stale."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from shardtune.plan.memory import PARTS, Checkpointing, spread_layers
from shardtune.plan.run import GIB, GPU_MEMORY_GIB

RESULTS = REPO / "benchmarks" / "RESULTS.md"
BENCH_RESULTS = REPO / "benchmarks" / "results"
RECIPES = REPO / "examples" / "recipes"
QUICKSTART = REPO / "examples" / "quickstart.yaml"
TOLERANCE = 0.15
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


def recipe_plans() -> dict[str, list[str]]:
    """Each ``shardtune plan`` command in a recipe's header comment, by recipe and its options."""
    commands = {}
    for recipe in sorted(RECIPES.glob("*.yaml")):
        for line in recipe.read_text().splitlines():
            match = re.match(r"#\s+shardtune plan (\S+)(.*)$", line)
            if match:
                assert match.group(1) == f"examples/recipes/{recipe.name}", line
                commands[f"{recipe.stem}{match.group(2)}"] = ["plan", match.group(1), *shlex.split(match.group(2))]
    return commands


@pytest.fixture(scope="module")
def recipe_runs() -> dict[str, subprocess.CompletedProcess]:
    """Each recipe's plan commands through the command line, started at once (the machine's cores share them)."""
    started = {
        name: subprocess.Popen(
            [sys.executable, "-m", "shardtune", *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for name, args in recipe_plans().items()
    }  # fmt: skip
    done = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def plan_here(capsys, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """``shardtune plan ARGS`` in this process (as the command line runs it, without starting Python again)."""
    from shardtune.cli import main

    monkeypatch.chdir(REPO)
    status = main(["plan", *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["plan", *args], status, captured.out, captured.err)


def lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """The plan's lines by their first word (model, cluster, strategy, batch, memory, peak, host, data)."""
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in result.stdout.splitlines() if line[:1].isalpha()}


def gib(text: str) -> float:
    """The first ``~N GiB`` of a line, in GiB."""
    number, unit = re.search(r"~([\d.]+) (GiB|MiB)", text).groups()
    return float(number) / (1024 if unit == "MiB" else 1)


# Per recipe plan: strategy, cluster, peak per GPU (GiB) within a range derived from the sizes involved.
RECIPE_EXPECTATIONS = {
    # The bench runs at the seed's setting (Mistral-7B, 512-token micro-batches, LoRA r=16 without dropout)
    # measured 16.5-16.7 GiB a GPU; r=8 keeps less state, dropout 0.05 a mask per adapted input (~0.6 GiB).
    "mistral-7b-lora-alpaca --gpus-per-node 8": ("ddp (parallel.strategy)", "1 node x 8 GPUs", 15.5, 18.5),
    "mistral-7b-lora-alpaca --nodes 2 --gpus-per-node 8": ("ddp (parallel.strategy)", "2 nodes x 8 GPUs", 15.5, 18.5),
    # 106.9B bf16 weights / 16 = 12.4 GiB; the root unit and two gathered expert units (128 x 3 x 4096 x 1408,
    # 4.4 GB each) 10.6 GiB; 46 checkpointed layer inputs of 16,384 x 4096 in bf16 5.8 GiB; the loss in chunks
    # of 1,024 tokens (6 bytes x 1,024 x 151,552 = 0.9 GiB, where all logits at once were 27.7 GiB); the peak
    # is a layer's backward, one layer's activations recomputed (5.4 GiB): ~34 GiB, of 139.8.
    "glm-4.5-air-fsdp-16k --nodes 2 --gpus-per-node 8 --gpu-memory-gib 139.8": (
        "fsdp (parallel.strategy)", "2 nodes x 8 GPUs", 30, 40,
    ),
    # 352.9B bf16 weights / 32 = 20.5 GiB; the root and two gathered expert units (160 x 3 x 5120 x 1536) 17 GiB;
    # 92 layer inputs of 2,048 x 5120 1.8 GiB; the loss in chunks of 1,024 tokens 0.9 GiB: ~40 GiB, of 178.
    "glm-4.7-lora-messages --nodes 4 --gpus-per-node 8 --gpu-memory-gib 178": (
        "fsdp (parallel.strategy)", "4 nodes x 8 GPUs", 36, 46,
    ),
}  # fmt: skip


def test_every_recipe_has_a_plan_line():
    assert sorted(RECIPE_EXPECTATIONS) == sorted(recipe_plans())


@pytest.mark.parametrize("name", sorted(RECIPE_EXPECTATIONS))
def test_recipes_fit_their_clusters(recipe_runs, name):
    result = recipe_runs[name]
    assert result.returncode == 0, result.stdout + result.stderr
    strategy, cluster, low, high = RECIPE_EXPECTATIONS[name]
    plan = lines(result)
    assert plan["strategy"] == strategy
    assert plan["cluster"].startswith(cluster)
    assert low <= gib(plan["peak"]) <= high, plan["peak"]
    assert result.stdout.splitlines()[-1].startswith(f"fits: ~{plan['peak'].split()[0][1:]} GiB per GPU of the ")
    assert result.stderr == ""


def test_recipes_describe_their_models(recipe_runs):
    air = lines(recipe_runs["glm-4.5-air-fsdp-16k --nodes 2 --gpus-per-node 8 --gpu-memory-gib 139.8"])
    assert air["model"].startswith("zai-org/GLM-4.5-Air (bench's shape glm-4.5-air): 46 layers, 106.9B parameters")
    assert "128 routed experts in 45 layers, 8 a token" in air["model"]
    glm47 = lines(recipe_runs["glm-4.7-lora-messages --nodes 4 --gpus-per-node 8 --gpu-memory-gib 178"])
    # 352.9B as transformers builds GLM-4.7, plus LoRA r=128 on every linear layer (802.2M).
    assert "92 layers, 353.6B parameters" in glm47["model"] and "802.2M trainable (LoRA r=128)" in glm47["model"]
    assert "160 routed experts in 89 layers, 8 a token" in glm47["model"]
    assert glm47["batch"].startswith("micro-batch 1 x 2,048 = 2,048 tokens, 1 accumulation step: 32 sequences")
    mistral = lines(recipe_runs["mistral-7b-lora-alpaca --nodes 2 --gpus-per-node 8"])
    assert "16 sequences, 8,192 tokens a step" in mistral["batch"]
    assert (
        mistral["data"]
        == "steps per epoch unknown: yahma/alpaca-cleaned is a hub dataset (shardtune prepare counts it)"
    )


def test_quickstart_steps_per_epoch_from_its_local_data(capsys, monkeypatch):
    result = plan_here(capsys, monkeypatch, "examples/quickstart.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    plan = lines(result)
    assert plan["strategy"] == "single (one rank)"
    # 2,400 rows, 5% (120) held out for evaluation: 2,280 sequences unpacked; 16 a step, 5 epochs.
    assert plan["data"] == (
        "2,280 sequences (tokenized with examples/tiny-llama's tokenizer): 142 steps an epoch; 710 steps in 5 epochs"
    )
    packed = lines(
        plan_here(capsys, monkeypatch, "examples/quickstart.yaml", "--gpus-per-node", "2", "data.packing=true")
    )
    assert packed["strategy"] == "ddp (auto: replicated state is 0% of device memory)"
    # Packed into 128-token sequences, as `shardtune prepare` packs them; 32 sequences a step on 2 GPUs.
    sequences = int(re.match(r"([\d,]+) sequences", packed["data"]).group(1).replace(",", ""))
    assert 450 < sequences < 650  # 65,393 tokens in 128-token sequences, packed whole examples
    assert f"{sequences // 32} steps an epoch; {5 * (sequences // 32)} steps in 5 epochs" in packed["data"]


def test_auto_takes_ddp_for_an_adapter_wherever_a_ddp_step_fits(capsys, monkeypatch):
    """LoRA leaves the weights frozen: FSDP would gather them for every forward and backward, DDP reduces the
    adapter's gradients alone, so ``auto`` takes DDP wherever the estimate of a DDP step fits, past the 50% rule.
    Qwen3-30B-A3B with LoRA on attention and the routed experts on 2 GPUs of 80 GB: the replicated state is 84%
    of a GPU, and a step fits recomputing nearly every layer (measured on 2 H200s: DDP 12,531 tokens/s per GPU
    recomputing every layer, FSDP about 10,600 recomputing none)."""
    qwen = ["examples/quickstart.yaml", "--gpus-per-node", "2", "model.name_or_path=Qwen/Qwen3-30B-A3B",
            "data.max_length=4096", "training.per_device_train_batch_size=2", "lora.target_modules=null",
            "lora.moe_targets=[attention,routed_experts]"]  # fmt: skip
    adapter = lines(plan_here(capsys, monkeypatch, *qwen))
    assert re.fullmatch(
        r"ddp \(auto: replicated state is 84% of device memory, 98% of the weights frozen, and a DDP step's "
        r"estimated peak \((\d+\.\d) GiB\) fits the 71\.3 GiB a run may use\)",
        adapter["strategy"],
    )
    assert "gradient checkpointing on every layer (auto; 3 recompute their attention, 45 recompute" in adapter["batch"]
    # Nothing recomputed, a DDP step does not fit: FSDP, by the 50% rule.
    eager = lines(plan_here(capsys, monkeypatch, *qwen, "training.gradient_checkpointing=false"))
    assert re.fullmatch(
        r"fsdp \(auto: replicated state is 84% of device memory, and a DDP step's estimated peak \(\d+\.\d GiB\) is "
        r"over the 71\.3 GiB a run may use\)",
        eager["strategy"],
    )
    # The whole model trained, and a DDP step would fit (23.8 GiB of 27 with parallel.strategy=ddp): FSDP's
    # gathers move about what DDP's all-reduce would, and the 50% rule alone decides.
    full = lines(plan_here(capsys, monkeypatch, *qwen[:3], "--gpu-memory-gib", "30",
                           "model.name_or_path=meta-llama/Llama-3.2-1B", "lora.enabled=false", "data.max_length=2048",
                           "training.per_device_train_batch_size=1"))  # fmt: skip
    assert full["strategy"] == "fsdp (auto: replicated state is 61% of device memory)"


def test_a_run_that_does_not_fit_says_what_to_change(capsys, monkeypatch):
    result = plan_here(capsys, monkeypatch, "examples/recipes/mistral-7b-lora-alpaca.yaml", "lora.enabled=false")
    assert result.returncode == 1, result.stdout + result.stderr
    output = result.stdout.splitlines()
    end = output.index("any one of these fits:")
    # Mistral-7B fully fine-tuned on one GPU: fp32 weights, gradients and Adam state, 16 bytes x 7.24B = 108 GiB.
    assert output[end - 1].startswith("does not fit: ~") and 105 <= gib(output[end - 1]) <= 112
    assert output[end - 1].endswith(" GiB per GPU, more than the 71.27 GiB a run may use (90% of 79.19 GiB)")
    changes = {line.rsplit(": ~", 1)[0]: gib(line) for line in output[end + 1 :]}
    # FSDP halves the 108 GiB of state on 2 GPUs; LoRA is the seed's setting (16.5-16.7 GiB measured); offloaded
    # state leaves the activations and the gathered units.
    assert list(changes) == [
        "  needs ≥ 2 GPUs with FSDP: --gpus-per-node 2 parallel.strategy=fsdp",
        "  lora.enabled=true",
        "  parallel.strategy=fsdp parallel.cpu_offload=true (weights, gradients and Adam state in host memory)",
    ]
    low_high = [(50, 60), (15.5, 18.5), (2.5, 5)]
    assert all(low <= peak <= high for peak, (low, high) in zip(changes.values(), low_high, strict=True)), changes


def test_changes_that_fit_only_together_are_the_fewest():
    from shardtune.config import load_config
    from shardtune.plan.run import Cluster, changes_that_fit, plan_run
    from shardtune.plan.shape import planned_model_shape

    overrides = ["lora.enabled=false", "data.max_length=4096", "training.per_device_train_batch_size=4"]
    config = load_config(RECIPES / "mistral-7b-lora-alpaca.yaml", overrides, check_paths=False)
    shape, _ = planned_model_shape(config)
    run = plan_run(config, shape, Cluster(1, 1, int(GPU_MEMORY_GIB["H100 80GB"] * GIB)))
    # 108 GiB of state and 72 GiB of activations (16,384 tokens): no single change fits, FSDP over 2 GPUs
    # with 4,096-token micro-batches does; checkpointing and the chunked loss, tried first, are not needed.
    single, combined = changes_that_fit(run, lambda changed: planned_model_shape(changed)[0])
    assert single == []
    assert combined.what == (
        "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4 (the same global batch); "
        "needs ≥ 2 GPUs with FSDP: --gpus-per-node 2 parallel.strategy=fsdp"
    )
    assert combined.run.fits and combined.run.cluster.world_size == 2


def test_auto_checkpointing_takes_the_least_recomputation_that_fits():
    from dataclasses import replace

    from shardtune.bench.shapes import HUB_SHAPES
    from shardtune.config import load_config
    from shardtune.distributed.strategy import choose_parallelism
    from shardtune.errors import ConfigError
    from shardtune.plan.memory import (
        USABLE_SHARE,
        Checkpointing,
        _estimate,
        checkpoint_parts,
        choose_checkpointing,
        describe_checkpointing,
        spread_layers,
    )
    from shardtune.plan.shape import planned_model_shape

    def setup(*overrides: str, gpu_gib: float | None = None) -> tuple:
        config = load_config(QUICKSTART, [*hub_model, *overrides], check_paths=False)
        memory = int(gpu_gib * GIB) if gpu_gib else None
        return config, choose_parallelism(shape, config, 1, memory, True), memory

    def choice(gpu_gib: float | None, *overrides: str) -> Checkpointing:
        config, plan, memory = setup(*overrides, gpu_gib=gpu_gib)
        return choose_checkpointing(config, shape, plan, True, memory)

    def peak(checkpointing: Checkpointing, *overrides: str) -> float:
        config, plan, _ = setup(*overrides)
        return _estimate(config, shape, plan, True, checkpointing).peak

    mixtral = next(name for name, (label, _) in HUB_SHAPES.items() if label == "mixtral-8x7b")
    hub_model = [f"model.name_or_path={mixtral}", "data.max_length=4096", "training.per_device_train_batch_size=2"]
    shape, _ = planned_model_shape(load_config(QUICKSTART, hub_model, check_paths=False))
    assert len(shape.layers) == 32 and all(layer.sublayers for layer in shape.layers)
    budget = USABLE_SHARE * GPU_MEMORY_GIB["H200"] * GIB

    # Mixtral-8x7B LoRA at 8,192 tokens on one H200: 93 GB of weights leave room for 26 layers' activations
    # (bench_h200_auto2_mixtral.json: 6 of 32 checkpointed whole, 124.1 GiB at the peak). Whole layers only,
    # the fewest that fit, evenly spread:
    whole = choice(GPU_MEMORY_GIB["H200"], "training.gradient_checkpointing_granularity=layer")
    assert whole == Checkpointing.uniform(32, "layer", spread_layers(32, whole.count)) and 4 <= whole.count <= 10
    assert peak(whole) <= budget < peak(Checkpointing.uniform(32, "layer", spread_layers(32, whole.count - 1)))
    # By default the attention of more layers instead: the fewest that fit, more than whole layers.
    chosen = choice(GPU_MEMORY_GIB["H200"])
    assert chosen == Checkpointing.uniform(32, "attention", spread_layers(32, chosen.count))
    assert chosen.count > whole.count
    assert peak(chosen) <= budget < peak(Checkpointing.uniform(32, "attention", spread_layers(32, chosen.count - 1)))
    assert describe_checkpointing(setup()[0], chosen) == (
        f"gradient checkpointing on {chosen.count} of 32 layers (auto; {chosen.count} recompute their attention)"
    )
    mixed = Checkpointing(("mlp", "sublayers", "layer", None, "attention"))
    assert describe_checkpointing(setup("training.gradient_checkpointing=true")[0], mixed) == (
        "gradient checkpointing on 4 of 5 layers (1 recompute their attention, 1 recompute their MLP, "
        "1 recompute their attention and MLP, 1 recompute all of it)"
    )
    # Less memory: the attention of every layer, then the MoE blocks of more and more layers too, then whole
    # layers; each the first step of that order that fits.
    order = [Checkpointing.uniform(32, None)]
    for below, part in ((None, "attention"), ("attention", "sublayers"), ("sublayers", "layer")):
        order += [
            Checkpointing(tuple(part if index in spread_layers(32, n) else below for index in range(32)))
            for n in range(1, 33)
        ]
    for budget_gib in (110.0, 100.0, 96.0):
        held = choice(GPU_MEMORY_GIB["H200"], f"training.memory_budget_gib={budget_gib}")
        step = order.index(held)
        overrides = f"training.memory_budget_gib={budget_gib}"
        assert peak(held, overrides) <= budget_gib * GIB < peak(order[step - 1], overrides), budget_gib
    # (at 100 GiB: the attention of every layer, and the MoE blocks of most layers too)
    assert choice(GPU_MEMORY_GIB["H200"], "training.memory_budget_gib=100").counts() == {
        "attention": 6,
        "mlp": 0,
        "sublayers": 26,
        "layer": 0,
    }
    # Room for everything: nothing; room for nothing: whole layers everywhere (the plan then says it does
    # not fit); CPU: nothing.
    assert choice(1000.0) == Checkpointing.uniform(32, None)
    assert choice(GPU_MEMORY_GIB["H100 80GB"]) == Checkpointing.uniform(32, "layer")
    assert choice(None) == Checkpointing.uniform(32, None)
    # Set by hand, auto decides nothing: whole layers, or the part the granularity names.
    every_other = choice(1000.0, "training.gradient_checkpointing=true", "training.gradient_checkpointing_every=2")
    assert every_other == Checkpointing.uniform(32, "layer", frozenset(range(0, 32, 2)))
    mlps = choice(1000.0, "training.gradient_checkpointing=true", "training.gradient_checkpointing_granularity=mlp")
    assert mlps == Checkpointing.uniform(32, "mlp")
    assert choice(GPU_MEMORY_GIB["H200"], "training.gradient_checkpointing=false") == Checkpointing.uniform(32, None)
    assert spread_layers(32, 3) == {0, 10, 21} and spread_layers(5, 0) == frozenset()
    # A model whose layers have no MLP module of their own (OPT's): auto takes whole layers, and asking for
    # less is one line saying what to set.
    flat = replace(shape, layers=tuple(replace(layer, sublayers=False) for layer in shape.layers))
    assert checkpoint_parts(setup()[0], flat) == ("layer",)
    with pytest.raises(ConfigError) as raised:
        checkpoint_parts(setup("training.gradient_checkpointing_granularity=sublayers")[0], flat)
    assert str(raised.value) == (
        "training.gradient_checkpointing_granularity: sublayers needs each decoder layer's attention and MLP as "
        "modules of their own, which 32 of this model's 32 layers do not have; set it to layer (or auto)"
    )


def test_a_memory_budget_is_what_the_plan_checks_against(capsys, monkeypatch):
    recipe = ["examples/recipes/mistral-7b-lora-alpaca.yaml", "--gpu-memory-gib", "79.19"]
    assert lines(plan_here(capsys, monkeypatch, *recipe))["fits:"].endswith(
        " GiB per GPU of the 71.27 GiB a run may use (90% of 79.19 GiB)"
    )
    held = plan_here(capsys, monkeypatch, *recipe, "training.memory_budget_gib=8")
    assert held.returncode == 1
    assert "GiB per GPU, more than the 8.00 GiB a run may use (training.memory_budget_gib of 79.19 GiB)" in held.stdout


def test_the_loss_term_follows_the_loss_a_run_computes():
    """Qwen3-30B-A3B's head (151,936 x 2048) at 8,192 tokens: all logits at 12 bytes each; under auto, one
    chunk of 1,024 tokens (10 bytes a logit with the softmax eager, 2 compiled) and the head input's bf16
    gradient, plus the head's fp32 weight gradient when it trains."""
    from shardtune.bench.shapes import HUB_SHAPES
    from shardtune.config import load_config
    from shardtune.plan.memory import loss_bytes
    from shardtune.plan.shape import planned_model_shape

    qwen3 = next(name for name, (label, _) in HUB_SHAPES.items() if label == "qwen3-30b-a3b")
    common = [f"model.name_or_path={qwen3}", "data.max_length=4096", "training.per_device_train_batch_size=2"]

    def loss(*overrides: str, compiled: bool = False) -> int:
        config = load_config(QUICKSTART, [*common, *overrides], check_paths=False)
        return loss_bytes(config, planned_model_shape(config)[0], 8192, compiled)

    vocab, hidden, chunk = 151_936, 2048, 1024
    assert loss("training.loss_chunk_tokens=0") == 12 * 8192 * vocab
    assert loss("training.loss_chunk_tokens=0", compiled=True) == 12 * 8192 * vocab
    assert loss() == 10 * chunk * vocab + 8192 * hidden * 2
    assert loss(compiled=True) == 2 * chunk * vocab + 8192 * hidden * 2
    assert loss("lora.enabled=false") == 10 * chunk * vocab + 8192 * hidden * 2 + vocab * hidden * 4
    assert loss("training.loss_chunk_tokens=512") == 10 * 512 * vocab + 8192 * hidden * 2


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["examples/recipes/no-such-recipe.yaml"], "config file not found: examples/recipes/no-such-recipe.yaml"),
        (
            ["examples/quickstart.yaml", "training.learning_rat=1e-4"],
            "training.learning_rat: unknown key (did you mean 'training.learning_rate'?)",
        ),
        (["examples/quickstart.yaml", "--gpus-per-node", "0"], "--gpus-per-node: must be positive, got 0"),
        (["examples/quickstart.yaml", "--gpu-memory-gib", "nan"], "--gpu-memory-gib: must be a finite number, got nan"),
        (["examples/quickstart.yaml", "--gpu-memory-gib", "inf"], "--gpu-memory-gib: must be a finite number, got inf"),
        (
            ["examples/quickstart.yaml", "model.name_or_path=./no-such-model"],
            "model.name_or_path: directory not found: ./no-such-model",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, monkeypatch, args, error):
    result = plan_here(capsys, monkeypatch, *args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"shardtune: error: {error}\n")


def test_a_hub_model_plan_does_not_know_is_one_line(capsys, monkeypatch):
    result = plan_here(capsys, monkeypatch, "examples/quickstart.yaml", "model.name_or_path=acme/unheard-of-7b")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "shardtune: error: model.name_or_path: acme/unheard-of-7b: no config.json on this machine and no shape of it"
    )
    assert line.endswith("point model.name_or_path at a directory holding the model's config.json")


# -- the estimate against measured peaks (benchmarks/RESULTS.md, "Planner against measured peak memory") ----
# Arguments a row may add to restore a default of the run's time, and options removed since.
RESTORED_DEFAULTS = {
    "parallel.compile=false", "model.attn_implementation=sdpa", "training.loss_chunk_tokens=0",
    "model.attn_implementation=eager",  # GPT-OSS's padded rows on a GPU took eager attention before FlexAttention
}  # fmt: skip
REMOVED_OPTIONS = ("parallel.compile_mode=",)
# How far a row's estimate may drift from the one recomputed before the row is stale. The estimate reads the
# parameters' dtypes off transformers' model, which moves between its releases: transformers 5.24 keeps
# GLM-4.5's routers in fp32, 9 MiB more on a 10-layer GLM-4.5-Air than 5.23 (0.02%).
ESTIMATE_DRIFT = 0.005
# Runs measured before the estimate's latest calibration (the compiled softmax of the chunked loss, the
# qk-norm term): their bench.json has no "loss". ``gradient_checkpointing: auto`` chose what they recompute
# from an earlier estimate, so they are compared at what they recomputed, with the chunked loss's softmax as
# it then was (eager in every run, and holding two chunks' logits at once: 12 bytes a logit, measured).
# Runs since are also checked to recompute what the estimate chooses.
EARLIER_CHUNK_LOGIT_BYTES = 12
# Runs with LoRA on the routed experts whose ``gradient_checkpointing: auto`` chose what to recompute from the estimate
# before it counted the experts' LoRA factors (``LayerActivations.factors``, 1.2 GiB on Qwen3-30B-A3B): the estimate
# now recomputes a few layers' MoE blocks more, so they are compared at what they recomputed.
EARLIER_FACTORS_CHOICE = frozenset(
    f"bench_{name}.json"
    for name in (
        "h100_ab_after-qwen3-experts", "h200_loss_qwen3-experts-budget79", "h200_loss_qwen3-experts-budget795",
        "h200_loss_qwen3-experts-budget795-repeat", "h200_silu_qwen3-experts-budget795",
        "h200_gathered-qwen3-experts-budget795", "h200_float8-experts-only_qwen3-experts", "h200_float8_qwen3-experts",
        "h200_cuda-graphs_qwen3-experts", "h200_recheck_qwen3-experts",
    )
)  # fmt: skip
# Runs whose ``auto`` chose from the estimate before it counted what frozen parts keep (a frozen MoE block keeps no
# normalized input, a frozen MLP no product) and the routing's per-token tensors (Qwen3-30B-A3B and Mixtral-8x7B with
# LoRA on attention): the estimate now chooses another recomputation for them, so they are compared at what they
# recomputed.
EARLIER_FROZEN_CHOICE = frozenset(
    f"bench_{name}.json"
    for name in (
        "h100_ab_after-qwen3-attn", "h200_gathered-mixtral", "h100_cuda-graphs_qwen3-attn", "h200_cuda-graphs_mixtral",
        "h200_recheck_mixtral", "h200_gemm-share_mixtral-bf16", "h200_gemm-share_mixtral-float8",
    )
)  # fmt: skip


def ran_checkpointing(run: dict, layers: int) -> Checkpointing:
    """What a measured run recomputed, laid out as ``choose_checkpointing`` lays out those counts: the higher
    part on evenly spread layers, the lower one (or nothing) on the rest."""
    counts = run.get("checkpointed_parts") or {"layer": run["checkpointed_layers"]}
    present = [part for part in PARTS if counts.get(part)]
    if not present:
        return Checkpointing.uniform(layers, None)
    top, below = present[-1], (present[0] if len(present) == 2 else None)
    chosen = spread_layers(layers, counts[top])
    return Checkpointing(tuple(top if index in chosen else below for index in range(layers)))


@dataclass(frozen=True)
class MeasuredRow:
    line: str
    file: str
    arguments: str


def measured_rows() -> list[MeasuredRow]:
    text = RESULTS.read_text().split("## Planner against measured peak memory", 1)[1]
    rows = []
    for line in text.splitlines():
        match = re.match(r"\| `(bench_[^`]+\.json)` \| `([^`]+)` \|", line)
        if match:
            rows.append(MeasuredRow(line, *match.groups()))
    return rows


def test_every_measured_run_has_a_row():
    assert sorted(row.file for row in measured_rows()) == sorted(
        path.name for path in BENCH_RESULTS.glob("bench_*.json")
    )


def test_estimates_of_measured_peaks_are_within_15_percent(tmp_path, monkeypatch):
    from shardtune.bench.command import bench_config, write_model_dir
    from shardtune.bench.shapes import shape_config
    from shardtune.cli import build_parser
    from shardtune.config import load_config
    from shardtune.distributed.strategy import choose_parallelism
    from shardtune.plan import memory
    from shardtune.plan.memory import _estimate, estimate_memory
    from shardtune.plan.shape import planned_model_shape

    model_dirs: dict[tuple, Path] = {}
    shapes: dict[str, object] = {}
    stale = []
    for row in measured_rows():
        bench = json.loads((BENCH_RESULTS / row.file).read_text())
        run = bench["shardtune"]
        args, extra = build_parser().parse_known_args(["bench", *shlex.split(row.arguments)])
        overrides = [*args.overrides, *extra]
        # The row's arguments are the run's: its recorded settings and its train command's overrides.
        recorded = (bench["shape"], bench["seq"], bench["batch_per_device"], bench["nproc"])
        assert recorded == (args.shape, args.seq, args.batch, args.nproc or 1), row.file
        assert bench.get("data") in (None, args.data), row.file  # the first runs had synthetic data only
        ran = [
            item for item in run["command"].split(" --nproc ")[1].split()[1:] if not item.startswith(REMOVED_OPTIONS)
        ]
        assert [item for item in overrides if item not in RESTORED_DEFAULTS or item in ran] == ran, row.file
        if "checkpointed_layers" not in run and not args.gradient_checkpointing:
            overrides.append("training.gradient_checkpointing=false")  # the default before auto
        if "checkpointed_parts" not in run:
            overrides.append("training.gradient_checkpointing_granularity=layer")  # the only one before

        # The config bench trains on, from bench's own parser and config (its model directory written once).
        key = (args.shape, args.layers)
        if key not in model_dirs:
            model_dirs[key] = write_model_dir(tmp_path / f"model-{len(model_dirs)}", shape_config(*key))
        model_config = shape_config(*key)
        tree = bench_config(args, tmp_path, model_dirs[key], tmp_path / "data.jsonl", "text", model_config)
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
        config = load_config(tmp_path / "config.yaml", overrides, check_paths=False)
        # The shape depends on the attention training takes, which packing decides (GPT-OSS: flex or eager)
        built = json.dumps(
            [config.model.model_dump(), config.lora.model_dump(), config.data.max_length, config.data.packing]
        )
        if built not in shapes:
            shapes[built] = planned_model_shape(config)[0]
        shape = shapes[built]
        assert (shape.trainable, shape.total) == (run["trainable_params"], run["total_params"]), row.file
        assert bench.get("layers") in (None, len(shape.layers)), row.file

        gpu = "H100 80GB" if "H100" in run["device"] else "H200"
        gpu_memory = int(GPU_MEMORY_GIB[gpu] * GIB)
        compiled = config.parallel.compiles_on("cuda")
        plan = choose_parallelism(shape, config, bench["nproc"], gpu_memory, compiled)
        assert plan.strategy == run["strategy"], row.file
        with monkeypatch.context() as patch:
            if "loss" not in run:  # measured before the latest calibration
                patch.setattr(memory, "CHUNK_LOGIT_BYTES", EARLIER_CHUNK_LOGIT_BYTES)
                patch.setattr(memory, "COMPILED_CHUNK_LOGIT_BYTES", EARLIER_CHUNK_LOGIT_BYTES)
                if "checkpointed_layers" in run:  # auto, or every layer: not what the config alone decides
                    estimated = _estimate(config, shape, plan, compiled, ran_checkpointing(run, len(shape.layers)))
                else:
                    estimated = estimate_memory(config, shape, plan, compiled, gpu_memory)
            else:
                estimated = estimate_memory(config, shape, plan, compiled, gpu_memory)
                # The run checkpointed what the estimate chose (auto: from the same estimate, on the GPU).
                if row.file in EARLIER_FACTORS_CHOICE | EARLIER_FROZEN_CHOICE:  # chosen from an earlier estimate
                    assert estimated.checkpointed.counts() != run["checkpointed_parts"], row.file
                    estimated = _estimate(config, shape, plan, compiled, ran_checkpointing(run, len(shape.layers)))
                else:
                    assert estimated.checkpointed.counts() == run["checkpointed_parts"], row.file
        estimate = estimated.peak / GIB
        measured = run["peak_memory_gib_per_device"]
        error = estimate / measured - 1
        assert abs(error) <= TOLERANCE, f"{row.file}: measured {measured:.2f} GiB, estimated {estimate:.2f}"
        measured_cells = f"| `{row.file}` | `{row.arguments}` | {bench['nproc']}×{gpu.split()[0]} | {measured:.2f} |"
        expected = f"{measured_cells} {estimate:.2f} | {100 * error:+.1f}% |"
        recorded = float(row.line.split("|")[5])
        drifted = not row.line.startswith(measured_cells) or abs(recorded / estimate - 1) > ESTIMATE_DRIFT
        if row.line != expected and drifted:
            stale.append(expected)
    assert not stale, "RESULTS.md rows that no longer hold; as recomputed:\n" + "\n".join(stale)


def test_expert_parallelism_gathers_only_a_ranks_experts(capsys, monkeypatch):
    # GLM-4.5-Air on 2 x 8 GPUs: FSDP alone gathers a whole MoE layer's experts (128 of them) to run it; EP 8
    # keeps 16 on each GPU and gathers those, so FSDP's gathered term and the peak fall by the difference.
    air = ["examples/recipes/glm-4.5-air-fsdp-16k.yaml", "--nodes", "2", "--gpus-per-node", "8",
           "--gpu-memory-gib", "139.8"]  # fmt: skip
    fsdp = lines(plan_here(capsys, monkeypatch, *air))
    ep = lines(plan_here(capsys, monkeypatch, *air, "parallel.expert_parallel_size=8"))
    assert ep["strategy"] == "fsdp (parallel.expert_parallel_size)"

    def term(memory: str, name: str) -> float:
        number, unit = re.search(rf"{name} ([\d.]+) (GiB|MiB)", memory).groups()
        return float(number) / (1024 if unit == "MiB" else 1)

    # Stored state is 1/16 of every weight either way; only what a layer gathers to run differs.
    for name in ("weights", "gradients", "optimizer", "activations"):
        assert term(ep["memory"], name) == term(fsdp["memory"], name)
    gathered_fsdp, gathered_ep = term(fsdp["memory"], "FSDP gathered"), term(ep["memory"], "FSDP gathered")
    # Two units in flight (one running, the next prefetched): a layer's experts, 128/8 of them with EP 8.
    experts_unit = (gathered_fsdp - gathered_ep) / 2 / (1 - 1 / 8)
    assert experts_unit == pytest.approx(4.4 / 1.0737, rel=0.02)  # about 4.4 GB (4.1 GiB) a layer in bf16
    assert gib(ep["peak"]) == pytest.approx(gib(fsdp["peak"]) - (gathered_fsdp - gathered_ep), abs=0.02)


@pytest.mark.parametrize(
    ("size", "error"),
    [
        (3, "parallel.expert_parallel_size: 3 does not divide the world size 16"),
        (32, "parallel.expert_parallel_size: 32 does not divide the world size 16"),
    ],
)
def test_expert_parallel_sizes_that_do_not_fit_the_cluster_are_one_line(capsys, monkeypatch, size, error):
    result = plan_here(capsys, monkeypatch, "examples/recipes/glm-4.5-air-fsdp-16k.yaml", "--nodes", "2",
                       "--gpus-per-node", "8", f"parallel.expert_parallel_size={size}")  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"shardtune: error: {error}")


@pytest.mark.parametrize(
    ("arch", "gated"),
    [("qwen3_moe", True), ("llama4_text", True), ("gpt_oss", True), ("nemotron_h", False), ("jetmoe", True)],
    ids=["silu", "transposed_silu", "clamped_glu", "relu2", "expert_pair"],
)
def test_routed_rows_and_expert_adapters_are_read_from_each_expert_layout(tmp_path, arch, gated):
    # What a routed row keeps for backward is its first projection's output: [gate | up] for gated experts, up alone
    # for ungated ones (Nemotron-H's up_proj, which LoRA on the routed experts adapts in place of gate_up_proj).
    import torch
    from tiny_models import write_tiny_model

    from shardtune.config import load_config
    from shardtune.plan.shape import model_shape_on

    directory = write_tiny_model(tmp_path / arch, arch)
    overrides = [f"model.name_or_path={directory}", "lora.r=8", "lora.target_modules=null", "lora.lora_dropout=0",
                 "lora.moe_targets=[attention,routed_experts]"]  # fmt: skip
    config = load_config(QUICKSTART, overrides, check_paths=False)
    shape = model_shape_on(config, torch.device("cpu"))
    model_config = json.loads((directory / "config.json").read_text())
    width = model_config.get("moe_intermediate_size") or model_config["intermediate_size"]  # Llama 4's, GPT-OSS's
    moe_layers = shape.moe_layers
    assert moe_layers and all(layer.expert_row_width == (2 if gated else 1) * width for layer in moe_layers)
    assert all(layer.expert_adapter_rank == 8 for layer in moe_layers)


def tiny_shape(tmp_path, arch: str, *overrides: str, **model_config):
    """The planned shape of a tiny ``arch`` (``model_config`` changed in its config.json), bf16 as on a GPU."""
    from tiny_models import COMMON, FUSED_MOE_ARCHITECTURES, write_tiny_model
    from transformers import AutoConfig

    from shardtune.config import load_config
    from shardtune.plan.shape import planned_model_shape

    directory = write_tiny_model(tmp_path / arch, arch)
    AutoConfig.for_model(arch, **{**COMMON, **FUSED_MOE_ARCHITECTURES[arch], **model_config}).save_pretrained(directory)
    config = load_config(QUICKSTART, [f"model.name_or_path={directory}", "lora.r=8", "lora.target_modules=null",
                                      "lora.lora_dropout=0", *overrides], check_paths=False)  # fmt: skip
    return config, planned_model_shape(config)[0]


def saved_bytes(forward, skipped: set[int], counts=lambda tensor: True) -> int:
    """The bytes of the distinct storages autograd saves for backward in ``forward()`` (run, then backward through its
    output's sum), but those in ``skipped`` (parameters, inputs made elsewhere) and those ``counts`` leaves out."""
    import torch

    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped and counts(tensor):
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        output = forward()
    (output[0] if isinstance(output, tuple) else output).float().sum().backward()
    return sum(kept.values())


def tiny_lora_model(directory, attention: str, rank: int):
    """The tiny model of ``directory`` in bf16 for training with ``attention``, LoRA of rank ``rank`` on attention, its
    MoE blocks fused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.model.fused_moe import use_fused_experts
    from shardtune.model.lora import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(directory), attn_implementation=attention, experts_implementation="eager"
    )
    model = apply_lora(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0, target_modules=None))
    use_fused_experts(model, decoder_layers(model), "fused")
    return model.to(torch.bfloat16).train()


def kept_by_each_layer(model, tokens: int, rank: int, compiled: bool) -> list[int]:
    """What autograd saves per decoder layer of ``model`` (bf16, LoRA of rank ``rank``) in one forward of ``tokens``
    tokens, each layer compiled as training compiles it (``LayerCompiler``) or not, called as the model's forward
    calls it (its position embeddings and mask), the bytes of the tensors a planner term counts: not LoRA's A products
    (r a token for each adapted projection, bf16 of last dimension r), the norms' fp32 statistics (one a row: last
    dimension 1), sdpa's fp32 log-sum-exp (one a head: last dimension the tokens), nor what a layer keeps once whatever
    its tokens (no dimension a multiple of them: the compiler's concatenation of q/k/v's A weights, the router's fp32
    weight, the experts' offsets). ``rank`` must differ from the number of experts (the router's logits are counted)."""
    import torch

    from shardtune.distributed.compile import LayerCompiler
    from shardtune.distributed.parallelize import decoder_layers

    layers = decoder_layers(model)
    calls = {}

    def capture(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        calls[layers.index(layer)] = (args, kwargs)

    handles = [layer.register_forward_pre_hook(capture, with_kwargs=True) for layer in layers]
    with torch.no_grad():
        model(input_ids=torch.randint(3, 1000, (1, tokens)), use_cache=False)
    for handle in handles:
        handle.remove()

    def per_token(tensor: torch.Tensor) -> bool:
        if not any(size % tokens == 0 for size in tensor.shape):
            return False
        lora_a = tensor.dtype == torch.bfloat16 and tensor.shape[-1] == rank
        scores = tuple(tensor.shape[-2:]) == (tokens, tokens)  # eager attention's, also in fp32
        statistics = tensor.dtype == torch.float32 and tensor.shape[-1] in (1, tokens) and not scores
        return not lora_a and not statistics

    skipped = {tensor.untyped_storage().data_ptr() for tensor in (*model.parameters(), *model.buffers())}
    kept = []
    for index, layer in enumerate(layers):
        args, kwargs = calls[index]
        x = args[0].detach().clone().requires_grad_(True)
        arguments = {
            tensor.untyped_storage().data_ptr()
            for value in (*args[1:], *kwargs.values())
            for tensor in (value if isinstance(value, tuple) else (value,))
            if isinstance(tensor, torch.Tensor)
        }
        run = torch.compile(layer, backend=LayerCompiler()) if compiled else layer
        forward = functools.partial(run, x, *args[1:], **kwargs)
        kept.append(saved_bytes(forward, skipped | arguments, per_token))
    return kept


def test_capped_logits_keep_tanhs_output(tmp_path):
    # Gemma 4 caps its logits (cap * tanh(logits / cap)) after the LM head; under the standard loss tanh keeps its
    # output for backward, one logits tensor in the compute dtype more than an uncapped head: what a tiny Gemma 4 in
    # bf16 saves of the vocabulary's width, with and without the cap, and what the planner counts. The chunked loss
    # caps each chunk itself and keeps nothing more.
    from dataclasses import replace

    import torch

    from shardtune.plan.memory import SOFTCAP_LOGIT_BYTES, loss_bytes

    tokens, vocab = 128, 1024
    config, shape = tiny_shape(tmp_path, "gemma4_text", "training.loss_chunk_tokens=0", final_logit_softcapping=30.0)
    assert shape.softcapped_logits and SOFTCAP_LOGIT_BYTES == 2

    def logits_kept(cap: float | None) -> int:
        model = tiny_lora_model(tmp_path / "gemma4_text", "sdpa", 4)
        model.config.get_text_config().final_logit_softcapping = cap
        ids = torch.randint(3, vocab, (1, tokens))
        return saved_bytes(lambda: model(input_ids=ids).logits, set(), lambda tensor: tensor.shape[-1:] == (vocab,))

    assert logits_kept(30.0) - logits_kept(None) == SOFTCAP_LOGIT_BYTES * tokens * vocab
    uncapped = replace(shape, softcapped_logits=False)
    standard = loss_bytes(config, shape, tokens, compiled=True) - loss_bytes(config, uncapped, tokens, compiled=True)
    assert standard == SOFTCAP_LOGIT_BYTES * tokens * vocab
    chunked, _ = tiny_shape(tmp_path, "gemma4_text", "training.loss_chunk_tokens=64", final_logit_softcapping=30.0)
    assert loss_bytes(chunked, shape, tokens, True) == loss_bytes(chunked, uncapped, tokens, True)


def test_jittered_tokens_keep_their_noise(tmp_path):
    # Phi-3.5-MoE's block and its router each multiply the tokens by uniform noise in training: each noise tensor, h
    # a token, is kept for the tokens' gradient (2h more in every MoE layer than with input_jitter_noise 0).
    from dataclasses import replace

    from shardtune.plan.memory import layer_token_bytes

    config, shape = tiny_shape(tmp_path, "phimoe")
    _, still = tiny_shape(tmp_path, "phimoe", input_jitter_noise=0.0)
    assert shape.moe_layers and all(layer.jitter_noises == 2 for layer in shape.moe_layers)
    assert all(layer.jitter_noises == 0 for layer in still.layers)
    for layer in shape.moe_layers:
        jittered = layer_token_bytes(shape, layer, config, compiled=True)
        plain = layer_token_bytes(shape, replace(layer, jitter_noises=0), config, compiled=True)
        assert jittered.mlp - plain.mlp == 2 * shape.hidden * shape.compute_bytes == 2 * 64 * 2
        assert jittered.attention == plain.attention


def test_sdpa_keeps_repeated_key_values_and_a_sliding_windows_mask(tmp_path):
    # Gemma 4's sliding-window layer (window 16, 4 query heads on 2 key/value heads of 16) at 64 tokens a sequence
    # takes a materialized mask: transformers repeats its key/value heads to the query heads (2 x (64 - 32) elements
    # a token more) and sdpa keeps the additive mask it makes of it (64 elements a token, bf16). Its full-attention
    # layer (heads of 32, one key/value head) gets no mask and takes GQA in sdpa: nothing more. Heads wider than 256
    # are repeated even without a mask (use_gqa_in_sdpa): copies for two key/value heads, a view of a single one.
    from dataclasses import replace

    from shardtune.plan.memory import layer_token_bytes

    config, shape = tiny_shape(tmp_path, "gemma4_text", "data.max_length=64", "model.attn_implementation=sdpa")
    sliding, full = shape.layers
    assert (sliding.repeated_kv, sliding.sliding_mask) == (2 * (4 * 16 - 2 * 16), True)
    assert (full.repeated_kv, full.sliding_mask) == (0, False)
    plain = layer_token_bytes(shape, replace(sliding, repeated_kv=0, sliding_mask=False), config, compiled=True)
    assert layer_token_bytes(shape, sliding, config, compiled=True).attention - plain.attention == (64 + 64) * 2
    _, wide = tiny_shape(tmp_path, "gemma4_text", "data.max_length=64", "model.attn_implementation=sdpa",
                         global_head_dim=512, num_global_key_value_heads=2)  # fmt: skip
    assert (wide.layers[1].repeated_kv, wide.layers[1].sliding_mask) == (2 * (4 * 512 - 2 * 512), False)
    _, single = tiny_shape(tmp_path, "gemma4_text", "data.max_length=64", "model.attn_implementation=sdpa",
                           global_head_dim=512)  # fmt: skip
    assert (single.layers[1].repeated_kv, single.layers[1].sliding_mask) == (0, False)
    # No window shorter than the sequence: no mask, the heads go to sdpa as they are.
    _, short = tiny_shape(tmp_path, "gemma4_text", "data.max_length=16", "model.attn_implementation=sdpa")
    assert (short.layers[0].repeated_kv, short.layers[0].sliding_mask) == (0, False)
    # Eager attention takes no mask of this kind; it repeats the key/value heads whatever their width (2 x (4 x 16 - 2 x
    # 16) in the sliding layer; the full layer's single head is a view), and keeps its scores
    # (test_eager_attention_keeps_its_scores).
    _, eager = tiny_shape(tmp_path, "gemma4_text", "data.max_length=64", "model.attn_implementation=eager")
    assert [(layer.repeated_kv, layer.sliding_mask) for layer in eager.layers] == [
        (2 * (4 * 16 - 2 * 16), False),
        (0, False),
    ]


@pytest.mark.parametrize(
    ("rank", "shared", "experts", "padded"), [(8, False, 8, 8), (4, False, 8, 8), (4, True, 1, 4)],
    ids=["per-expert", "padded-rank", "shared-adapter"],
)  # fmt: skip
def test_routed_expert_adapters_keep_their_factors_as_the_grouped_gemms_take_them(
    tmp_path, rank, shared, experts, padded
):
    # Each forward of a fused block with LoRA on its routed experts copies every expert's A and B into bf16 as the
    # grouped GEMMs take them (the rank padded to a multiple of 8), and the GEMMs keep the copies for backward: once a
    # layer, whatever its tokens. Tiny Qwen3-MoE: 8 experts, hidden 64, expert width 32, so gate/up 64 -> 64 and down
    # 32 -> 64. An adapter shared by the experts is one (r, in) and (out, r) pair.
    from dataclasses import replace

    from shardtune.distributed.strategy import choose_parallelism
    from shardtune.plan.memory import _estimate, layer_token_bytes

    config, shape = tiny_shape(
        tmp_path, "qwen3_moe", "lora.moe_targets=[attention,routed_experts]", f"lora.r={rank}",
        f"lora.shared_expert_adapter={str(shared).lower()}",
    )  # fmt: skip
    expected = experts * padded * ((64 + 2 * 32) + (32 + 64))  # elements; bf16 below
    assert shape.moe_layers and all(layer.expert_adapter_factors == expected for layer in shape.moe_layers)
    plain_shape = replace(shape, layers=tuple(replace(layer, expert_adapter_factors=0) for layer in shape.layers))
    for layer, plain_layer in zip(shape.layers, plain_shape.layers, strict=True):
        counted = layer_token_bytes(shape, layer, config, compiled=True)
        plain = layer_token_bytes(plain_shape, plain_layer, config, compiled=True)
        assert (counted.factors, plain.factors) == (expected * 2, 0)
        assert counted.total == plain.total  # nothing per token
    # In the estimate: kept by every MoE layer but those that recompute their MLP (or all of themselves), and made
    # again in a recomputing layer's backward.
    _, attention_only = tiny_shape(tmp_path / "attention", "qwen3_moe")
    assert all(layer.expert_adapter_factors == 0 for layer in attention_only.layers)
    plan = choose_parallelism(shape, config, 1, None, True)
    count = len(shape.moe_layers)
    for part in (None, *PARTS):
        checkpointing = Checkpointing.uniform(len(shape.layers), part)
        with_factors, without = (_estimate(config, s, plan, True, checkpointing) for s in (shape, plain_shape))
        kept = count * expected * 2 if part in (None, "attention") else 0
        assert with_factors.activations - without.activations == kept, part
        assert with_factors.layer_backward > without.layer_backward, part


def test_the_factors_counted_are_what_a_fused_block_keeps(tmp_path):
    # The reference: what autograd saves in one forward of tiny Qwen3-MoE's first fused block in bf16 (LoRA r=4 on
    # attention and the routed experts), the (E, ., .) tensors that are no parameter: the factors' copies, each
    # kept once whatever the tokens (the same bytes at 64 and 256 tokens).
    import torch
    from tiny_models import write_tiny_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.model.fused_moe import use_fused_experts
    from shardtune.model.lora import apply_lora
    from shardtune.model.moe import find_moe_blocks
    from shardtune.plan.memory import layer_token_bytes

    directory = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), experts_implementation="eager")
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0, target_modules=None, moe_targets=["attention", "routed_experts"]
    )
    model = apply_lora(model, lora)
    use_fused_experts(model, decoder_layers(model), "fused")
    model = model.to(torch.bfloat16).train()
    block = find_moe_blocks(model, decoder_layers(model))[0]
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}

    def factor_bytes(tokens: int) -> int:
        x = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        return saved_bytes(
            lambda: block.block(x), parameters, lambda t: t.dim() == 3 and t.shape[0] == block.num_experts
        )

    config, shape = tiny_shape(tmp_path, "qwen3_moe", "lora.moe_targets=[attention,routed_experts]", "lora.r=4")
    counted = layer_token_bytes(shape, shape.moe_layers[0], config, compiled=True).factors
    assert factor_bytes(64) == factor_bytes(256) == counted == 8 * 8 * (128 + 96) * 2


@pytest.mark.parametrize(
    ("arch", "model_config"),
    [
        ("deepseek_v2", {"q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
                         "kv_lora_rank": 20, "head_dim": 4}),
        ("deepseek_v2", {"qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "kv_lora_rank": 20}),
        ("lfm2_moe", {}),
    ],
    ids=["latent-attention", "latent-attention-q-lora", "short-conv"],
)  # fmt: skip
def test_token_mixers_keep_what_is_counted(tmp_path, arch, model_config):
    # The reference: what autograd saves in one compiled forward of a tiny layer's token mixer in bf16 (LoRA r=8 on
    # attention, so its input, the layer's normalized hidden state, is kept too): DeepSeek-V2's multi-head latent
    # attention (4 heads, query/key heads 8 + 4 wide, value heads 12, latent 20; with and without a compressed query,
    # 32 wide) and LFM2's short convolution (its layer 1). Only the tensors of more than r elements a token in the
    # compute dtype: the LoRA A products (r wide), the norms' fp32 reciprocals and sdpa's fp32 log-sum-exp are not
    # counted. Without ``token_mixer`` the plain formula counts 3q + 2kv of the config's head_dim instead.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.model.lora import apply_lora

    config, shape = tiny_shape(tmp_path, arch, "model.attn_implementation=sdpa", **model_config)
    directory = tmp_path / arch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), attn_implementation="sdpa")
    model = apply_lora(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0, target_modules=None))
    model = model.to(torch.bfloat16).train()
    index = 1
    layer = decoder_layers(model)[index]
    tokens, hidden = 128, shape.hidden
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    if arch == "lfm2_moe":
        mixer, arguments = layer.conv, {}
    else:
        rotary = model.get_base_model().model.rotary_emb
        mixer = layer.self_attn
        arguments = {"attention_mask": None, "position_embeddings": rotary(x, torch.arange(tokens)[None])}
    skipped = {t.untyped_storage().data_ptr() for t in model.parameters()}
    skipped |= {t.untyped_storage().data_ptr() for t in arguments.get("position_embeddings", ())}

    def wide_bf16(tensor: torch.Tensor) -> bool:
        wide = tensor.untyped_storage().nbytes() // tensor.element_size() > 8 * tokens
        return tensor.dtype == torch.bfloat16 and wide

    run = torch.compile(mixer, fullgraph=True)
    measured = saved_bytes(lambda: run(x, **arguments), skipped, wide_bf16)
    counted = (shape.layers[index].token_mixer + hidden) * tokens * 2  # and the mixer's input, the normalized x
    expected = {
        "deepseek_v2": 2 * 4 * 12 + (2 * 20 + 4) + 4 * (8 + 3 * 12) + (64 if model_config.get("q_lora_rank", 1) else 0),
        "lfm2_moe": 6 * hidden,
    }[arch]
    assert shape.layers[index].token_mixer == expected
    # The convolution's input is padded by conv_L_cache - 1 positions a sequence (2 here): not per token, not counted.
    padding = (model.config.conv_L_cache - 1) * hidden * 2 if arch == "lfm2_moe" else 0
    assert measured == counted + padding, (measured, counted)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_a_frozen_compiled_block_keeps_what_is_counted(tmp_path, arch):
    # The reference: what autograd saves per token in one compiled forward of a tiny model's frozen parts in bf16 (LoRA
    # on attention only, the MoE default): its first fused MoE block and, for DeepSeek-V3, its first layer's dense MLP;
    # the bytes at 256 tokens less those at 64, so that what is kept once (the router's fp32 weight) drops out. The
    # planner counts for the block the gate/up rows of the chosen experts, the routing's own tensors
    # (ROUTER_EXPERT_BYTES per expert: the router's fp32 logits and probabilities; ROUTED_CHOICE_BYTES per chosen one:
    # its index, the pairs' sort and inverse, the weights before and after their normalization) and a frozen part's
    # gate and up (DeepSeek-V3's shared expert, 2s; its dense MLP, 2I); the layer's residual (h) is kept outside them.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.config import LoraConfig
    from shardtune.distributed.parallelize import decoder_layers
    from shardtune.model.fused_moe import use_fused_experts
    from shardtune.model.lora import apply_lora
    from shardtune.model.moe import find_moe_blocks
    from shardtune.plan.memory import ROUTED_CHOICE_BYTES, ROUTER_EXPERT_BYTES, layer_token_bytes

    config, shape = tiny_shape(tmp_path, arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tmp_path / arch), experts_implementation="eager"
    )
    model = apply_lora(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0, target_modules=None))
    use_fused_experts(model, decoder_layers(model), "fused")
    model = model.to(torch.bfloat16).train()
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}

    def kept_per_token(module: torch.nn.Module) -> float:
        run = torch.compile(module, fullgraph=True)

        def kept(tokens: int) -> int:
            x = torch.randn(1, tokens, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
            return saved_bytes(lambda: run(x), parameters)

        return (kept(256) - kept(64)) / 192

    residual = shape.hidden * shape.compute_bytes
    block = find_moe_blocks(model, decoder_layers(model))[0]
    moe_layer = shape.layers[block.layer]
    assert not moe_layer.block_trains and moe_layer.num_experts == block.num_experts
    counted = layer_token_bytes(shape, moe_layer, config, compiled=True).mlp - residual
    routing = moe_layer.num_experts * ROUTER_EXPERT_BYTES + moe_layer.top_k * ROUTED_CHOICE_BYTES
    gate_up = moe_layer.top_k * moe_layer.expert_row_width * shape.compute_bytes
    assert counted == routing + gate_up + 2 * moe_layer.shared_width * shape.compute_bytes
    # GPT-OSS's biased experts also keep each row's expert id (int64) for the weighted down-projection bias's backward:
    # not counted (6 MiB over gpt-oss-20b's 24 layers at 8,192 tokens). Its bias rows are gathered again in backward,
    # not kept (k x h a token: 4.2 GiB there).
    row_expert_ids = moe_layer.top_k * 8 if arch == "gpt_oss" else 0
    assert kept_per_token(block.block) == counted + row_expert_ids
    if arch == "deepseek_v3":  # its first layer is dense: a frozen MLP keeps gate and up
        dense = shape.layers[0]
        assert not dense.num_experts and not dense.mlp_trains
        counted = layer_token_bytes(shape, dense, config, compiled=True).mlp - residual
        assert kept_per_token(decoder_layers(model)[0].mlp) == counted == 2 * dense.mlp_width * shape.compute_bytes


@pytest.mark.parametrize(
    "model_config",
    [
        {"hidden_size": 256, "head_dim": 256, "global_head_dim": 512, "sliding_window": 64},
        {"sliding_window": 64, "global_head_dim": 320, "num_global_key_value_heads": 2},
    ],
    ids=["26b-a4b-heads", "tiny-hidden"],
)  # fmt: skip
def test_gemma4_layers_keep_what_is_counted(tmp_path, model_config):
    # The reference: what autograd saves in one forward of each of a tiny Gemma 4's two decoder layers (sliding window,
    # full attention), each compiled as training compiles it (``LayerCompiler``), bf16, LoRA r=8 on attention, sdpa, at
    # 192 tokens: three windows, so the sliding layer takes a materialized mask. Two proportions: heads of 256 and
    # 512 on a hidden size of 256 (26B-A4B's: q and kv wider than h; one key/value head of 512, repeated as a view),
    # and the tiny hidden size of 64 under heads of 16 and 320 (two key/value heads of 320, repeated as copies). Each
    # layer has its own widths: 4 query heads on 2 key/value heads (sliding) and 4 query heads on the full layer's
    # global key/value heads, the keys taken as the values (attention_k_eq_v). Counted to the byte (what no planner
    # term counts left out: ``kept_by_each_layer``).
    from shardtune.plan.memory import layer_token_bytes

    tokens, rank = 192, 8
    config, shape = tiny_shape(
        tmp_path, "gemma4_text", f"data.max_length={tokens}", "model.attn_implementation=sdpa", **model_config
    )
    model = tiny_lora_model(tmp_path / "gemma4_text", "sdpa", rank)
    for index, measured in enumerate(kept_by_each_layer(model, tokens, rank, compiled=True)):
        assert measured == layer_token_bytes(shape, shape.layers[index], config, compiled=True).total * tokens, index
    widths = [(layer.attention_width, layer.kv_width) for layer in shape.layers]
    head_dim, global_head_dim = model_config.get("head_dim", 16), model_config["global_head_dim"]
    global_kv_heads = model_config.get("num_global_key_value_heads", 1)
    assert widths == [(4 * head_dim, 2 * head_dim), (4 * global_head_dim, global_kv_heads * global_head_dim)]


@pytest.mark.parametrize(
    ("arch", "compiled", "tolerance"),
    [("qwen3_moe", True, 0), ("qwen3_moe", False, 0.015), ("gpt_oss", True, 0.02)],
    ids=["compiled", "uncompiled", "sinks-compiled"],
)  # fmt: skip
def test_eager_attention_keeps_its_scores(tmp_path, arch, compiled, tolerance):
    # transformers' eager attention (model.attn_implementation: eager; GPT-OSS's padded rows before FlexAttention) keeps
    # each sequence's heads x S x S scores twice, which none of sdpa's terms count: at 192 tokens a tiny layer's scores
    # are twice what the rest of it keeps (at 2,048 tokens, 23 times). The reference: what each decoder layer of tiny
    # Qwen3-MoE (4 query heads on 2 key/value heads, repeated as copies) and GPT-OSS (sliding-window and full layers;
    # its sinks a column more of the scores, and each row's expert id, not counted: 1.5%) saves in one forward, bf16,
    # LoRA on attention. Compiled as training compiles it, to the byte; uncompiled, the fp32 statistics of its norms and
    # the like make the 1.5% (what CPUs run).
    from shardtune.plan.memory import layer_token_bytes

    tokens, rank = 192, 4
    config, shape = tiny_shape(tmp_path, arch, f"data.max_length={tokens}", "model.attn_implementation=eager")
    assert all(layer.attention_scores == 4 * tokens for layer in shape.layers)
    model = tiny_lora_model(tmp_path / arch, "eager", rank)
    for index, measured in enumerate(kept_by_each_layer(model, tokens, rank, compiled)):
        counted = layer_token_bytes(shape, shape.layers[index], config, compiled).total * tokens
        assert measured == pytest.approx(counted, rel=tolerance, abs=0), index

"""``parallel.compile``: each decoder layer compiled (after activation checkpointing) trains to the same
losses as the eager model, alone and under DDP."""

from __future__ import annotations

import re

import pytest
from cli_runs import train

from shardtune.train.loss import softmax_compiles_right_on

# The chunked loss's softmax compiles too, chunks of 50 rows leaving a shorter last one.
COMMON = ["training.gradient_checkpointing=true", "data.pad_to=max_length", "data.max_length=64",
          "training.loss_chunk_tokens=50"]  # fmt: skip


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    run = train(tmp_path_factory.mktemp("compile"), "eager", 1, *COMMON, steps=3)
    assert "50 tokens at a time in the forward pass, the softmax eager" in run["log"]
    assert "torch.compile" not in run["log"]  # parallel.compile: auto, the default, is off on CPU
    return run


def test_compiled_layers_train_like_eager_ones(tmp_path, eager):
    compiled = train(tmp_path, "compiled", 1, *COMMON, "parallel.compile=true", steps=3)
    assert "torch.compile on 4 decoder layers" in compiled["log"]
    # The softmax compiled too, except where inductor computes its loss wrong (torch 2.11 on a CPU): eager there.
    softmax = "compiled" if softmax_compiles_right_on("cpu") else "eager"
    assert f"50 tokens at a time in the forward pass, the softmax {softmax}" in compiled["log"]
    assert compiled["log"].count("graph(s) compiled in") == 1  # the compile time, once
    # LoRA on every linear layer: q/k/v's and gate/up's down-projections, one GEMM each (shared_input_gemms)
    assert re.search(r"compiled in [\d.]+ s; [1-9]\d* group\(s\) of narrow trainable GEMMs reading one input",
                     compiled["log"])  # fmt: skip
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)


def test_without_a_working_cxx_compiler_the_layers_train_eagerly_after_one_warning(tmp_path, eager):
    # Inductor's CPU backend needs a C++ compiler, as its GPU backend needs Triton: one warning naming the
    # cause, and the run trains eagerly to the same losses.
    fallback = train(tmp_path, "fallback", 1, *COMMON, "parallel.compile=true", steps=3, env={"CXX": "/no/such/g++"})
    warnings = [line for line in fallback["log"].splitlines() if "torch.compile failed" in line]
    assert len(warnings) == 1 and "InvalidCxxCompiler" in warnings[0], fallback["log"][-3000:]
    assert "the decoder layers run eagerly" in warnings[0] and "Traceback" not in fallback["log"]
    assert "graph(s) compiled in" not in fallback["log"]
    assert fallback["losses"] == pytest.approx(eager["losses"], rel=1e-6)


def test_dynamos_request_to_trace_again_is_no_failure(monkeypatch):
    # Dynamo asks to trace a frame again by raising RestartAnalysis from inside the backend (inductor's pass that turns
    # Python floats into tensors raises TensorifyScalarRestartAnalysis where it must specialize one); it catches it
    # and calls the backend again. Taken for a failure, it sent every layer after it to eager.
    import torch

    from shardtune.distributed.compile import LayerCompiler

    def restarting(graph, example_inputs):
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis

    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: restarting)
    compiler = LayerCompiler()
    graph = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(torch._dynamo.exc.RestartAnalysis):
        compiler(graph, [torch.ones(2)])
    assert compiler.failure is None


@pytest.mark.variants
def test_ddp_runs_each_compiled_layer_as_one_graph_and_trains_like_one_process(tmp_path):
    # r=512: a layer's adapters (1.8 MB) pass DDP's first 1 MB bucket, where dynamo's DDP optimizer
    # would split the layer's graph in two (and log the split under TORCH_LOGS=ddp_graphs).
    common = ["data.pad_to=max_length", "data.max_length=64", "parallel.compile=true", "lora.r=512"]
    one = train(tmp_path, "one", 1, *common, "training.gradient_accumulation_steps=2", steps=3)
    ddp = train(tmp_path, "ddp", 2, *common, "parallel.strategy=ddp", steps=3, env={"TORCH_LOGS": "ddp_graphs"})
    assert "parallelism: ddp over 2 rank(s)" in ddp["log"]
    assert "split graph" not in ddp["log"]
    assert ddp["losses"] == pytest.approx(one["losses"], rel=1e-5)


@pytest.mark.variants
def test_fused_moe_layers_compile_without_a_graph_break_and_train_like_eager(tmp_path):
    """A fused MoE block reports its routing from inside the graph: its compiled decoder layer is one graph,
    and the compiled run trains to the eager run's losses and expert counts, LoRA on the routed experts and
    the load-balancing loss trained too."""
    from cli_runs import jsonl
    from tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    common = [
        f"model.name_or_path={model}", "model.init=random", "training.gradient_checkpointing=true",
        "data.pad_to=max_length", "data.max_length=64", "lora.target_modules=null",
        "lora.moe_targets=[attention,routed_experts]", "training.moe_aux_loss_coef=0.01",
    ]  # fmt: skip
    eager = train(tmp_path, "eager", 1, *common, steps=3)
    compiled = train(
        tmp_path, "compiled", 1, *common, "parallel.compile=true", steps=3,
        env={"TORCH_LOGS": "graph_breaks,dynamo"},
    )  # fmt: skip
    assert "moe experts: fused" in compiled["log"] and "torch.compile on 2 decoder layers" in compiled["log"]
    assert "torchdynamo done tracing" in compiled["log"]  # dynamo's logs reach the log
    # A graph break is logged, and dynamo goes on in a function it names torch_dynamo_resume_in_...
    assert "Graph break" not in compiled["log"] and "resume_in" not in compiled["log"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)

    def counts(run: dict) -> list:
        return [[layer["counts"] for layer in row["layers"]] for row in jsonl(run["out"] / "logs/expert_usage.jsonl")]

    assert counts(compiled) == counts(eager)

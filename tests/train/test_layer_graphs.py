"""``parallel.cuda_graphs``: compiled decoder layers replayed as CUDA graphs train to the losses, gradients and
routing records of the same layers run without graphs (GPU runs, marked gpu), and the option says clearly where
it cannot be on."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from cli_runs import jsonl, train
from conftest import TINY_MODEL
from tiny_models import write_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.config import ParallelConfig
from shardtune.distributed.layer_graphs import _stand_ins, installed_graphs
from shardtune.distributed.parallelize import graph_layers
from shardtune.errors import ConfigError

# Inductor picks a reduction's block size by timing its candidates on the first call, and the block size sets the
# order of the sum: two runs that compare losses bit for bit need the same pick, which timings on a GPU other tests
# share do not give (under pytest -n 6 on one H200, a run with graphs and one without once differed by 7.5e-8 in the
# first step's loss, computed before any graph is captured). Inductor's deterministic mode picks without timing.
DETERMINISTIC_COMPILE = {"TORCHINDUCTOR_DETERMINISTIC": "1"}
ON_GPU = {"CUDA_VISIBLE_DEVICES": "0", **DETERMINISTIC_COMPILE}


def moe_run(model) -> list[str]:
    """The runs' shared overrides: the tiny Qwen3-MoE ``model``, LoRA on attention and the routed experts, the
    load-balancing loss trained, rows of 64 tokens, compiled layers."""
    return [
        f"model.name_or_path={model}", "model.init=random", "data.max_length=64", "lora.target_modules=null",
        "lora.moe_targets=[attention,routed_experts]", "training.moe_aux_loss_coef=0.01", "parallel.compile=true",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("where", "overrides", "strategy", "needs"),
    [
        ("cpu", {}, "single", "a CUDA GPU"),
        ("cuda", {"compile": False}, "single", "parallel.compile"),
        ("cuda", {}, "fsdp", "one process or parallel.strategy: ddp (this run shards the weights with FSDP)"),
    ],
)
def test_cuda_graphs_asked_for_where_they_cannot_run_is_one_clear_line(where, overrides, strategy, needs):
    asked = ParallelConfig(cuda_graphs=True, **overrides)
    with pytest.raises(ConfigError) as error:
        asked.graphs_on(where, strategy, one_shape=True, attention="sdpa", packed=False)
    assert str(error.value) == f"parallel.cuda_graphs: true needs {needs}; set parallel.cuda_graphs: auto or false"
    # auto: off, silently
    assert not ParallelConfig(**overrides).graphs_on(where, strategy, one_shape=True, attention="sdpa", packed=False)


def test_cuda_graphs_are_on_by_default_on_one_gpu_or_ddp_where_batches_keep_one_shape():
    for strategy in ("single", "ddp"):
        assert ParallelConfig().graphs_on("cuda", strategy, one_shape=True, attention="sdpa", packed=False)
    # Batches padded to their longest row: a graph captured for one shape would keep its memory beside the others'.
    assert not ParallelConfig().graphs_on("cuda", "single", one_shape=False, attention="sdpa", packed=False)
    assert ParallelConfig(cuda_graphs=True).graphs_on(
        "cuda", "single", one_shape=False, attention="sdpa", packed=False
    )  # tried
    assert not ParallelConfig(cuda_graphs=False).graphs_on(
        "cuda", "single", one_shape=True, attention="sdpa", packed=False
    )


def test_flex_attention_has_cuda_graphs_with_packed_batches_only():
    """Packed rows get shardtune's BlockMask, whose mask function reads a buffer every batch refills; transformers'
    mask of padded rows closes over a new tensor every batch, which a graph would read at its captured address."""
    assert ParallelConfig().graphs_on("cuda", "single", one_shape=True, attention="flex_attention", packed=True)
    assert not ParallelConfig().graphs_on("cuda", "single", one_shape=True, attention="flex_attention", packed=False)
    with pytest.raises(ConfigError) as error:
        ParallelConfig(cuda_graphs=True).graphs_on(
            "cuda", "single", one_shape=True, attention="flex_attention", packed=False
        )
    assert str(error.value) == (
        "parallel.cuda_graphs: true needs data.packing where model.attn_implementation is flex_attention; set "
        "parallel.cuda_graphs: auto or false"
    )


def test_a_packed_batchs_flex_mask_is_described_alike_every_batch_and_rebuilt_from_its_parts():
    """What a graph needs of FlexAttention's mask of packed rows: batches of one shape give calls a graph replays
    (one mask function, reading the documents the latest batch wrote; the block tensors as tensor arguments), and
    the mask rebuilt from its parts is the mask; made without a warning."""
    from torch.nn.attention.flex_attention import create_mask
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from shardtune.distributed.layer_graphs import describe_call, masks_as_parts, parts_as_masks
    from shardtune.model.packed_attention import packed_block_mask

    def positions(*lengths: int) -> list[int]:
        return [position for length in lengths for position in range(length)]

    rows = 256  # two blocks of 128
    first = torch.tensor([positions(100, 156), positions(200, 30, 26)])
    second = torch.tensor([positions(10, 246), positions(128, 128)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="shardtune")  # e.g. a deprecated way of compiling its construction
        masks = [packed_block_mask(first), packed_block_mask(second)]
    assert masks[0].mask_mod is masks[1].mask_mod
    documents = torch.tensor([[0] * 10 + [1] * 246, [0] * 128 + [1] * 128])
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    expected = causal & (documents[:, :, None] == documents[:, None, :])
    assert torch.equal(create_mask(masks[1].mask_mod, 2, None, rows, rows, device="cpu")[:, 0], expected)

    layer = torch.nn.Linear(4, 4)
    hidden = torch.randn(2, rows, 4, requires_grad=True)
    calls = []
    for mask in masks:
        leaves, spec = tree_flatten(masks_as_parts(((hidden,), {"attention_mask": mask})))
        calls.append(describe_call(layer, leaves, spec, [], []))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        assert [id(t) for t in tensors[1:]] == [id(v) for _, v in sorted(vars(mask).items()) if torch.is_tensor(v)]
        rebuilt = parts_as_masks(tree_unflatten(leaves, spec))[1]["attention_mask"]
        assert type(rebuilt) is type(mask) and vars(rebuilt).keys() == vars(mask).keys()
        for name, value in vars(mask).items():  # the same tensors, equal values, the same mask function
            assert vars(rebuilt)[name] is value if torch.is_tensor(value) else vars(rebuilt)[name] == value, name
    assert calls[0] == calls[1] and not isinstance(calls[0], str)


def test_the_capture_reads_the_trainable_parameters_through_stand_ins_that_take_their_gradients():
    """What the warm-up and the capture run a layer under (CUDA aside): each trainable parameter, also one tied
    between two modules, is swapped for its stand-in on the same memory; the stand-ins take the gradients, the
    parameters none (DDP's accumulators never see the capture), and the layer gets its own parameters back."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    second.weight = first.weight  # tied
    first.bias.requires_grad_(False)
    layer = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    params = [param for param in layer.parameters() if param.requires_grad]
    assert len(params) == 2  # the tied weight once, the second bias
    stand_ins = [torch.nn.Parameter(param.detach(), requires_grad=True) for param in params]
    x = torch.randn(3, 4)
    with _stand_ins(layer, params, stand_ins):
        assert first.weight is second.weight is stand_ins[0] and second.bias is stand_ins[1]
        captured = layer(x).square().sum()
    assert first.weight is second.weight is params[0] and second.bias is params[1]
    grads = torch.autograd.grad(captured, stand_ins)
    expected = torch.autograd.grad(layer(x).square().sum(), params)
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)
    assert all(param.grad is None for param in params)
    assert [stand_in.data_ptr() for stand_in in stand_ins] == [param.data_ptr() for param in params]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize(
    ("recompute", "batches"),
    [("nothing", "padded"), ("attention", "padded"), ("nothing", "packed"), ("nothing", "packed-flex")],
)
def test_layers_replayed_as_cuda_graphs_train_like_the_compiled_layers(tmp_path, recompute, batches):
    """A MoE model with LoRA on attention and the routed experts, the load-balancing loss trained, padded rows
    (the real-token mask matters) and two micro-batches a step (gradients accumulate over two replays); with
    each layer's attention recomputed inside its graph, too; and packed rows (padded to max_length, so graphs
    are on by default), under sdpa (whose mask is a tensor) and FlexAttention (shardtune's BlockMask). The
    run's last evaluation (another shape, no grad) runs the layers without the graphs."""
    model = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    checkpointing = {
        "nothing": ["training.gradient_checkpointing=false"],
        "attention": ["training.gradient_checkpointing=true", "training.gradient_checkpointing_granularity=attention"],
    }[recompute]
    shape = {
        "padded": ["data.pad_to=max_length"],
        "packed": ["data.packing=true", "model.attn_implementation=sdpa"],
        "packed-flex": ["data.packing=true", "model.attn_implementation=flex_attention"],
    }
    common = [*moe_run(model), *checkpointing, *shape[batches], "training.gradient_accumulation_steps=2"]
    plain = train(tmp_path, "plain", 1, *common, "parallel.cuda_graphs=false", steps=6, env=ON_GPU)
    graphed = train(tmp_path, "graphed", 1, *common, steps=6, env=ON_GPU)
    assert "cuda graphs" not in plain["log"]
    assert "cuda graphs: 2 of 2 decoder layers" in graphed["log"]
    assert (plain["metrics"]["cuda_graph_layers"], graphed["metrics"]["cuda_graph_layers"]) == (0, 2)
    # Two forwards a step: the first two compile and warm up, the third (step 2's first) is captured and replayed.
    captured = [run["metrics"]["cuda_graphs_captured_in_step"] for run in (plain, graphed)]
    assert captured == [None, 2]
    assert graphed["log"].count("cuda graphs: 2 decoder layers captured (forward and backward)") == 1
    assert "failed" not in graphed["log"] and "another shape" not in graphed["log"]
    # With the attention recomputed, two runs without graphs differ from the fourth step on (by 4.7e-6 of the
    # loss, measured on one H200): its backward is not deterministic. Until then they are equal.
    tolerance, exact_steps = {"nothing": 1e-6, "attention": 1e-4}[recompute], 3
    assert graphed["losses"][:exact_steps] == plain["losses"][:exact_steps]
    assert graphed["losses"] == pytest.approx(plain["losses"], rel=tolerance)
    for key in ("grad_norm", "moe_balance_loss"):
        rows = [jsonl(run["out"] / "logs/train_log.jsonl") for run in (plain, graphed)]
        assert [row.get(key) for row in rows[1]] == pytest.approx([row.get(key) for row in rows[0]], rel=tolerance * 10)

    def usage(run: dict) -> list:
        rows = jsonl(run["out"] / "logs/expert_usage.jsonl")
        return [[(layer["counts"], round(layer["entropy"], 5)) for layer in row["layers"]] for row in rows]

    assert usage(graphed)[:exact_steps] == usage(plain)[:exact_steps]
    evaluations = [jsonl(run["out"] / "logs/eval_log.jsonl") for run in (plain, graphed)]
    assert evaluations[1][-1]["eval_loss"] == pytest.approx(evaluations[0][-1]["eval_loss"], rel=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (SHARDTUNE_TEST_GPU=1)")
def test_ddp_replays_the_layers_as_cuda_graphs_and_trains_like_one_process(tmp_path):
    """Two processes under DDP: each replayed backward hands its parameters' gradients to autograd, where DDP's
    hooks average them over the ranks as they do without graphs. The losses, gradient norms and balance losses of
    the same DDP run without graphs, and of one process accumulating the same global batch."""
    model = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    common = [*moe_run(model), "training.gradient_checkpointing=false", "data.pad_to=max_length"]
    ddp = [*common, "parallel.strategy=ddp"]
    both = {"CUDA_VISIBLE_DEVICES": "0,1", **DETERMINISTIC_COMPILE}
    one = train(tmp_path, "one", 1, *common, "training.gradient_accumulation_steps=2", steps=6, env=ON_GPU)
    plain = train(tmp_path, "plain", 2, *ddp, "parallel.cuda_graphs=false", steps=6, env=both)
    graphed = train(tmp_path, "graphed", 2, *ddp, steps=6, env=both)
    assert graphed["metrics"]["strategy"] == "ddp" and graphed["metrics"]["world_size"] == 2
    assert "cuda graphs: 2 of 2 decoder layers" in graphed["log"]
    assert (plain["metrics"]["cuda_graph_layers"], graphed["metrics"]["cuda_graph_layers"]) == (0, 2)
    # One step a forward on each rank: the first two compile and warm up, the third is captured and replayed.
    assert graphed["metrics"]["cuda_graphs_captured_in_step"] == 3
    assert graphed["losses"][:3] == plain["losses"][:3]
    assert graphed["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    rows = {name: jsonl(run["out"] / "logs/train_log.jsonl") for name, run in (("plain", plain), ("graphed", graphed))}
    for key in ("grad_norm", "moe_balance_loss"):
        graphed_values = [row[key] for row in rows["graphed"]]
        assert graphed_values == pytest.approx([row[key] for row in rows["plain"]], rel=1e-5), key
    # DDP's sum over ranks against the sum over micro-batches, through Adam: 2.1e-5 apart at the fifth step
    # (measured on 2 H100s).
    assert graphed["losses"] == pytest.approx(one["losses"], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_layers_recomputed_whole_run_without_cuda_graphs(tmp_path):
    run = train(tmp_path, "whole", 1, "data.pad_to=max_length", "data.max_length=64", "parallel.compile=true",
                "training.gradient_checkpointing=true", "training.gradient_checkpointing_granularity=layer",
                steps=3, env=ON_GPU)  # fmt: skip
    assert "cuda graphs: 0 of 4 decoder layers, once training batches keep one shape (4 recompute whole layers or " \
           "run hooks)" in run["log"]  # fmt: skip
    assert "captured" not in run["log"]


def compiled_twins(use_cache: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model twice, each decoder layer compiled; the second one's layers graphed."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.use_cache = use_cache
    plain = AutoModelForCausalLM.from_config(config).cuda().train()
    graphed = copy.deepcopy(plain)
    for model in (plain, graphed):
        for layer in model.model.layers:
            layer.compile()
    graph_layers(graphed, list(graphed.model.layers))
    return plain, graphed


def assert_trains_alike(plain: torch.nn.Module, graphed: torch.nn.Module, length: int) -> None:
    """One forward and backward of a random batch: the same loss and gradients."""
    ids = torch.randint(0, plain.config.vocab_size, (2, length), device="cuda")
    results = []
    for model in (plain, graphed):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), [param.grad for param in model.parameters()]))
    (plain_loss, plain_grads), (graphed_loss, graphed_grads) = results
    assert graphed_loss == pytest.approx(plain_loss, rel=1e-6)
    for plain_grad, graphed_grad in zip(plain_grads, graphed_grads, strict=True):
        torch.testing.assert_close(graphed_grad, plain_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_a_training_batch_of_another_shape_gives_the_graphs_up(caplog):
    """Captured at the third forward of one shape, replayed at the fourth; a batch of another shape gives the
    graphs up, and the layers run without them from then on, also at the captured shape. Every loss and gradient
    equals the same compiled layers never graphed."""
    caplog.set_level("INFO", logger="shardtune")
    plain, graphed = compiled_twins()
    layers = len(graphed.model.layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, length in enumerate((32, 32, 32, 32, 48, 32, 32)):
            assert_trains_alike(plain, graphed, length)
            captured = caplog.text.count(f"cuda graphs: {layers} decoder layers captured")
            given_up = caplog.text.count("cuda graphs: a training batch of another shape than the captured one")
            assert (captured, given_up) == ((0, 0) if step < 2 else (1, 0) if step < 4 else (1, 1)), step
    # No backward after the capture waits on the capture's stream for a parameter's gradient accumulator.
    assert not [warning for warning in caught if "AccumulateGrad node's stream" in str(warning.message)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_layers_called_with_an_object_a_graph_cannot_replay_run_without_graphs(caplog):
    """A model that keeps a key-value cache while training hands each layer the cache object: one log line, no
    capture, and the results of the layers never graphed."""
    caplog.set_level("INFO", logger="shardtune")
    plain, graphed = compiled_twins(use_cache=True)
    for _ in range(4):
        assert_trains_alike(plain, graphed, 32)
    given_up = "cuda graphs: the decoder layers are called with a DynamicCache, which a graph cannot replay"
    assert caplog.text.count(given_up) == 1
    assert "captured" not in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_a_capture_that_fails_leaves_memory_and_random_numbers_as_they_were(caplog):
    """A layer that waits on the host while it is captured (the capture fails inside CUDA, after the first layer's
    graph was captured into the pool): one warning, the pool's memory comes back, random ops (dropout) still
    run, and the layers train without graphs to the results of the twin never graphed."""
    caplog.set_level("INFO", logger="shardtune")
    plain, graphed = compiled_twins()
    graphs = installed_graphs(graphed)
    compiled = graphs.compiled[1]

    def waits_on_the_host_when_captured(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return compiled(*args, **kwargs)

    graphs.compiled[1] = waits_on_the_host_when_captured
    for _ in range(3):  # the capture is tried before the third forward's first layer
        assert_trains_alike(plain, graphed, 32)
    assert caplog.text.count("cuda graphs: capturing the decoder layers failed") == 1
    assert "captured (forward and backward)" not in caplog.text
    # Nothing is left in a graph's memory pool (the capture stream's cuBLAS workspaces stay, outside the pools).
    torch.cuda.empty_cache()
    pooled = [segment for segment in torch.cuda.memory_snapshot() if tuple(segment["segment_pool_id"]) != (0, 0)]
    assert sum(segment["total_size"] for segment in pooled) == 0
    kept = torch.nn.functional.dropout(torch.ones(1024, device="cuda"), 0.5)
    assert 0 < int(kept.count_nonzero()) < 1024
    for _ in range(2):
        assert_trains_alike(plain, graphed, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_a_trainable_parameter_without_a_gradient_gives_the_graphs_up(caplog):
    """The capture reads each layer's trainable parameters through stand-ins: one that gets no gradient in the
    warm-up (here unused; a layer could also read it other than as its module's attribute) gives the graphs up,
    naming it, and the layers train without graphs to the results of the twin never graphed."""
    caplog.set_level("INFO", logger="shardtune")
    plain, graphed = compiled_twins()
    for model in (plain, graphed):
        model.model.layers[1].register_parameter("unused", torch.nn.Parameter(torch.zeros(4, device="cuda")))
    for _ in range(4):
        assert_trains_alike(plain, graphed, 32)
    assert (
        caplog.text.count(
            "cuda graphs: capturing the decoder layers failed (ValueError: decoder layer 1's parameter unused got no "
            "gradient in the warm-up (unused, or read other than as its module's attribute)); they run without graphs"
        )
        == 1
    )

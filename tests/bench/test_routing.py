"""``model.init_routing`` / ``shardtune bench --routing``: router weights of random models for an even or a
trained-like expert load, the same in shardtune's run and the HF baseline's, and the load both measured."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.cli import main
from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.init_routing import (
    router_weights_digest,
    set_init_routing,
    simulated_max_mean,
    skew_spread,
    skewed_max_mean,
)
from shardtune.model.moe import RoutingRecorder, find_moe_blocks

QWEN3_MOE = dict(
    model_type="qwen3_moe", vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32,
    num_experts_per_tok=4, max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip
# LFM2-MoE: short convolutions in four of six layers, attention in two, each with its out_proj; the first layer dense.
LFM2_MOE = dict(
    model_type="lfm2_moe", vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, num_experts=32, num_experts_per_tok=4,
    num_dense_layers=1, layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
    max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip


def _loads(routing: str, seed: int = 0, shape: dict = QWEN3_MOE) -> list[float]:
    """max/mean load per MoE layer of a 6-layer model (32 experts, top 4) on fresh random tokens."""
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    blocks = find_moe_blocks(model, decoder_layers(model))
    set_init_routing(model, blocks, routing, seed)
    recorder = RoutingRecorder(blocks)
    tokens = torch.randint(0, 4096, (4, 512), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad(), recorder.recording(None):
        model(tokens)
    loads = []
    for record in recorder.records:
        loads.append(float(record.counts.max() / record.counts.mean()))
    return loads


def test_balanced_and_skewed_loads_hold_on_tokens_the_weights_never_saw():
    random, balanced, skewed = _loads("random"), _loads("balanced"), _loads("skewed")
    # Drawn routers send a sequence's tokens to the same experts, more so with depth.
    assert max(random) > 3.0
    assert all(load < 1.4 for load in balanced)
    target = skewed_max_mean(32, 4)  # 1 + 7/10
    assert target == pytest.approx(1.7)
    assert all(abs(load - target) < 0.35 for load in skewed) and sum(skewed) / 6 == pytest.approx(target, abs=0.15)


def test_the_token_mixers_of_a_hybrid_model_are_scaled_and_its_loads_hold():
    """LFM2-MoE names both its attention's and its short convolutions' output projections out_proj: each token
    mixer's is scaled, nothing else, and the loads hold as on Qwen3-MoE (before: a ConfigError, no o_proj)."""
    config = AutoConfig.for_model(**LFM2_MOE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    drawn = {name: weight.clone() for name, weight in model.state_dict().items()}
    set_init_routing(model, find_moe_blocks(model, decoder_layers(model)), "balanced", seed=0)
    changed = {name for name, weight in model.state_dict().items() if not torch.equal(weight, drawn[name])}
    scaled = {name for name in changed if name.endswith("out_proj.weight")}
    assert sorted({name.split(".")[3] for name in scaled}) == ["conv", "self_attn"] and len(scaled) == 6
    for name in scaled:
        torch.testing.assert_close(model.state_dict()[name], drawn[name] / (8 * 6), rtol=1e-6, atol=0)
    assert changed - scaled == {f"model.layers.{layer}.feed_forward.gate.weight" for layer in range(1, 6)}
    balanced, skewed = _loads("balanced", shape=LFM2_MOE), _loads("skewed", shape=LFM2_MOE)
    assert len(balanced) == 5 and all(load < 1.4 for load in balanced)
    assert sum(skewed) / 5 == pytest.approx(skewed_max_mean(32, 4), abs=0.2)


def test_a_block_without_a_routing_rule_gets_its_router_set(monkeypatch):
    """A MoE block found by its structure whose router has no rule in moe.ROUTING_RULES (transformers' experts run
    it) has no hash table either: its routers are set and digested as any other's (before: an AttributeError)."""
    from shardtune.model import moe

    monkeypatch.delitem(moe.ROUTING_RULES, "Qwen3MoeSparseMoeBlock")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_MOE))
    blocks = find_moe_blocks(model, decoder_layers(model))
    assert blocks and all(block.routing is None and block.choice_table is None for block in blocks)
    drawn = router_weights_digest(blocks)
    set_init_routing(model, blocks, "balanced", seed=0)
    assert router_weights_digest(blocks) != drawn
    rows = blocks[0].router.weight.double()
    torch.testing.assert_close(rows @ rows.t(), torch.eye(32, dtype=torch.float64))  # orthonormal rows


def test_skew_spread_reaches_the_target_of_each_shape():
    for experts, top_k, target in [(128, 8, 2.5), (160, 8, 2.9), (8, 2, 1.3)]:
        assert skewed_max_mean(experts, top_k) == pytest.approx(target)
        assert simulated_max_mean(experts, top_k, skew_spread(experts, top_k)) == pytest.approx(target, abs=0.01)


def test_routing_weights_depend_on_the_seed_only():
    def digest(routing: str, seed: int) -> str:
        config = AutoConfig.for_model(
            "qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
            num_experts_per_tok=2, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        blocks = find_moe_blocks(model, decoder_layers(model))
        set_init_routing(model, blocks, routing, seed)
        return router_weights_digest(blocks)

    assert digest("skewed", 3) == digest("skewed", 3)
    assert len({digest("skewed", 3), digest("skewed", 4), digest("balanced", 3), digest("random", 3)}) == 4


def test_hash_layers_get_distinct_experts_per_token_id():
    """DeepSeek-V4's hash layers choose each token's experts from a table by token id, all expert 0 as drawn:
    ``balanced`` fills it with distinct experts per id and an even load; the table is part of the digest."""
    from tiny_models import MORE_FUSED_MOE_ARCHITECTURES, tiny_config

    if "deepseek_v4" not in MORE_FUSED_MOE_ARCHITECTURES:
        pytest.skip("this transformers has no DeepSeek-V4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v4"))
    blocks = find_moe_blocks(model, decoder_layers(model))
    hashed = [block for block in blocks if block.routing.choice_table is not None]
    assert hashed and all(not block.router_child.tid2eid.any() for block in hashed)
    drawn = router_weights_digest(blocks)
    set_init_routing(model, blocks, "balanced", seed=0)
    assert router_weights_digest(blocks) != drawn
    tokens = torch.randint(3, 1000, (4, 256), generator=torch.Generator().manual_seed(1))
    for block in hashed:
        chosen = block.router_child.tid2eid[tokens.reshape(-1)]
        assert (chosen[:, 0] != chosen[:, 1]).all()  # two distinct experts per token
        counts = torch.bincount(chosen.reshape(-1), minlength=block.num_experts).double()
        assert counts.max() / counts.mean() < 1.2  # 2,048 choices over 8 experts, even but for sampling noise


def test_dbrx_attention_outputs_are_scaled_and_its_routers_set():
    """DBRX's attention output projection is ``out_proj`` (a name Mamba-2 mixers use too, found by its attention's
    class): ``balanced`` scales it by 1 / (8 x layers) and gives its routers' Linear (``router.layer``) orthonormal
    rows; before, no attention output projection was found (a ConfigError)."""
    from tiny_models import MORE_FUSED_MOE_ARCHITECTURES, tiny_config

    if "dbrx" not in MORE_FUSED_MOE_ARCHITECTURES:
        pytest.skip("this transformers has no DBRX")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("dbrx"))
    blocks = find_moe_blocks(model, decoder_layers(model))
    drawn = [layer.norm_attn_norm.attn.out_proj.weight.clone() for layer in model.transformer.blocks]
    set_init_routing(model, blocks, "balanced", seed=0)
    for layer, weight in zip(model.transformer.blocks, drawn, strict=True):
        torch.testing.assert_close(layer.norm_attn_norm.attn.out_proj.weight, weight / 16)
    for block in blocks:
        rows = block.router.weight.double()
        torch.testing.assert_close(rows @ rows.t(), torch.eye(8, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.variants
def test_bench_routing_and_layers_on_both_sides(tmp_path, capsys):
    """Skewed routing (the default) on a 3-layer qwen3-moe-tiny: both runs measure the same load from the
    same routers; balanced gives a lower one and --layers a model of that many layers, FLOPs included."""
    args = ["bench", "--shape", "qwen3-moe-tiny", "--seq", "128", "--batch", "4", "--steps", "2", "--warmup", "1"]
    out = tmp_path / "skewed"
    assert main([*args, "--layers", "3", "--baseline", "hf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "bench.json").read_text())
    assert results["routing"] == "skewed" and results["layers"] == 3
    assert json.loads((out / "model" / "config.json").read_text())["num_hidden_layers"] == 3
    assert "init_routing: skewed" in (out / "config.yaml").read_text()
    # The HF baseline's routers are those of model.init_routing with the run's seed, as shardtune's are.
    from shardtune.bench.shapes import shape_config

    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_config(shape_config("qwen3-moe-tiny", layers=3))
    blocks = find_moe_blocks(model, decoder_layers(model))
    set_init_routing(model, blocks, "skewed", 42)
    assert results["hf"]["router_weights_sha256"] == router_weights_digest(blocks)
    for name in ("shardtune", "hf"):
        load = results[name]["expert_load"]
        assert 1.4 < load["max_mean"] < 2.1 and load["max_mean"] <= load["max_mean_worst"]
        usage = out / ("shardtune/logs" if name == "shardtune" else "hf") / "expert_usage.jsonl"
        records = [json.loads(line) for line in usage.read_text().splitlines()]
        assert [record["step"] for record in records] == [1, 2, 3] and len(records[0]["layers"]) == 3
        ratios = [layer["max_mean_ratio"] for record in records[1:] for layer in record["layers"]]
        assert load["max_mean"] == pytest.approx(sum(ratios) / len(ratios))
        # 3 layers of 64 + attention 2 x 64 x 64 + 2 x 64 x 32, router 64 x 16 + 2 of 16 experts of 3 x 64 x 32.
        per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 16 + 2 * 3 * 64 * 32
        matmul = 3 * per_layer + 8192 * 64
        flops = 4 * matmul + 6 * results[name]["trainable_params"] + 12 * 3 * 64 * 128
        assert results[name]["flops_per_token"] == pytest.approx(flops, rel=1e-12)
    assert "expert load, max/mean over layers and measured steps (skewed routing): shardtune " in printed

    balanced = tmp_path / "balanced"
    assert main([*args, "--routing", "balanced", "--out", str(balanced)]) == 0
    load = json.loads((balanced / "bench.json").read_text())["shardtune"]["expert_load"]["max_mean"]
    assert load < 1.4 < results["shardtune"]["expert_load"]["max_mean"]


def test_init_routing_needs_random_weights(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("model: {name_or_path: x, init_routing: balanced}\ndata: {dataset_path: d.jsonl}\n")
    assert main(["train", str(config)]) == 2
    assert "init_routing: balanced sets up random weights; needs init: random" in capsys.readouterr().err


def test_profile_share_sorts_kernels_by_kind(tmp_path, capsys):
    import gzip

    from shardtune.bench import profile_share

    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 600), ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 100),
        ("void cutlass::device_kernel<at::cuda::detail::GroupedGemm>", 100), ("flash_fwd_kernel", 50),
        ("void at::native::elementwise_kernel<128, 4>", 100), ("void at::native::index_put_kernel", 50),
        # inductor's elementwise kernels, named after the GEMM or attention they feed: other; its templates: GEMM
        ("triton_poi_fused__grouped_mm_floor_divide_index_select_0", 40), ("triton_red_fused__mm_attn_sum_1", 10),
        ("triton_tem_fused_mm_2", 50),
        ("_grouped_float8_gemm_kernel", 100),  # shardtune's float8 grouped GEMM (model/float8_grouped_kernel.py)
    ]  # fmt: skip
    events = [{"cat": "kernel", "name": name, "dur": duration} for name, duration in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "dur": 5000})  # host events are not device time
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    assert profile_share.main([str(trace)]) == 0
    printed = capsys.readouterr().out
    assert "  gemm          0.001 s   79.2%" in printed and "  attention     0.000 s    4.2%" in printed
    assert "  other         0.000 s   16.7%" in printed
    assert printed.index("elementwise_kernel") < printed.index("index_put_kernel")


def test_calibrated_routing_needs_moe_layers(tmp_path, capsys, tiny_model_dir, alpaca_file):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{name_or_path: {tiny_model_dir}, init: random, init_routing: skewed}}\n"
        f"data: {{dataset_path: {alpaca_file}, max_length: 128, cache_dir: {tmp_path / 'cache'}}}\n"
        f"training: {{output_dir: {tmp_path / 'run'}, max_steps: 1}}\n"
    )
    assert main(["train", str(config)]) == 2
    assert "model.init_routing: skewed needs MoE layers; LlamaForCausalLM has none" in capsys.readouterr().err


def test_jetmoes_attention_output_experts_are_its_attention_output_projection(tmp_path):
    """JetMoE has no o_proj: its attention's output projection is its mixture of attention's output experts
    (output_linear, 3-D), scaled as o_proj is; its MLP's output_linear (a routed expert weight) is not."""
    from tiny_models import FUSED_MOE_ARCHITECTURES, write_tiny_model

    if "jetmoe" not in FUSED_MOE_ARCHITECTURES:
        pytest.skip("this transformers has no JetMoE")
    config = AutoConfig.from_pretrained(write_tiny_model(tmp_path / "jetmoe", "jetmoe"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    blocks = find_moe_blocks(model, decoder_layers(model))
    set_init_routing(model, blocks, "balanced", seed=0)
    scale = 1 / (8 * config.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.endswith("self_attention.experts.output_linear.weight"):
            torch.testing.assert_close(param, before[name] * scale, rtol=0, atol=0)
        elif not name.endswith("mlp.router.layer.weight"):
            assert torch.equal(param, before[name]), name
    rows = blocks[0].router.weight
    torch.testing.assert_close(rows @ rows.T, torch.eye(rows.shape[0]), rtol=0, atol=1e-6)  # orthonormal rows


def test_bench_takes_every_shape_with_routed_experts_for_moe():
    """``--routing`` (and the routing record) apply to every shape whose model has routed experts, found as training
    finds them: DBRX's count is its ffn_config's moe_num_experts, a key the config test missed, so its first H200
    benchmark ran random routers and reported no routing. GLM-4.7's first three layers are dense."""
    from shardtune.bench.command import is_moe
    from shardtune.bench.shapes import shape_config

    assert is_moe(shape_config("dbrx", layers=2)) and is_moe(shape_config("qwen3-30b-a3b", layers=2))
    assert not is_moe(shape_config("mistral-7b", layers=2))
    assert not is_moe(shape_config("glm-4.7", layers=3)) and is_moe(shape_config("glm-4.7", layers=4))


def test_bench_builds_the_shape_on_the_meta_device_once_to_set_its_routing(tmp_path, monkeypatch):
    """The config bench trains on sets the routers of an MoE shape (``--routing``) and leaves a dense shape's
    ``model.init_routing`` at its default, which bench.json's ``routing`` reads back (None for a dense shape): one
    build of the model on the meta device a run, not one for the config and one for the record."""
    from shardtune.bench import command
    from shardtune.bench.shapes import shape_config
    from shardtune.cli import build_parser

    built, is_moe = [], command.is_moe

    def counted(model_config) -> bool:
        built.append(model_config)
        return is_moe(model_config)

    monkeypatch.setattr(command, "is_moe", counted)
    for shape, routing in (("qwen3-moe-tiny", {"init_routing": "balanced"}), ("mistral-7b", {})):
        args = build_parser().parse_args(["bench", "--shape", shape, "--layers", "2", "--routing", "balanced"])
        model_config = shape_config(shape, layers=2)
        tree = command.bench_config(args, tmp_path, tmp_path / "model", tmp_path / "data.jsonl", "text", model_config)
        assert {key: value for key, value in tree["model"].items() if key == "init_routing"} == routing
    assert len(built) == 2

"""MoE models in one process: router statistics against a direct count, the load-balancing loss against
transformers' own, its gradient, and the LoRA target groups with their parameter counts."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import MOE_ARCHITECTURES, write_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.config import LoraConfig
from shardtune.data.collate import collate
from shardtune.distributed.parallelize import decoder_layers
from shardtune.errors import ConfigError
from shardtune.metrics.expert_usage import ExpertUsage
from shardtune.model.lora import apply_lora, count_parameters
from shardtune.model.moe import RoutingRecorder, find_moe_blocks, load_balancing_loss
from shardtune.train.loop import accumulate_gradients
from shardtune.train.routing import RouterTraining


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_tiny_model(root / arch, arch) for arch in MOE_ARCHITECTURES}


def build(directory, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    model.config.use_cache = False
    return model


def padded_batch(seed: int = 1, lengths=(23, 9, 17)):
    """Three examples of different lengths, right-padded: padding must not count."""
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for length in lengths:
        ids = torch.randint(3, 1000, (length,), generator=generator).numpy()
        sequences.append((ids, ids.copy(), None))
    return collate(sequences, pad_token_id=0, packed=False)


def direct_choice(model, arch, layer_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's experts as the architecture picks them, from its router logits alone."""
    if arch == "glm4_moe":  # sigmoid scores + correction bias (zero here), one group
        return layer_logits.float().sigmoid().topk(top_k, dim=-1).indices
    return layer_logits.float().softmax(dim=-1).topk(top_k, dim=-1).indices


@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_expert_counts_and_entropy_equal_a_direct_count(moe_dirs, world, arch):
    model = build(moe_dirs[arch])
    blocks = find_moe_blocks(model, decoder_layers(model))
    expected_layers = [1, 2] if arch == "glm4_moe" else [0, 1]  # GLM's first layer is dense
    assert [block.layer for block in blocks] == expected_layers
    assert all(block.scoring == ("sigmoid" if arch == "glm4_moe" else "softmax") for block in blocks)
    recorder, usage = RoutingRecorder(blocks), ExpertUsage(blocks, torch.device("cpu"))
    # The reference logits: each block's input times its router's weight, taken apart from the recorder's hooks
    # (transformers 5.17's GLM-4.5 returns no router_logits).
    router_logits = []
    for block in blocks:
        block.block.register_forward_pre_hook(
            lambda module, args, router=block.router: router_logits.append(
                args[0].reshape(-1, args[0].shape[-1]).detach() @ router.weight.detach().t()
            )
        )
    batch = padded_batch()
    with recorder.recording(batch.real_tokens):
        model(**batch.model_inputs())
    usage.add(recorder.records, load_balancing_loss(recorder.records))
    record = usage.reduce(world, step=1)

    real = batch.real_tokens.reshape(-1)
    assert record["tokens"] == int(real.sum()) == 23 + 9 + 17
    assert len(router_logits) == len(blocks)
    for layer, logits in zip(record["layers"], router_logits, strict=True):
        block = blocks[record["layers"].index(layer)]
        chosen = direct_choice(model, arch, logits, block.top_k)[real]
        counts = torch.bincount(chosen.reshape(-1), minlength=block.num_experts)
        assert layer["counts"] == counts.tolist()
        assert sum(layer["counts"]) == block.top_k * int(real.sum())
        assert layer["max_mean_ratio"] == pytest.approx(counts.max().item() / counts.float().mean().item())
        if arch == "glm4_moe":
            p = logits[real].float().sigmoid()
            p = p / p.sum(-1, keepdim=True)
        else:
            p = logits[real].float().softmax(-1)
        entropy = -(p * p.log()).sum(-1).mean().item()
        assert layer["entropy"] == pytest.approx(entropy, rel=1e-5)
        assert layer["normalized_entropy"] == pytest.approx(entropy / math.log(block.num_experts), rel=1e-5)
    # Evaluation forwards (outside recording) and the next interval start from zero.
    model(**batch.model_inputs())
    assert usage.reduce(world, step=2)["layers"][0]["counts"] == [0] * blocks[0].num_experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_balance_loss_equals_the_architectures_own(moe_dirs, arch):
    model = build(moe_dirs[arch])
    recorder = RoutingRecorder(find_moe_blocks(model, decoder_layers(model)))
    batch = padded_batch(lengths=(20, 20))  # no padding: transformers' loss then sees the same tokens
    with recorder.recording(batch.real_tokens):
        outputs = model(input_ids=batch.input_ids, output_router_logits=True)
    ours = load_balancing_loss(recorder.records)
    assert outputs.aux_loss is not None
    assert ours.item() == pytest.approx(outputs.aux_loss.item(), rel=1e-5)
    assert ours.item() > 2.0  # top_k when perfectly balanced, more otherwise


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_aux_loss_coefficient_adds_its_gradient(moe_dirs, world, arch):
    """grad(LM + c * aux) = grad(LM) + c * grad(aux), with aux averaged over the step's micro-batches."""
    coef = 0.5
    micro_batches = [padded_batch(seed=1), padded_batch(seed=2, lengths=(11, 30))]

    def step_gradients(c: float, lm: bool = True) -> dict[str, torch.Tensor]:
        model = build(moe_dirs[arch])
        routing = RouterTraining(find_moe_blocks(model, decoder_layers(model)), c, world.device)
        if lm:
            accumulate_gradients(model, micro_batches, world, None, routing)
        else:  # the balancing loss alone, averaged over the micro-batches
            for batch in micro_batches:
                with routing.forward(batch):
                    model(**batch.model_inputs())
                (load_balancing_loss(routing.recorder.records) / len(micro_batches)).backward()
        return grads(model)

    plain, balanced, balance_only = step_gradients(0.0), step_gradients(coef), step_gradients(1.0, lm=False)
    router_weights = [name for name in balance_only if name.endswith(".gate.weight")]
    assert router_weights and all(balance_only[name].abs().sum() > 0 for name in router_weights)
    for name, gradient in balanced.items():
        expected = plain[name] + coef * balance_only.get(name, torch.zeros_like(gradient))
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-7, msg=name)
    assert any(not torch.allclose(balanced[name], plain[name]) for name in router_weights)


def lora_counts(hidden: int, r: int, shapes: list[tuple[int, int]]) -> int:
    return sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)


@pytest.mark.parametrize(
    "groups",
    [["attention"], ["dense_mlp"], ["shared_experts"], ["routed_experts"], ["router"], ["attention", "router"]],
)
def test_lora_target_groups_and_their_trainable_counts(moe_dirs, groups):
    """GLM-4.5 layout (tiny): 3 layers, the first dense; 8 routed experts and one shared expert."""
    config = MOE_ARCHITECTURES["glm4_moe"]
    r, hidden, heads, kv, head_dim = 4, 64, 4, 2, config["head_dim"]
    inter, moe_inter, experts = config["intermediate_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    per_group = {
        "attention": 3
        * lora_counts(
            hidden,
            r,
            [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim), (heads * head_dim, hidden)],
        ),
        "dense_mlp": lora_counts(hidden, r, [(hidden, inter), (hidden, inter), (inter, hidden)]),
        "shared_experts": 2 * lora_counts(hidden, r, [(hidden, moe_inter), (hidden, moe_inter), (moe_inter, hidden)]),
        # PEFT's per-expert update of a fused (experts, out, in) tensor: A is (r * experts, in), B (out, r * experts).
        "routed_experts": 2 * r * experts * ((hidden + 2 * moe_inter) + (moe_inter + hidden)),
        "router": 2 * r * (hidden + experts),
    }
    model = build(moe_dirs["glm4_moe"])
    base_total = count_parameters(model)[1]
    peft_model = apply_lora(model, LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, moe_targets=groups))
    trainable, total = count_parameters(peft_model)
    assert trainable == sum(per_group[group] for group in groups)
    assert total == base_total + trainable
    names = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    where = {
        "attention": ".self_attn.",
        "dense_mlp": "layers.0.mlp.",
        "shared_experts": ".shared_experts.",
        "routed_experts": ".experts.",
        "router": ".mlp.gate.",
    }
    assert all(any(where[group] in name for group in groups) for name in names), names
    assert all(any(where[group] in name for name in names) for group in groups)


def test_lora_defaults_and_bad_target_choices(moe_dirs, tiny_model_dir):
    # MoE models default to the attention projections; dense models to every linear layer.
    peft_model = apply_lora(build(moe_dirs["qwen3_moe"]), LoraConfig(r=4))
    lora_a = [name for name, _ in peft_model.named_parameters() if "lora_A" in name]
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name in lora_a}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="lora.moe_targets: LlamaForCausalLM has no MoE layers"):
        apply_lora(dense, LoraConfig(moe_targets=["attention", "router"]))
    with pytest.raises(ConfigError, match="lora.moe_targets: Qwen3MoeForCausalLM has no shared_experts"):
        apply_lora(build(moe_dirs["qwen3_moe"]), LoraConfig(moe_targets=["shared_experts"], lora_dropout=0))
    # Dropout left unset is 0.05 where every adapter has a layer input, and 0 with adapted expert weights.
    routed = LoraConfig(moe_targets=["attention", "routed_experts"])
    assert (routed.lora_dropout, LoraConfig().lora_dropout) == (0.0, 0.05)
    adapted = apply_lora(build(moe_dirs["qwen3_moe"]), routed)
    lora_a = [name for name, _ in adapted.named_parameters() if "lora_A" in name]
    assert any(".experts." in name for name in lora_a) and any(".q_proj." in name for name in lora_a)
    with pytest.raises(ValueError, match="set either target_modules or moe_targets"):
        LoraConfig(target_modules=["q_proj"], moe_targets=["attention", "router"])
    # A saved config spells out the default groups next to explicit modules: that loads.
    assert LoraConfig(target_modules=["q_proj"], moe_targets=["attention"]).target_modules == ["q_proj"]


def test_checkpointed_layers_count_once_and_give_the_same_gradients(moe_dirs, world):
    """Activation checkpointing recomputes the routers in backward: nothing is counted twice, and the
    balancing loss's gradient flows through the recomputed layers unchanged."""
    from shardtune.distributed.activations import apply_activation_checkpointing

    batches = [padded_batch(seed=3)]
    results = []
    for checkpointing in (False, True):
        model = build(moe_dirs["glm4_moe"])
        routing = RouterTraining(find_moe_blocks(model, decoder_layers(model)), 0.5, world.device)
        if checkpointing:
            assert apply_activation_checkpointing(model, decoder_layers(model)) == 3
        accumulate_gradients(model, batches, world, None, routing)
        results.append((grads(model), routing.interval_record(world, step=1)))
    (plain, plain_usage), (checkpointed, checkpointed_usage) = results
    assert checkpointed_usage == plain_usage
    assert checkpointed_usage["tokens"] == 23 + 9 + 17
    assert plain.keys() == {name.replace("._checkpoint_wrapped_module", "") for name in checkpointed}
    for name, gradient in checkpointed.items():
        torch.testing.assert_close(gradient, plain[name.replace("._checkpoint_wrapped_module", "")], msg=name)


def test_moe_metrics_reach_tensorboard_and_wandb(moe_dirs, tmp_path):
    """Expert usage goes to the JSONL log whole; TensorBoard and W&B (offline) get its numbers."""
    pytest.importorskip("wandb")
    from cli_runs import schema_checked_logs, train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(
        tmp_path, "run", 1, f"model.name_or_path={moe_dirs['mixtral']}", "model.init=random",
        "lora.target_modules=null", "logging.tensorboard=true", "logging.wandb.enabled=true",
        "logging.wandb.mode=offline", steps=2,
    )  # fmt: skip
    assert len(schema_checked_logs(run["out"])["expert_usage"]) == 2
    events = EventAccumulator(str(run["out"] / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/moe_balance_loss", "train/moe_max_mean_ratio", "expert_usage/balance_loss"} <= tags
    wandb_runs = list((run["out"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(wandb_runs) == 1 and b"train/moe_balance_loss" in wandb_runs[0].read_bytes()


class ChoiceFirstRouter(torch.nn.Module):
    """A softmax top-2 router returning (choice, weights, logits), the order of transformers 5.17's Granite-MoE
    router; transformers' other routers (and Granite-MoE's since) return (logits, weights, choice)."""

    top_k = 2

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))

    def forward(self, tokens: torch.Tensor):
        logits = torch.nn.functional.linear(tokens, self.weight)
        top, chosen = logits.topk(self.top_k, dim=-1)
        return chosen, top.softmax(dim=-1), logits


class ChoiceFirstBlock(torch.nn.Module):
    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.router = ChoiceFirstRouter(experts, hidden)
        self.experts = torch.nn.Linear(hidden, hidden)  # the block's output is not what this test looks at

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.router(tokens)
        return self.experts(tokens)


def test_router_hooks_tell_the_logits_and_the_choice_apart_in_any_order():
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.mlp = ChoiceFirstBlock(experts=8, hidden=16)
    recorder = RoutingRecorder(find_moe_blocks(layer, [layer]))
    tokens = torch.randn(10, 16)
    with recorder.recording(None):
        layer.mlp(tokens)
    (record,) = recorder.records
    logits = layer.mlp.router.weight.detach() @ tokens.t()
    chosen = logits.t().topk(2, dim=-1).indices
    assert torch.equal(record.counts, torch.bincount(chosen.reshape(-1), minlength=8).float())
    torch.testing.assert_close(record.probability_sum.detach(), logits.t().softmax(dim=-1).sum(dim=0))
    assert record.tokens == 10


def test_hunyuan_moe_blocks_are_found_through_their_routers_linear_and_fused(caplog):
    """Hunyuan-MoE's router keeps its logits' Linear as ``gate.wg`` and its shared expert is ``shared_mlp``: the
    blocks are found with that Linear as the router, their routing recorded as the gate chooses, its LoRA groups
    told apart, and the blocks fused (tests/train/test_fused_moe.py holds them to transformers')."""
    from tiny_models import COMMON
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shardtune.model.fused_moe import use_fused_experts
    from shardtune.model.lora import moe_lora_targets

    if "hunyuan_v1_moe" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Hunyuan-MoE")
    config = AutoConfig.for_model(
        "hunyuan_v1_moe", **{**COMMON, "num_key_value_heads": 2, "tie_word_embeddings": False, "head_dim": 16,
                             "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert [block.layer for block in blocks] == [0, 1]
    assert all(block.router is layers[block.layer].mlp.gate.wg for block in blocks)
    assert {(block.shared_name, block.num_experts, block.top_k, block.scoring) for block in blocks} == {
        ("shared_mlp", 8, 2, "softmax")
    }
    chosen = []
    for block in blocks:
        block.block.gate.register_forward_hook(lambda module, inputs, output: chosen.append(output[2]))
    recorder = RoutingRecorder(blocks)
    ids = torch.randint(3, 1000, (2, 11))
    with recorder.recording(None):
        model(input_ids=ids)
    for record, picked in zip(recorder.records, chosen, strict=True):
        assert torch.equal(record.counts, torch.bincount(picked.reshape(-1), minlength=8).float())
    modules, parameters, found, _ = moe_lora_targets(layers, blocks, ["router", "shared_experts"])
    assert modules == ["mlp.gate.wg", "mlp.shared_mlp.down_proj", "mlp.shared_mlp.gate_proj", "mlp.shared_mlp.up_proj"]
    assert parameters == [] and found["router"] == 2 and found["shared_experts"] == 6
    with caplog.at_level("INFO", logger="shardtune"):
        use_fused_experts(model, layers, "auto")
    assert "moe experts: fused (shardtune's grouped-GEMM block) on 2 MoE layers" in caplog.text


def test_longcat_flash_blocks_are_found_through_their_routers_classifier_and_its_router_takes_no_lora(caplog):
    """LongCat-Flash's router keeps its logits' Linear as ``router.classifier`` and multiplies by its weight itself:
    the blocks are found with that Linear as the router (8 GEMM experts and 2 identity ones: 10 experts), their
    routing recorded as the router chooses, with its softmax probabilities (transformers 5.17's router returns its
    choice alone: the hooks make the logits from its input), the decoder layers' two MLA attentions and two dense MLPs
    in their LoRA groups, ``router`` refused in one line (no adapter reaches its logits), and the blocks fused
    (tests/train/test_fused_moe.py holds them to transformers')."""
    from tiny_models import tiny_config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shardtune.model.fused_moe import use_fused_experts
    from shardtune.model.lora import moe_lora_targets

    if "longcat_flash" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no LongCat-Flash")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("longcat_flash"), dtype=torch.float32)
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert [block.layer for block in blocks] == [0, 1]
    assert all(block.router is layers[block.layer].mlp.router.classifier for block in blocks)
    assert {(block.shared_name, block.num_experts, block.top_k, block.scoring) for block in blocks} == {
        (None, 10, 2, "softmax")
    }
    seen = []
    for block in blocks:
        torch.nn.init.normal_(block.router.weight, std=0.5)
        block.block.router.register_forward_hook(lambda module, inputs, output: seen.append((inputs[0], output[-1])))
    recorder = RoutingRecorder(blocks)
    ids = torch.randint(3, 1000, (2, 11))
    with recorder.recording(None):
        model(input_ids=ids)
    for record, block, (hidden, picked) in zip(recorder.records, blocks, seen, strict=True):
        assert torch.equal(record.counts, torch.bincount(picked.reshape(-1), minlength=10).float())
        probabilities = (hidden.reshape(-1, hidden.shape[-1]) @ block.router.weight.t()).softmax(dim=-1)
        torch.testing.assert_close(record.probability_sum.detach(), probabilities.detach().sum(dim=0))
    modules, parameters, found, unreachable = moe_lora_targets(
        layers, blocks, ["attention", "dense_mlp", "routed_experts"]
    )
    attention = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    assert modules == sorted(
        [f"self_attn.{i}.{name}" for i in (0, 1) for name in attention]
        + [f"mlps.{i}.{name}" for i in (0, 1) for name in ("gate_proj", "up_proj", "down_proj")]
    )
    assert parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] and found["router"] == 0
    assert unreachable == {"router": "LongcatFlashTopkRouter"}
    with pytest.raises(ConfigError) as error:
        apply_lora(model, LoraConfig(moe_targets=["attention", "router"]))
    assert str(error.value) == (
        "lora.moe_targets: router: LongcatFlashTopkRouter multiplies by its Linear's weight itself, which no LoRA "
        "adapter reaches (transformers and PEFT would leave it out); drop router"
    )
    with caplog.at_level("INFO", logger="shardtune"):
        use_fused_experts(model, layers, "auto")
    assert "moe experts: fused (shardtune's grouped-GEMM block) on 2 MoE layers" in caplog.text


def test_gemma4_blocks_are_their_decoder_layers_and_fuse_in_place():
    """Gemma 4 puts its router and routed experts in the decoder layer itself, beside the dense MLP: the blocks are
    found as the layers (path ""), with the router's Linear ``proj`` as the router and the config's top_k_experts; the
    layer's Linear layers keep their LoRA groups (the dense MLP in dense_mlp, the router's in router) and the routed
    experts' parameters are named from the layer. Fused, the layer stays transformers' (its forward too), its router
    child becomes the fused router, its experts compute ``routed_experts``, and no parameter changes its name."""
    from tiny_models import tiny_config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shardtune.model.fused_moe import FusedRouter, routed_experts, use_fused_experts
    from shardtune.model.lora import moe_lora_targets

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Gemma 4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma4_text"), dtype=torch.float32)
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert [(block.layer, block.path, block.block) for block in blocks] == [(0, "", layers[0]), (1, "", layers[1])]
    assert all(block.router is layers[block.layer].router.proj for block in blocks)
    assert {(block.router_name, block.num_experts, block.top_k, block.scoring) for block in blocks} == {
        ("router", 8, 2, "softmax")
    }
    modules, parameters, found, _ = moe_lora_targets(layers, blocks, ["dense_mlp", "routed_experts", "router"])
    assert modules == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "router.proj"]
    assert parameters == ["experts.down_proj", "experts.gate_up_proj"]
    assert (found["dense_mlp"], found["router"], found["routed_experts"]) == (6, 2, 4)
    names = [name for name, _ in model.named_parameters()]
    use_fused_experts(model, layers, "fused")
    assert [name for name, _ in model.named_parameters()] == names
    assert all(type(layer).__name__ == "Gemma4TextDecoderLayer" for layer in decoder_layers(model))
    fused = find_moe_blocks(model, decoder_layers(model))
    assert all(isinstance(block.router_child, FusedRouter) and block.reporter is block.router_child for block in fused)
    assert all(block.experts.forward.__func__ is routed_experts for block in fused)
    assert all(block.router_child.experts is block.block.experts for block in fused)


def test_phimoe_blocks_take_two_experts_and_their_router_linear_is_the_router_group():
    """Phi-3.5-MoE's router is a Linear with a forward of its own (SparseMixer): the blocks are found with it as the
    router, two experts a token whatever num_experts_per_tok says (its sparsemixer always picks two), softmax
    statistics; LoRA's router group adapts its weight as a parameter (PEFT's LoRA layer could not add to what its
    forward returns), in no other group, and the blocks fuse (tests/train/test_fused_moe.py holds them to
    transformers' in training and evaluation)."""
    from tiny_models import tiny_config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shardtune.model.fused_moe import FusedMoeBlock, use_fused_experts
    from shardtune.model.lora import moe_lora_targets

    if "phimoe" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Phi-3.5-MoE")
    config = tiny_config("phimoe")
    config.num_experts_per_tok = 3
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert all(block.router is layers[block.layer].mlp.router for block in blocks)
    assert {(block.router_name, block.num_experts, block.top_k, block.scoring) for block in blocks} == {
        ("router", 8, 2, "softmax")
    }
    assert blocks[0].routing.sparsemixer == config.router_jitter_noise
    _, chosen = model.model.layers[0].mlp.router(torch.randn(5, config.hidden_size))[1:]
    assert chosen.shape == (5, 2)
    modules, parameters, found, _ = moe_lora_targets(layers, blocks, ["router"])
    assert modules == [] and parameters == ["mlp.router.weight"] and found["router"] == 2
    modules, _, _, _ = moe_lora_targets(layers, blocks, ["attention", "dense_mlp", "shared_experts"])
    assert modules == sorted(f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    use_fused_experts(model, layers, "fused")
    assert all(isinstance(block.block, FusedMoeBlock) for block in find_moe_blocks(model, layers))

"""shardtune's fused MoE block (``model.experts_implementation: fused``) computes what transformers' eager
experts compute, for every supported architecture (Qwen3-MoE, Mixtral, Glm4Moe, DeepSeek-V3), in fp32:
forward, loss and every gradient, with padded and packed batches, with experts that get no token or every
token, with LoRA on the routed experts (PEFT's format, loadable and mergeable by PEFT), compiled and
checkpointed, and in training runs (FSDP with two workers: tests/distributed/test_moe_parallel.py, whose
runs take the fused default). The training comparison marked slow runs with ``-m slow``."""

from __future__ import annotations

import copy
import re
import types
from unittest import mock

import pytest
import torch
from cli_runs import jsonl, train
from tiny_models import FUSED_MOE_ARCHITECTURES, kernel_sized_qwen3_moe, write_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.config import LoraConfig, ModelConfig
from shardtune.data.collate import collate
from shardtune.distributed.activations import apply_activation_checkpointing
from shardtune.distributed.compile import LayerCompiler
from shardtune.distributed.parallelize import decoder_layers
from shardtune.errors import ConfigError
from shardtune.model import grouped_gemm
from shardtune.model.fused_moe import (
    Fp32Linear,
    FusedMoeBlock,
    WeightedSiluMul,
    expert_order,
    identity_experts,
    route,
    use_fused_experts,
)
from shardtune.model.grouped_gemm import gathered_grouped_mm, quack_unavailable, resolve_grouped_gemm
from shardtune.model.load import check_experts_implementation
from shardtune.model.lora import apply_lora, share_expert_adapters
from shardtune.model.moe import RoutingRecorder, correction_bias, find_moe_blocks
from shardtune.plan.memory import Checkpointing

ARCHS = list(FUSED_MOE_ARCHITECTURES)
# The architectures with shared experts: added to the routed ones, averaged with them, or scaled by a gate of their own
# first.
SHARED = {"glm4_moe": "added", "deepseek_v3": "added", "glm4_moe_lite": "added", "glm_moe_dsa": "added",
          "dots1": "added", "deepseek_v2": "added", "ernie4_5_moe": "added", "exaone_moe": "added",
          "solar_open": "added", "deepseek_v32": "added", "kimi_linear": "added", "dots3_note_text": "added",
          "llama4_text": "added", "hunyuan_v1_moe": "added", "bailing_hybrid": "added", "hy_v3": "added",
          "afmoe": "added", "hy_v4": "added", "axk1": "added", "axk2": "added", "flint": "added", "kolibri1": "added",
          "laguna": "added", "lara_mini": "added", "nemotron_h": "added", "deepseek_v4": "added",
          "qwen2_moe": "gated", "qwen3_next": "gated", "qwen3_5_moe_text": "gated",
          "qwen4_exp_text": "gated", "cohere2_moe": "averaged"}  # fmt: skip
# Where an architecture's routed expert weights are under its block, where not in its experts module: JetMoE's pair of
# modules (moe.ExpertPair; its mixture of attention has an experts module, which is not routed MLP experts).
ROUTED_EXPERTS = {"jetmoe": "mlp.input_linear"}
# Routers whose logits no LoRA adapter reaches (LongCat-Flash's multiplies by its classifier's weight itself:
# lora.unadaptable_linears): lora.moe_targets refuses router for them.
ROUTER_OUT_OF_LORA_REACH = {"longcat_flash"}
# Routed experts PEFT's parameter adapters cannot adapt (DBRX's 2-D slabs of every expert, which its experts slice
# themselves: fused_moe.SLAB_EXPERTS): lora.moe_targets refuses routed_experts for them; their tests train them fully.
EXPERTS_OUT_OF_LORA_REACH = {"dbrx"}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {arch: write_tiny_model(root / arch, arch) for arch in ARCHS}


def build(directory, lora_targets: list[str] | None = None, shared: bool = False) -> torch.nn.Module:
    """transformers' eager experts with routers that route unevenly (random weights, random GLM-style
    correction biases; Gemma 4's input and per-expert scales drawn from 0.5 to 1.5), hash layers' tables of distinct
    random experts for each token id (DeepSeek-V4's; transformers starts them at 0, every choice expert 0), and random
    LoRA weights (PEFT starts B at zero: no gradient would reach A)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(directory), dtype=torch.float32, experts_implementation="eager"
    )
    model.config.use_cache = False
    for block in find_moe_blocks(model, decoder_layers(model)):
        torch.nn.init.normal_(block.router.weight, std=0.5)
        if (bias := correction_bias(block.router, block.block)) is not None:
            bias.normal_(std=0.1)
        for name in (block.routing.input_scale, block.routing.expert_scale):
            if name is not None:
                torch.nn.init.uniform_(getattr(block.router_child, name), 0.5, 1.5)
        if (table_name := block.routing.choice_table) is not None:
            table = getattr(block.router, table_name)
            table.copy_(torch.rand(table.shape[0], block.num_experts).argsort(dim=-1)[:, : table.shape[1]])
        for name, param in block.block.named_parameters():
            if name.endswith("bias"):  # GPT-OSS's router and experts
                torch.nn.init.normal_(param, std=0.1)
    if lora_targets:
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0, moe_targets=lora_targets, shared_expert_adapter=shared)
        model = apply_lora(model, config)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.3)
        if shared:
            share_expert_adapters(model)  # the random blocks made equal again
    return model.train()


def fused_copy(model: torch.nn.Module) -> torch.nn.Module:
    fused = copy.deepcopy(model)
    use_fused_experts(fused, decoder_layers(fused), "fused")
    # A block that is its decoder layer (Gemma 4's) keeps it: its router child is the fused one (FusedRouter).
    assert all(isinstance(block.reporter, FusedMoeBlock) for block in find_moe_blocks(fused, decoder_layers(fused)))
    return fused


def assert_same(mine: torch.Tensor, reference: torch.Tensor, name: str = "", tolerance: float = 1e-5) -> None:
    """Equal to ``tolerance`` of the reference's largest magnitude (fp32; only summation orders differ)."""
    scale = reference.abs().max().item()
    assert (mine - reference).abs().max().item() <= tolerance * scale + 1e-9, name


# Whole models whose gradients amplify summation-order differences: Qwen3-Next's, Qwen3.5's and LaraMini's linear
# attention (Gated DeltaNet, a recurrence over the sequence). transformers' own grouped_mm experts land up to 2.8e-5
# of a tensor's largest magnitude from its eager ones there (fused: up to 9e-5; LaraMini's packed batch: 1.8e-5 and
# 3.8e-5, both in the first layer's A_log), against 1e-6 on Qwen2-MoE, whose MoE block is the same; the MoE block
# alone is held to 1e-5 in test_an_expert_with_every_token_and_one_with_none.
MODEL_TOLERANCE = {"qwen3_next": 2e-4, "qwen3_5_moe_text": 2e-4, "lara_mini": 2e-4}
# Jamba's Mamba layers and MiniMax-Text-01's lightning attention, with LoRA (the adapters drawn large): one fp32
# rounding of each MoE block's output (relative 6e-8) moves an eager gradient up to 1.1e-5 of its largest magnitude,
# against 3.6e-6 on Mixtral and Qwen3-MoE; the fused block's unmerged low-rank products (see the LoRA test) then land
# up to 4e-5 from PEFT's (Jamba's input gradient; MiniMax: 3.7e-5), the eager experts themselves up to 6.2e-5 from an
# fp64 run (MiniMax; the fused block 4.9e-5). Full fine-tuning stays within 1.1e-6 of fp64 on both.
MODEL_TOLERANCE |= {"jamba": 1e-4, "minimax": 1e-4}
# DeepSeek-V4's hyper-connections: the gradients of the head that mixes the streams into one (hc_head) and of the
# first layer's attention mixing (attn_hc.base) are ill-conditioned in fp32, transformers' eager experts landing up to
# 1.2e-4 of the largest magnitude from an fp64 run (hc_head.hc_scale, packed batch; the fused block 1.9e-4) and its
# grouped_mm experts up to 7.5e-5 from its eager ones (the fused block: 7e-5); every other tensor within 1e-5.
MODEL_TOLERANCE |= {"deepseek_v4": 2e-4}


def routes_by_token_id(model: torch.nn.Module) -> bool:
    """Whether a MoE block of ``model`` chooses its experts by the tokens' ids (DeepSeek-V4's hash layers)."""
    return any(block.routing.choice_table is not None for block in find_moe_blocks(model, decoder_layers(model)))


def run(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, seed: int = 7) -> dict[str, torch.Tensor]:
    """Logits, loss and the gradient of every trainable parameter and of the input embeddings, from one ``seed`` (the
    models train: Phi-3.5-MoE's router draws its experts and its block its input noise, and a fused run draws what
    transformers' does)."""
    torch.manual_seed(seed)
    embedding_module = model.get_input_embeddings()
    embeddings = embedding_module(inputs["input_ids"]).detach().requires_grad_()
    if routes_by_token_id(model):
        # transformers' DeepSeek-V4 hands its layers the input ids only when it is called with them (given
        # inputs_embeds, it has none, and its hash layers fail): the embedding's output is the leaf instead.
        hook = embedding_module.register_forward_hook(lambda module, args, output: embeddings)
        try:
            output = model(**inputs, labels=labels)
        finally:
            hook.remove()
    else:
        other = {key: value for key, value in inputs.items() if key != "input_ids"}
        output = model(inputs_embeds=embeddings, labels=labels, **other)
    output.loss.backward()
    results = {"logits": output.logits.detach(), "loss": output.loss.detach(), "input": embeddings.grad}
    embedding = model.get_input_embeddings().weight  # bypassed: the input gradient is taken instead
    for name, param in model.named_parameters():
        if param.requires_grad and param is not embedding:
            if ".indexer." in name and param.grad is None:
                continue  # GLM-5's sparse-attention indexer: its top-k choice passes the LM loss no gradient
            assert param.grad is not None, name
            results[name] = param.grad
    return results


def padded_batch() -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    sequences = [(ids, ids.copy(), None) for ids in (torch.randint(3, 1000, (n,), generator=generator).numpy()
                                                     for n in (23, 9, 17))]  # fmt: skip
    inputs = collate(sequences, pad_token_id=0, packed=False).model_inputs()
    return inputs, inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def packed_batch() -> tuple[dict, torch.Tensor]:
    """Two examples in one row; the positions restart where the second begins."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 1000, (1, 30), generator=generator)
    positions = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
    labels = ids.clone()
    labels[0, 12] = -100
    return {"input_ids": ids, "position_ids": positions}, labels


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", ["padded", "packed"])
def test_full_finetuning_forward_loss_and_every_gradient_equal_eager(moe_dirs, arch, batch):
    reference = build(moe_dirs[arch])
    fused = fused_copy(reference)
    inputs, labels = padded_batch() if batch == "padded" else packed_batch()
    expected, got = run(reference, inputs, labels), run(fused, inputs, labels)
    assert expected.keys() == got.keys()
    # The last four: the Linear of Hunyuan-MoE's, LongCat-Flash's, Gemma 4's, and JetMoE's and DBRX's routers.
    routers = (".gate.weight", ".router.weight", ".gate.wg.weight", ".router.classifier.weight", ".router.proj.weight",
               ".router.layer.weight")  # fmt: skip
    assert any(f".{ROUTED_EXPERTS.get(arch, 'experts')}." in name for name in got)
    assert any(name.endswith(routers) for name in got)
    # Hunyuan-MoE's shared_mlp is its block's; Granite-MoE-shared's, the decoder layer's, is outside the block.
    assert any(".shared_expert" in name or ".mlp.shared_mlp." in name for name in got) == (arch in SHARED)
    assert any(".shared_expert_gate." in name for name in got) == (SHARED.get(arch) == "gated")
    for name in expected:
        assert_same(got[name], expected[name], name, MODEL_TOLERANCE.get(arch, 1e-5))


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_routed_experts_router_and_shared_experts_equals_peft(moe_dirs, arch):
    """Held to 3e-5 of each tensor's largest magnitude, not 1e-5: PEFT forms W + s·BA and multiplies once, the fused
    block multiplies by W and by the low-rank factors apart (it never forms W + ΔW), a different rounding that adapters
    drawn this large (std 0.3) make as large as W's own. With LoRA on attention alone the two land 5e-7 apart; with the
    routed experts' and the router's too, up to 8e-6 on this CPU and 1.4e-5 on an AVX-512 one (OLMoE)."""
    targets = ["attention"] + (["routed_experts"] if arch not in EXPERTS_OUT_OF_LORA_REACH else [])
    targets += ["router"] if arch not in ROUTER_OUT_OF_LORA_REACH else []
    targets += ["shared_experts"] if arch in SHARED else []
    reference = build(moe_dirs[arch], targets)
    fused = fused_copy(reference)
    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(fused, inputs, labels)
    assert expected.keys() == got.keys()
    if arch in ROUTED_EXPERTS:  # one weight a module: no nested wrappers
        assert any(f"{ROUTED_EXPERTS[arch]}.lora_A" in name for name in got)
    elif arch in EXPERTS_OUT_OF_LORA_REACH:  # the router's adapter, and the frozen experts' down projection's shortcut
        assert any(".router." in name and "lora_A" in name for name in got)
    else:
        assert any("experts.lora_A" in name for name in got)
        assert any("experts.base_layer.lora_B" in name for name in got)
    for name in expected:
        assert_same(got[name], expected[name], name, max(MODEL_TOLERANCE.get(arch, 0.0), 3e-5))


def sparse_block(model: torch.nn.Module):
    return find_moe_blocks(model, decoder_layers(model))[0]


def block_output(block, x: torch.Tensor, **ids):
    """The MoE block's forward on (batch, seq, hidden) ``x``, from one seed (Phi-3.5-MoE's block draws input noise and
    experts; it multiplies its input in place: it takes a copy). A block that is its decoder layer (Gemma 4's) runs as
    its layer, the attention's output zero (its residual is then ``x``, which the router and experts take)."""
    torch.manual_seed(7)
    if block.path:
        return block.block(x.clone(), **ids)
    zero = types.MethodType(lambda attention, hidden_states, **_: (torch.zeros_like(hidden_states), None), block.block)
    with mock.patch.object(block.block.self_attn, "forward", zero):
        return block.block(x, position_embeddings=None, attention_mask=None)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_expert_with_every_token_and_one_with_none(moe_dirs, arch):
    """Positive inputs and a router row of positive weights send every token to expert 0; a row of negative
    weights leaves expert 1 without a token (sigmoid routers: their correction biases, which decide the choice
    and the expert group, do the same; a hash layer, DeepSeek-V4's first: its table). Rows of +-1, not larger: every
    other softmax score must stay above fp32's smallest, or DeepSeek-V2's choice among the zeros of its best group
    would be a tie. With identity experts (LongCat-Flash's), the last one's row equal to expert 0's makes it every
    token's other choice and leaves the others none: the GEMMs' rows end before the pairs do."""
    reference = build(moe_dirs[arch], None if arch in EXPERTS_OUT_OF_LORA_REACH else ["routed_experts"])
    router = sparse_block(reference).router
    ids = {}  # a hash layer's block takes the tokens' ids
    with torch.no_grad():
        router.weight[0] = 1.0
        router.weight[1] = -1.0
        if (bias := correction_bias(router, sparse_block(reference).block)) is not None:
            bias[:2] = torch.tensor([10.0, -10.0])
        if identity_experts(sparse_block(reference).experts):
            router.weight[-1] = router.weight[0]
        if (table_name := sparse_block(reference).routing.choice_table) is not None:
            table = getattr(router, table_name)
            others = torch.rand(table.shape[0], router.weight.shape[0] - 2).argsort(dim=-1)[:, : table.shape[1] - 1]
            table.copy_(torch.cat([torch.zeros_like(table[:, :1]), others + 2], dim=-1))
            ids["input_ids"] = torch.randint(table.shape[0], (3, 7), generator=torch.Generator().manual_seed(4))
    fused = fused_copy(reference)
    hidden = router.weight.shape[1]
    tokens = torch.rand(3, 7, hidden, generator=torch.Generator().manual_seed(3)) + 0.1
    grads = []
    for model in (reference, fused):
        block = sparse_block(model)
        x = tokens.clone().requires_grad_()
        out = block_output(block, x, **ids)
        if isinstance(out, tuple):  # (output, routing weights) from GPT-OSS's block, (output, logits) from Llama 4's
            out, routing = out
            assert routing.shape == (21, block.num_experts if arch == "llama4_text" else block.top_k)
        out = out.reshape(x.shape)  # Llama 4's block returns the tokens flattened, its decoder layer reshapes them
        (out * torch.linspace(-1, 1, hidden)).sum().backward()
        grads.append({"output": out.detach(), "input": x.grad} | {
            name: param.grad for name, param in block.block.named_parameters() if param.grad is not None
        })  # fmt: skip
    block = sparse_block(fused)
    _, _, chosen = route(block.router_child, tokens.reshape(-1, hidden), block.routing, block.block, **ids)
    counts = torch.bincount(chosen.reshape(-1), minlength=block.num_experts)
    assert counts[0] == 21 and counts[1] == 0
    if identities := block.block.experts.identity_experts:
        assert counts[-1] == 21 and counts[-identities:-1].sum() == 0
    expected, got = grads
    assert expected.keys() == got.keys() and len(got) > 2
    for name in expected:
        assert_same(got[name], expected[name], name)


@pytest.mark.skipif("cohere2_moe" not in ARCHS, reason="this transformers has no Cohere2-MoE")
@pytest.mark.parametrize("selection", ["softmax", "sigmoid"])
def test_cohere2_moe_block_routes_by_either_selection_function(moe_dirs, tmp_path, selection):
    """Cohere2-MoE's router weighs the top-k logits by their softmax or their sigmoids (expert_selection_fn; the tiny
    model's: sigmoid), here without norm_topk_prob, which only the sigmoids take: the block's output and gradients."""
    config = AutoConfig.from_pretrained(moe_dirs["cohere2_moe"])
    config.expert_selection_fn, config.norm_topk_prob = selection, False
    config.save_pretrained(tmp_path)
    reference = build(tmp_path)
    tokens = torch.randn(3, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (reference, fused_copy(reference)):
        block = sparse_block(model).block
        x = tokens.clone().requires_grad_()
        out = block(x)
        (out * torch.linspace(-1, 1, config.hidden_size)).sum().backward()
        grads.append({"output": out.detach(), "input": x.grad} | {
            name: param.grad for name, param in block.named_parameters() if param.grad is not None
        })  # fmt: skip
    expected, got = grads
    assert expected.keys() == got.keys() and len(got) > 2
    for name in expected:
        assert_same(got[name], expected[name], name)


@pytest.mark.skipif("phimoe" not in ARCHS, reason="this transformers has no Phi-3.5-MoE")
def test_phimoe_router_draws_weighs_and_backpropagates_as_transformers(moe_dirs):
    """Phi-3.5-MoE's router (SparseMixer), given the same seed: in training the fused rule draws the experts
    transformers' router draws (for many tokens not the best two: the draws decide), with its weights (some scaled by
    0.3333, Heun's midpoint rule) and the router weight's gradient of its custom backward (the unscaled weights'); in
    evaluation the best two. The router's own input noise is off here: the block applies it (the model tests)."""
    reference = build(moe_dirs["phimoe"])
    block = sparse_block(reference)
    router = block.router_child
    router.input_jitter_noise = 0.0
    tokens = torch.randn(64, router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    probe = torch.randn(64, 2, generator=torch.Generator().manual_seed(4))
    results = {}
    for training in (True, False):
        router.train(training)
        for name, compute in (
            ("transformers", lambda: router(tokens)[1:]),
            ("fused", lambda: route(router, tokens, block.routing, block.block, training=training)[1:]),  # noqa: B023
        ):
            torch.manual_seed(11)
            weights, chosen = compute()
            router.weight.grad = None
            (weights * probe).sum().backward()
            results[name, training] = (weights.detach(), chosen, router.weight.grad)
    for training in (True, False):
        (weights, chosen, grad), (expected_weights, expected_chosen, expected_grad) = (
            results["fused", training], results["transformers", training]
        )  # fmt: skip
        assert torch.equal(chosen, expected_chosen)
        assert_same(weights, expected_weights, "weights")
        assert_same(grad, expected_grad, "router gradient")
    drawn, best = results["fused", True][1], results["fused", False][1]
    assert (drawn != best).any(dim=-1).float().mean() > 0.2
    assert (best[:, 0] == (tokens @ router.weight.t()).argmax(dim=-1)).all()


@pytest.mark.skipif("phimoe" not in ARCHS, reason="this transformers has no Phi-3.5-MoE")
def test_phimoe_trains_as_transformers_from_one_seed_and_evaluates_as_it(moe_dirs):
    """Phi-3.5-MoE in training draws input noise twice (its block's, then its router's, which the experts take too) and
    its experts: from one seed, the fused model's loss and every gradient are transformers' eager experts' (as the
    parametrized tests hold them, with LoRA on every group); from another seed, they differ (the draws matter). In
    evaluation, nothing is drawn."""
    reference = build(moe_dirs["phimoe"], ["attention", "routed_experts", "router"])
    assert reference.config.input_jitter_noise > 0 and reference.config.router_jitter_noise > 0
    fused = fused_copy(reference)
    assert any("router.lora_A" in name for name, _ in fused.named_parameters())
    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(fused, inputs, labels)
    for name in expected:
        assert_same(got[name], expected[name], name, 3e-5)
    reference.zero_grad()
    other = run(reference, inputs, labels, seed=8)
    assert (other["loss"] - expected["loss"]).abs() > 1e-4
    reference.zero_grad()
    fused.zero_grad()
    expected, got = run(reference.eval(), inputs, labels), run(fused.eval(), inputs, labels)
    for name in expected:
        assert_same(got[name], expected[name], name, 3e-5)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


def record_and_balance(model: torch.nn.Module, inputs: dict, labels: torch.Tensor | None, weight: float):
    """One recorded training forward and its backward, the LM loss (when ``labels``) plus ``weight`` x the
    load-balancing loss as training adds them; (records, LM loss, balance loss)."""
    recorder = RoutingRecorder(find_moe_blocks(model, decoder_layers(model)), trains_balance=True)
    torch.manual_seed(7)  # a router that draws its experts (Phi-3.5-MoE's) draws the same in every run
    with recorder.recording(inputs.get("attention_mask")):
        output = model(**inputs, labels=labels)
    balance, term = recorder.balance_objective(weight)
    lm = output.loss if labels is not None else output.logits.sum() * 0  # 0: the balance gradient alone
    (lm + term).backward()
    return recorder.records, lm.detach(), balance.detach()


def three_recorded_steps(model: torch.nn.Module) -> list[float]:
    """Three AdamW steps on the padded batch, the balance loss trained, each forward recording its routing
    once per MoE block; the LM losses."""
    inputs, labels = padded_batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(3):
        records, loss, _ = record_and_balance(model, inputs, labels, weight=0.01)
        assert len(records) == len(find_moe_blocks(model, decoder_layers(model)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())
    return losses


def assert_same_records(mine: list, theirs: list) -> None:
    assert len(mine) == len(theirs) > 0
    for record, reference in zip(mine, theirs, strict=True):
        assert record.block.layer == reference.block.layer
        assert torch.equal(record.counts, reference.counts) and record.tokens == reference.tokens
        for name in ("probability_sum", "entropy_sum"):
            assert_same(getattr(record, name).detach(), getattr(reference, name).detach(), name)


# Each architecture's router scores, which the routing statistics take: a correction bias sits on the router
# (DeepSeek-V3), its moe_statics (ERNIE 4.5) or its block (MiniMax-M2, LFM2-MoE, AFMoE), whatever the scores;
# Cohere2-MoE's sigmoid router has none. Hunyuan-MoE's and AFMoE's routers hold the Linear of their logits: the hooks
# take the choice from the router itself. Laguna's statistics take its capped logits, as its router returns them;
# Kolibri-1's bias is added to the logits. Jamba's router in transformers 5.17 is a bare Linear, returning its logits
# alone; Llama 4's returns its scores before its logits. DeepSeek-V4's scores are the square roots of the logits'
# softplus, and its first layer's router returns the experts of its table. Gemma 4's router returns its probabilities
# where others return logits, and normalizes and scales its input first. JetMoE's returns its logits last, after the
# pairs' expert order (no choice: the hooks take the logits' top-k). Phi-3.5-MoE's statistics take the softmax of
# its logits, the experts those its router drew (seeded: the fused block draws the same).
SCORING = {"qwen3_moe": "softmax", "deepseek_v3": "sigmoid", "minimax_m2": "sigmoid", "ernie4_5_moe": "softmax",
           "lfm2_moe": "sigmoid", "granitemoe": "softmax", "gpt_oss": "softmax", "hunyuan_v1_moe": "softmax",
           "afmoe": "sigmoid", "laguna": "sigmoid", "kolibri1": "sigmoid", "flint": "sigmoid",
           "cohere2_moe": "sigmoid", "jamba": "softmax", "llama4_text": "sigmoid", "nemotron_h": "sigmoid",
           "deepseek_v4": "sqrtsoftplus", "longcat_flash": "softmax", "gemma4_text": "softmax",
           "jetmoe": "softmax", "dbrx": "softmax", "phimoe": "softmax"}  # fmt: skip


@pytest.mark.parametrize("arch", [arch for arch in SCORING if arch in ARCHS])
def test_routing_records_and_balance_gradient_equal_the_router_hooks(moe_dirs, arch):
    """The fused block reports what hooks on transformers' routers record, and gives the routers (and
    every weight below them) the load-balancing loss's gradient in its own backward. The statistics take
    each router's own scores (``SCORING``)."""
    reference = build(moe_dirs[arch])
    assert sparse_block(reference).scoring == SCORING[arch]
    fused = fused_copy(reference)
    inputs, _ = padded_batch()
    results = []
    for model in (reference, fused):
        records, _, balance = record_and_balance(model, inputs, None, weight=0.5)
        model(**inputs)  # outside recording: no records
        assert sum(record.tokens for record in records) == len(records) * int(inputs["attention_mask"].sum())
        results.append((records, balance, grads_of(model)))
    (hooked, hooked_loss, hooked_grads), (own, own_loss, own_grads) = results
    assert len(own) == len(find_moe_blocks(fused, decoder_layers(fused)))
    if identities := sparse_block(fused).block.experts.identity_experts:  # LongCat-Flash's take tokens
        assert all(record.counts[-identities:].sum() > 0 for record in own)
    assert_same_records(own, hooked)
    assert_same(own_loss, hooked_loss)
    assert any((".gate." in name or ".router." in name) and grad.abs().sum() > 0 for name, grad in own_grads.items())
    assert own_grads.keys() == hooked_grads.keys()
    for name in own_grads:
        assert_same(own_grads[name], hooked_grads[name], name)


@pytest.mark.parametrize("groups", [2, None], ids=["grouped", "light"])
def test_axk2_chooses_outside_its_best_groups_where_their_biased_scores_are_below_0(moe_dirs, groups):
    """A.X-K2's router leaves the experts outside the chosen groups a score of 0 for the choice, where DeepSeek-V3's
    leaves -inf: correction biases that put all but one expert of the best group below 0 make each token's second
    choice one of the other group's, as the fused block's route. A.X-K2-Light routes without groups (n_group None)."""
    if "axk2" not in ARCHS:
        pytest.skip("this transformers has no A.X-K2")
    if groups is None:
        config = AutoConfig.from_pretrained(moe_dirs["axk2"], n_group=None, topk_group=None)
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        reference = build(moe_dirs["axk2"])
    block = sparse_block(reference)
    with torch.no_grad():
        correction_bias(block.router, block.block).copy_(torch.tensor([10.0, -10, -10, -10, -5, -5, -5, -5]))
    tokens = torch.randn(21, block.router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    _, weights, chosen = block.router(tokens)
    fused = sparse_block(fused_copy(reference))
    _, fused_weights, fused_chosen = route(fused.router, tokens, fused.block.routing, fused.block)
    assert fused.block.routing.groups == (groups or 1)
    assert (chosen >= 4).any(dim=-1).all()  # the other group's, with groups or without
    assert torch.equal(fused_chosen.sort(dim=-1).values, chosen.sort(dim=-1).values)
    order, fused_order = chosen.argsort(dim=-1), fused_chosen.argsort(dim=-1)
    assert_same(fused_weights.gather(1, fused_order), weights.gather(1, order))


def test_fixed_addresses_give_each_forward_its_own_mask_and_balance_gradient(moe_dirs):
    """What CUDA graphs need of the recorder (``fix_addresses``, for ``shardtune.distributed.layer_graphs``): the
    real-token mask and the balance gradient at one address each, rewritten by every recording, giving the records,
    balance loss and gradients of a recorder without them; a forward being captured reports to the capture, not to
    the records, and a paused recorder records nothing."""
    model = fused_copy(build(moe_dirs["qwen3_moe"]))
    inputs, labels = padded_batch()
    mask = inputs["attention_mask"]
    reference, reference_loss, reference_balance = record_and_balance(model, inputs, labels, weight=0.5)
    reference_grads = grads_of(model)
    model.zero_grad()

    recorder = RoutingRecorder(find_moe_blocks(model, decoder_layers(model)), trains_balance=True)
    tokens = torch.zeros(mask.numel())  # a (tokens,) fp32 tensor, as the routing weights are
    with recorder.recording(None):  # a forward without padding fixes the addresses
        recorder.fix_addresses(mask.numel())
        real = recorder.real_tokens(tokens)
        assert real.sum() == mask.numel()
    gradients = []
    for _ in range(2):
        with recorder.recording(mask):
            output = model(**inputs, labels=labels)
        fixed = recorder.real_tokens(tokens)
        assert fixed.data_ptr() == real.data_ptr() and torch.equal(fixed, mask.reshape(-1).float())
        balance, term = recorder.balance_objective(0.5)
        gradients.append(recorder.balance_gradient(tokens)[1])
        (output.loss + term).backward()
        assert_same_records(recorder.records, reference)
        assert_same(balance.detach(), reference_balance)
        assert_same(output.loss.detach(), reference_loss)
        grads = grads_of(model)
        for name in reference_grads:
            assert_same(grads[name], reference_grads[name], name)
        model.zero_grad()
    assert gradients[0].data_ptr() == gradients[1].data_ptr()

    with recorder.recording(mask):
        with recorder.capturing() as captured:
            model(**inputs)
        assert len(captured) == 2 and recorder.records == []
        with recorder.paused():
            model(**inputs)
        assert recorder.records == []
        model(**inputs)
        assert len(recorder.records) == 2


# LongCat-Flash: identity experts, whose rows the GEMMs skip by their bounds, in one graph too; Phi-3.5-MoE: random
# draws, which the recomputation draws again (the checkpoint restores the generator) and the graph keeps in order.
@pytest.mark.parametrize(
    "arch", ["glm4_moe", *[arch for arch in ("longcat_flash", "gemma4_text", "phimoe") if arch in ARCHS]]
)
@pytest.mark.parametrize("compiled", ["outside", pytest.param("inside", marks=pytest.mark.variants)])
def test_compiled_checkpointed_layers_record_once_and_equal_eager(moe_dirs, compiled, arch):
    """A checkpointed decoder layer compiles as one graph, outside its checkpoint wrapper (fullgraph: a
    graph break fails the test) or inside it (where FSDP's hooks on the experts break the graph anyway),
    records its routing once per forward (not again in the recomputation) and gives the eager block's
    loss, balance loss and gradients. Gemma 4's layer is its own block, routed by its fused router child. On torch
    2.11 the outside case lost the LoRA gradients through the fused block until its autograd.Functions stopped
    returning a ``.to`` to their tensor's own dtype (``casts.in_dtype``)."""
    torch._dynamo.reset()  # the layers' code compiled by earlier tests counts toward dynamo's recompile limit
    reference = fused_copy(build(moe_dirs[arch], ["attention", "routed_experts"]))
    compiled_model = copy.deepcopy(reference)
    for model in (reference, compiled_model):
        apply_activation_checkpointing(model, decoder_layers(model))
    for layer in decoder_layers(compiled_model):
        wrapper = next(m for m in compiled_model.modules() if getattr(m, "_checkpoint_wrapped_module", None) is layer)
        (wrapper if compiled == "outside" else layer).compile(backend="aot_eager", fullgraph=True)
    inputs, labels = padded_batch()
    results = []
    for model in (reference, compiled_model):
        records, loss, balance = record_and_balance(model, inputs, labels, weight=0.5)
        assert len(records) == 2
        results.append((records, {"loss": loss, "balance": balance} | grads_of(model)))
    assert_same_records(results[1][0], results[0][0])
    for name in results[0][1]:
        assert_same(results[1][1][name], results[0][1][name], name)
    for model in (reference, compiled_model):  # backward (and its recomputation) while still recording
        recorder = RoutingRecorder(find_moe_blocks(model, decoder_layers(model)))
        with recorder.recording(inputs["attention_mask"]):
            model(**inputs, labels=labels).loss.backward()
        assert len(recorder.records) == 2


def checkpointed_eager_and_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``model`` and a copy, every decoder layer checkpointed; the copy's layers compiled outside their wrappers
    with fullgraph, so that a graph break fails. Dynamo starts afresh: the compilations of earlier tests count
    towards its recompile limit on the same code."""
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    for each in (model, compiled):
        apply_activation_checkpointing(each, decoder_layers(each))
    for layer in decoder_layers(compiled):
        next(m for m in compiled.modules() if getattr(m, "_checkpoint_wrapped_module", None) is layer).compile(
            fullgraph=True
        )
    return model, compiled


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        # A minute and more of inductor compiling C++ on a CPU each: with -m variants. By default the MoE layers
        # compile in test_compiled_checkpointed_layers_record_once_and_equal_eager and the LoRA-rows cases, and
        # test_compile.py runs inductor on dense layers through the command line.
        pytest.param("qwen3_moe", ["attention"], marks=pytest.mark.variants),
        pytest.param("glm4_moe", ["attention", "routed_experts"], marks=pytest.mark.variants),
        *(
            pytest.param("gpt_oss", ["attention", "routed_experts", "router"], marks=pytest.mark.variants)
            for _ in range("gpt_oss" in ARCHS)
        ),
    ],
)
def test_compiled_bf16_layers_are_one_graph_each_and_train_like_eager(moe_dirs, arch, targets):
    """What GPUs run, on the CPU: bf16 through torch._grouped_mm (LoRA factors laid out for it), inductor,
    each checkpointed decoder layer compiled outside its wrapper with fullgraph (a graph break fails the
    test). Three AdamW steps, the balance loss trained, give eager's losses and record once per forward."""
    reference, compiled_model = checkpointed_eager_and_compiled(
        fused_copy(build(moe_dirs[arch], targets)).to(torch.bfloat16)
    )
    losses = [three_recorded_steps(model) for model in (reference, compiled_model)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    assert losses[0][-1] < losses[0][0]


# Minutes of inductor on a CPU: with -m variants. The default run compiles checkpointed MoE layers in
# test_compiled_checkpointed_layers_record_once_and_equal_eager.
@pytest.mark.parametrize(
    "part", [pytest.param(part, marks=pytest.mark.variants) for part in ("attention", "mlp", "sublayers")],
)  # fmt: skip
def test_compiled_layers_recomputing_their_sublayers_train_like_eager_and_keep_only_their_inputs(moe_dirs, part):
    """A compiled layer whose attention, MoE block (``mlp``) or both (``sublayers``) are checkpointed inside
    its graph, as training compiles it (fullgraph: a graph break fails the test): three AdamW steps
    give the losses of eager layers that recompute nothing, routing is recorded once per forward (not
    again when backward recomputes the block), and a layer keeps for backward what the planner counts
    (``LayerActivations.kept``): what it does not recompute, and the inputs of what it does."""
    torch._dynamo.reset()  # the layers' code compiled by earlier tests counts toward dynamo's recompile limit
    reference = fused_copy(build(moe_dirs["qwen3_moe"], ["attention", "routed_experts"])).to(torch.bfloat16)
    compiled_model = copy.deepcopy(reference)
    layers = decoder_layers(compiled_model)
    apply_activation_checkpointing(compiled_model, layers, Checkpointing.uniform(len(layers), part), compiled=True)
    for layer in layers:
        layer.compile(fullgraph=True)

    def kept_bytes(model: torch.nn.Module) -> int:
        """What the first decoder layer saves for backward at 128 tokens, parameters and the rotary
        embedding (shared by every layer) aside."""
        layer = decoder_layers(model)[0]
        rotary = model.get_base_model().model.rotary_emb
        x = torch.randn(1, 128, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(128).unsqueeze(0)
        cos, sin = rotary(x, positions)
        skipped = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
        kept: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skipped:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        return sum(kept.values())

    plain = copy.deepcopy(reference)
    for layer in decoder_layers(plain):
        layer.compile(fullgraph=True)
    config, tokens, bf16 = reference.config, 128, 2
    hidden = tokens * config.hidden_size * bf16
    gate_up = tokens * config.num_experts_per_tok * 2 * config.moe_intermediate_size * bf16
    # the LoRA factors of the routed experts laid out for the grouped GEMMs, per layer and step (rank 4
    # padded to 8): a constant that 8,192 tokens make negligible, here a tenth of the layer's activations
    factors = config.num_experts * 8 * (2 * config.hidden_size + 3 * config.moe_intermediate_size) * bf16
    everything, recomputing = kept_bytes(plain), kept_bytes(compiled_model)
    if part == "attention":  # the MoE block's activations stay (its gate/up GEMM output among them)
        assert gate_up + hidden < recomputing <= everything - 3 * hidden
    elif part == "mlp":  # the attention's activations stay, the MoE block's are its input only
        assert recomputing <= everything - gate_up - hidden
    else:  # the layer's input and the residual (the normalized inputs are recomputed)
        assert recomputing <= 2 * hidden + factors < everything / 2
    compiled_model.zero_grad(set_to_none=True)

    losses = [three_recorded_steps(model) for model in (reference, compiled_model)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)


def test_saved_adapter_loads_in_peft_and_merges_to_the_fused_logits(moe_dirs, tmp_path):
    from peft import PeftModel

    from shardtune.model.lora import targets_as_given

    fused = fused_copy(build(moe_dirs["qwen3_moe"], ["attention", "routed_experts"])).eval()
    fused.save_pretrained(tmp_path / "adapter")
    base = build(moe_dirs["qwen3_moe"]).eval()  # the same base weights (build seeds them)
    with targets_as_given():
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = fused(input_ids=ids).logits
        assert_same(adapted(input_ids=ids).logits, expected)
        merged = adapted.merge_and_unload()
        assert_same(merged(input_ids=ids).logits, expected)
        assert not any("lora" in name for name, _ in merged.named_parameters())


def test_implementation_choice(moe_dirs, tiny_model_dir, caplog):
    assert ModelConfig(name_or_path="m").experts_implementation == "auto"
    assert ModelConfig(name_or_path="m", experts_implementation=None).experts_implementation == "auto"
    caplog.set_level("INFO", logger="shardtune")
    model = build(moe_dirs["mixtral"])
    model.config.output_router_logits = True  # transformers' own aux loss: collected from router forwards
    use_fused_experts(model, decoder_layers(model), "auto")
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1024)
    assert "moe experts: fused (shardtune's grouped-GEMM block) on 2 MoE layers" in caplog.text
    eager = build(moe_dirs["mixtral"])
    blocks = use_fused_experts(eager, decoder_layers(eager), "eager")
    assert not any(isinstance(block.block, FusedMoeBlock) for block in blocks)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert use_fused_experts(dense, decoder_layers(dense), "fused") == []
    # A block of a class no routing rule names (a synthetic subclass of Mixtral's, which no architecture will add).
    unknown = build(moe_dirs["mixtral"])
    for block in find_moe_blocks(unknown, decoder_layers(unknown)):
        block.block.__class__ = type("UnknownSparseMoeBlock", (type(block.block),), {})
    with pytest.raises(ConfigError, match="model.experts_implementation: fused cannot run this model: UnknownSparse"):
        use_fused_experts(unknown, decoder_layers(unknown), "fused")
    assert not isinstance(find_moe_blocks(unknown, decoder_layers(unknown))[0].block, FusedMoeBlock)
    use_fused_experts(unknown, decoder_layers(unknown), "auto")  # transformers' default, said once
    assert "moe experts: transformers' default (UnknownSparseMoeBlock is not one of" in caplog.text


@pytest.mark.skipif("llama4_text" not in ARCHS, reason="this transformers has no Llama 4")
def test_llama4_chooses_on_logits_where_saturated_sigmoid_scores_tie(moe_dirs):
    """Llama 4's router takes the top-k logits, then their sigmoid. Above a logit of about 17 the fp32 sigmoid is 1:
    experts whose logits differ tie there, and a choice on the scores could take either."""
    model = build(moe_dirs["llama4_text"])
    block = sparse_block(model)
    tokens = torch.randn(16, block.router.weight.shape[1])
    with torch.no_grad():
        # Every expert's logit saturated, each token's best two at random places.
        logits = 20 + torch.rand(16, block.num_experts) * 5
        block.router.weight.copy_(torch.linalg.lstsq(tokens, logits).solution.T)
        expected_scores, _ = block.router(tokens)  # transformers' (scores scattered over every expert, logits)
        _, weights, chosen = route(block.router, tokens, block.routing, block.block)
    assert (torch.sigmoid(tokens @ block.router.weight.T) == 1).all()  # the scores tie everywhere
    expected = (expected_scores > 0).float()
    assert torch.equal(torch.zeros_like(expected).scatter(1, chosen, 1.0), expected)
    assert torch.equal(weights, torch.ones_like(weights))


@pytest.mark.skipif("llama4_text" not in ARCHS, reason="this transformers has no Llama 4")
def test_transformers_experts_an_architecture_lacks_are_a_config_error(moe_dirs):
    """Llama 4's experts have no grouped_mm or batched_mm in transformers: one config line, not its traceback."""
    llama4 = AutoConfig.from_pretrained(moe_dirs["llama4_text"])
    for requested in ("grouped_mm", "batched_mm"):
        with pytest.raises(ConfigError) as error:
            check_experts_implementation(llama4, requested)
        assert str(error.value) == (
            f"model.experts_implementation: Llama4ForCausalLM has no {requested} experts in transformers; set it to "
            "auto (shardtune's fused block, where it runs) or eager"
        )
    for requested in ("auto", "fused", "eager"):
        check_experts_implementation(llama4, requested)
    check_experts_implementation(AutoConfig.from_pretrained(moe_dirs["qwen3_moe"]), "grouped_mm")


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        pytest.param("glm4_moe", "[attention]", marks=pytest.mark.variants),
        ("qwen3_moe", "[attention,routed_experts]"),
        # GLM-4.7-Flash's and Qwen3.5's layouts through the command line (the latter's linear attention too)
        pytest.param("glm4_moe_lite", "[attention,routed_experts,shared_experts]", marks=pytest.mark.variants),
        pytest.param("qwen3_5_moe_text", "[attention,routed_experts,shared_experts]", marks=pytest.mark.variants),
        # The routing rules after DeepSeek-V3's and Qwen3-MoE's: DeepSeek-V2 (groups by their best), ERNIE 4.5 (a
        # softmax router's correction bias), LFM2-MoE (its block's bias; short convolutions), Granite-MoE, GPT-OSS,
        # A.X-K1 (a normalized block output), Flint (an ungated shared expert), Kolibri-1 (a correction bias on the
        # logits), Laguna (capped logits, the block's scaling), Cohere2-MoE (averaged shared experts), Llama 4 (the
        # weights on the experts' input; transposed experts), HY-V4 (a SwiGLU limit), AFMoE (a router holding its
        # logits' Linear), Nemotron-H (ungated ReLU² experts in a latent space; Mamba-2 layers), DeepSeek-V4
        # (square-root-softplus scores; a hash layer, choosing by token id), LongCat-Flash (identity experts) and
        # Gemma 4 (the decoder layer as the block, its router normalizing and scaling its input and its weights by
        # expert) and Phi-3.5-MoE (SparseMixer: experts drawn at random in training).
        *(
            pytest.param(arch, targets, marks=pytest.mark.variants)
            for arch, targets in [
                ("deepseek_v2", "[attention,routed_experts,shared_experts]"),
                ("ernie4_5_moe", "[attention,routed_experts,shared_experts,router]"),
                ("lfm2_moe", "[attention,routed_experts]"),
                ("granitemoe", "[attention,routed_experts]"),
                ("gpt_oss", "[attention,routed_experts,router]"),  # transposed, biased experts
                ("axk1", "[attention,routed_experts,shared_experts]"),
                ("flint", "[attention,routed_experts,shared_experts]"),
                ("kolibri1", "[attention,routed_experts,router]"),
                ("laguna", "[attention,routed_experts,router]"),
                ("cohere2_moe", "[attention,routed_experts,shared_experts,router]"),
                ("llama4_text", "[attention,routed_experts,shared_experts,router]"),
                ("hy_v4", "[attention,routed_experts]"),
                ("afmoe", "[attention,routed_experts,router]"),
                ("nemotron_h", "[attention,routed_experts,shared_experts,router]"),
                ("deepseek_v4", "[attention,routed_experts,shared_experts,router]"),
                ("longcat_flash", "[attention]"),  # identity experts beside frozen GEMM ones; two attentions a layer
                # Gemma 4: the decoder layer is the block, its dense MLP in dense_mlp; GELU-tanh-gated experts
                ("gemma4_text", "[attention,dense_mlp,routed_experts,router]"),
                ("dbrx", "[attention,router]"),  # 2-D expert slabs, frozen; the router's Linear child
                # Phi-3.5-MoE: experts drawn at random and input noise in training, the same draws in both runs
                ("phimoe", "[attention,routed_experts,router]"),
            ]
            if arch in ARCHS
        ),
    ],
)
def test_training_losses_and_expert_usage_equal_transformers_eager(moe_dirs, tmp_path, arch, targets):
    common = [
        f"model.name_or_path={moe_dirs[arch]}", "model.init=random", "lora.target_modules=null",
        f"lora.moe_targets={targets}", "training.moe_aux_loss_coef=0.01", "training.gradient_checkpointing=true",
    ]  # fmt: skip
    eager = train(tmp_path, "eager", 1, *common, "model.experts_implementation=eager", steps=4)
    fused = train(tmp_path, "fused", 1, *common, steps=4)
    assert "moe experts: fused (shardtune's grouped-GEMM block)" in fused["log"]
    assert "moe experts: transformers' eager" in eager["log"]
    assert fused["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    usage = [jsonl(run["out"] / "logs/expert_usage.jsonl") for run in (eager, fused)]
    assert [[layer["counts"] for layer in row["layers"]] for row in usage[1]] == [
        [layer["counts"] for layer in row["layers"]] for row in usage[0]
    ]
    balance = [
        [row["moe_balance_loss"] for row in jsonl(run["out"] / "logs/train_log.jsonl")] for run in (eager, fused)
    ]
    assert balance[1] == pytest.approx(balance[0], rel=1e-5)


def expert_blocks(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each routed-expert LoRA weight of ``model`` as (experts, ...) blocks, with its ParamWrapper's rank."""
    blocks = {}
    for name, module in model.named_modules():
        if getattr(module, "shared_across_experts", False):
            experts, rank = module.num_experts, module.r["default"]
            blocks[f"{name}.lora_A"] = module.lora_A["default"].weight.view(experts, rank, -1)
            blocks[f"{name}.lora_B"] = module.lora_B["default"].weight.view(-1, rank, experts).permute(2, 0, 1)
    return blocks


def block_grad(model: torch.nn.Module, block: torch.Tensor) -> torch.Tensor:
    """The gradient of ``block`` (a view of a LoRA weight), in the same (experts, ...) layout."""
    param = next(p for p in model.parameters() if p.data_ptr() == block.data_ptr() and p.shape.numel() == block.numel())
    return param.grad.as_strided(block.shape, block.stride())


def test_shared_expert_adapter_is_one_adapter_in_peft_format(moe_dirs, tmp_path):
    from peft import PeftModel

    from shardtune.model.lora import targets_as_given

    reference = build(moe_dirs["glm4_moe"], ["attention", "routed_experts"], shared=True)
    fused = fused_copy(reference)
    assert len(expert_blocks(fused)) == 8  # A and B of gate_up and down in 2 MoE layers
    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(fused, inputs, labels)
    for name in ("logits", "loss", "input"):  # equal per-expert copies: the same function as PEFT's
        assert_same(got[name], expected[name], name)
    # The shared adapter's gradient is split equally over the copies: each copy gets the same gradient,
    # and the copies together get what PEFT's per-expert adapters get together.
    for (name, mine), theirs in zip(expert_blocks(fused).items(), expert_blocks(reference).values(), strict=True):
        grad, reference_grad = block_grad(fused, mine), block_grad(reference, theirs)
        assert torch.equal(grad, grad[:1].expand_as(grad)), name
        assert_same(grad.sum(dim=0), reference_grad.sum(dim=0), name)
    before = {name: block.detach().clone() for name, block in expert_blocks(fused).items()}
    torch.optim.AdamW([p for p in fused.parameters() if p.requires_grad], lr=0.1).step()
    for name, block in expert_blocks(fused).items():
        assert torch.equal(block, block[:1].expand_as(block)), name  # still one adapter
        assert not torch.equal(block, before[name]), name
    with pytest.raises(ConfigError, match="lora.shared_expert_adapter: needs model.experts_implementation fused"):
        use_fused_experts(copy.deepcopy(reference), decoder_layers(reference), "eager")
    with pytest.raises(ValueError, match="shared_expert_adapter: needs routed_experts in lora.moe_targets"):
        build(moe_dirs["glm4_moe"], ["attention"], shared=True)

    fused.eval().save_pretrained(tmp_path / "adapter")
    with targets_as_given():
        adapted = PeftModel.from_pretrained(build(moe_dirs["glm4_moe"]).eval(), tmp_path / "adapter").eval()
    ids = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_same(adapted(input_ids=ids).logits, fused(input_ids=ids).logits)


def test_bf16_grouped_kernel_path_is_as_accurate_as_transformers(moe_dirs):
    """The path GPUs run: bf16 operands through torch._grouped_mm (CPUs have the kernel too), LoRA rank 4
    padded to the kernel's alignment. Against the fp32 reference, its loss and expert-adapter gradients
    are as close as transformers' eager experts run in bf16."""
    reference = build(moe_dirs["qwen3_moe"], ["attention", "routed_experts"])
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    fused = fused_copy(reference).to(torch.bfloat16)
    calls = []
    original = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    inputs, labels = padded_batch()
    expected, eager_bf16 = run(reference, inputs, labels), run(eager, inputs, labels)
    torch._grouped_mm = counting
    try:
        got = run(fused, inputs, labels)
    finally:
        torch._grouped_mm = original
    assert calls and set(calls) == {torch.bfloat16}

    def error(result: dict, name: str) -> float:
        return ((result[name].float() - expected[name]).norm() / expected[name].norm()).item()

    names = ["loss", "logits"] + [name for name in expected if "experts.lora" in name]
    for name in names:
        assert error(got, name) <= 1.5 * error(eager_bf16, name) + 1e-3, name


def test_the_block_keeps_no_output_rows_for_backward(moe_dirs):
    """The routing weight multiplies each row's hidden activation, so backward needs neither the down
    projection's (pairs, H) output rows nor a (tokens, k, H) copy of them: with frozen experts the block keeps
    its input, the gate/up GEMM output, the router's fp32 logits and probabilities, and per-pair vectors."""
    reference = build(moe_dirs["qwen3_moe"])
    model = fused_copy(reference).to(torch.bfloat16)
    for param in model.parameters():
        param.requires_grad_(False)
    block = find_moe_blocks(model, decoder_layers(model))[0].block
    config = model.config
    tokens, hidden, pairs = 128, config.hidden_size, 128 * config.num_experts_per_tok
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(2, tokens // 2, hidden, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        block(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    bf16, fp32 = 2, 4
    bound = (
        tokens * hidden * bf16  # the block's input, the router's
        + pairs * 2 * config.moe_intermediate_size * bf16  # the gate/up GEMM output
        + 2 * tokens * config.num_experts * fp32  # the router's logits and probabilities
        + 64 * pairs  # indices and weights per token and pair
    )
    output_rows = pairs * hidden * bf16
    assert sum(kept.values()) <= bound < sum(kept.values()) + output_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_clamped_glu_equals_its_torch_ops(dtype):
    """WeightedSiluMul's ``clamped_glu`` (GPT-OSS's activation, gate and up interleaved, each clamped at the limit)
    gives bit for bit what the torch ops give, in fp32 and bf16, and their autograd's gradients of the gate/up output
    and the routing weights (to fp32 rounding; bf16: to one rounding of the gradient), rows on both sides of the
    limits among them."""
    generator = torch.Generator().manual_seed(3)
    rows, width, limit, alpha = 64, 24, 7.0, 1.702
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 6).to(dtype)
    row_weights = torch.rand(rows, generator=generator)
    grad = torch.randn(rows, width, generator=generator).to(dtype)
    assert (gate_up[:, ::2] > limit).any() and (gate_up[:, 1::2].abs() > limit).any()

    def torch_ops(gate_up, row_weights):
        gate, up = gate_up[..., ::2].float(), gate_up[..., 1::2].float()
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (gate * torch.sigmoid(gate * alpha) * (up + 1) * row_weights.unsqueeze(-1)).to(dtype)

    results = []
    for function in (torch_ops, lambda x, w: WeightedSiluMul.apply(x, w, limit, "clamped_glu", alpha)):
        inputs = [gate_up.clone().requires_grad_(), row_weights.clone().requires_grad_()]
        output = function(*inputs)
        output.backward(grad)
        results.append((output, *(tensor.grad for tensor in inputs)))
    (expected, *expected_grads), (got, *got_grads) = results
    assert torch.equal(got, expected)
    for mine, reference in zip(got_grads, expected_grads, strict=True):
        assert mine.dtype == reference.dtype
        tolerance = 1e-6 if mine.dtype == torch.float32 else 2**-8
        assert_same(mine.float(), reference.float(), tolerance=tolerance)


@pytest.mark.skipif("gpt_oss" not in ARCHS, reason="this transformers has no GPT-OSS")
@pytest.mark.parametrize("targets", [["attention"], ["attention", "routed_experts"]], ids=["frozen", "lora"])
def test_gpt_oss_clamped_glu_keeps_only_its_gate_up_output_rows_for_backward(moe_dirs, targets):
    """GPT-OSS's clamped GLU (WeightedSiluMul's ``clamped_glu``) keeps for backward, per routed row, only the gate/up
    GEMM output with its bias (2I bf16) and the fp32 routing weight: as torch ops, autograd kept seven fp32 copies of
    I-wide rows (the upcast halves, the clamps', the sigmoid's and the products' operands), and the down projection's
    weighted bias its gathered fp32 bias rows (H wide), 1,172 bytes a row here against 156. With LoRA on the routed
    experts, also the two low-rank products (the rank padded to 8), not the down projection's input rows (built again
    from the gate/up output). What else a row keeps: three int64 indices (the sort order, its inverse, each row's
    expert)."""
    model = fused_copy(build(moe_dirs["gpt_oss"], targets)).to(torch.bfloat16)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    block = find_moe_blocks(model, decoder_layers(model))[0].block
    config = model.config
    tokens, pairs = 128, 128 * config.num_experts_per_tok
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept: dict[int, tuple[int, tuple]] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    x = torch.randn(2, tokens // 2, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = block(x)
    (out[0] if isinstance(out, tuple) else out).float().square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    bf16, fp32, int64 = 2, 4, 8
    per_row = 2 * config.intermediate_size * bf16 + fp32 + 3 * int64
    if "routed_experts" in targets:
        per_row += 2 * 8 * bf16
    row_bytes = sum(size for size, shape in kept.values() if shape and shape[0] == pairs)
    assert row_bytes == pairs * per_row


def test_the_pairs_are_sorted_by_expert_on_16_bit_keys(moe_dirs):
    """A radix sort makes one pass per key byte: the block's one sort takes int16 expert ids, not int64."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sorted_dtypes: list[torch.dtype] = []

    class SortKeys(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.sort:
                sorted_dtypes.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    model = fused_copy(build(moe_dirs["qwen3_moe"]))
    block = find_moe_blocks(model, decoder_layers(model))[0].block
    with SortKeys():
        block(torch.randn(2, 8, model.config.hidden_size))
    assert sorted_dtypes == [torch.int16]


@pytest.mark.parametrize("targets", [["attention"], ["attention", "routed_experts"]])
def test_frozen_down_projection_takes_the_token_gradients_for_its_input_gradient(moe_dirs, monkeypatch, targets):
    """Without LoRA on the experts, the down projection's input gradient is one GEMM over each row's token
    gradient, looked up by the row's token (quack gathers those rows inside its GEMM, so the (pairs, H)
    gradient rows are never written): called once per block in backward, with the tokens' own gradient and
    each row's token, and the same result as the gathered rows' GEMM. LoRA on the experts keeps the rows."""
    from shardtune.model import fused_moe

    calls = []

    def recording(tokens, token_of_row, weight, bounds, backend="torch"):
        calls.append((tokens.detach().clone(), token_of_row.clone()))
        result = gathered_grouped_mm(tokens, token_of_row, weight, bounds, backend)
        assert torch.equal(result, grouped_gemm.grouped_mm(tokens[token_of_row.long()], weight, bounds)), "operands"
        return result

    monkeypatch.setattr(fused_moe, "gathered_grouped_mm", recording)
    model = fused_copy(build(moe_dirs["qwen3_moe"], lora_targets=targets))
    blocks = find_moe_blocks(model, decoder_layers(model))
    hidden = torch.randn(2, 8, model.config.hidden_size, requires_grad=True)
    block = blocks[0].block
    output = block(hidden)
    assert calls == []  # nothing in the forward
    gradient = torch.randn_like(output)
    output.backward(gradient)
    if targets != ["attention"]:
        assert calls == []
        return
    ((tokens, token_of_row),) = calls
    assert torch.equal(tokens, gradient.reshape(-1, gradient.shape[-1]))  # the tokens' gradient, not rows
    top_k = block.routing.top_k
    chosen = route(block.gate, hidden.detach().reshape(-1, hidden.shape[-1]), block.routing)[2]
    order = torch.sort(chosen.reshape(-1).to(torch.int16), stable=True).indices
    assert token_of_row.dtype == torch.int32 and torch.equal(token_of_row.long(), order // top_k)


def test_grouped_gemm_choice(moe_dirs, caplog):
    """``model.grouped_gemm``: auto is torch where quack cannot run (here: no CUDA device), quack asked for
    there is an error naming the key and what to do, and the log names the kernel in use."""
    assert ModelConfig(name_or_path="m").grouped_gemm == "auto"
    cpu = torch.device("cpu")
    assert resolve_grouped_gemm("auto", cpu) == "torch"
    assert resolve_grouped_gemm("torch", cpu) == "torch"
    with pytest.raises(ConfigError) as raised:
        resolve_grouped_gemm("quack", cpu)
    assert str(raised.value) == (
        "model.grouped_gemm: quack cannot run here: its kernels need a CUDA device; set it to auto or torch"
    )
    caplog.set_level("INFO", logger="shardtune")
    model = build(moe_dirs["qwen3_moe"])
    use_fused_experts(model, decoder_layers(model), "fused", "auto", cpu)
    assert "grouped GEMMs: torch._grouped_mm for bf16 (and eager fp32 on CPUs)" in caplog.text
    assert all(block.block.experts.grouped_gemm == "torch" for block in find_moe_blocks(model, decoder_layers(model)))


def _quack_runs() -> bool:
    return torch.cuda.is_available() and quack_unavailable(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _quack_runs(), reason="needs a Hopper GPU with quack-kernels installed (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize("targets", [["attention"], ["attention", "routed_experts"]])
def test_quack_grouped_gemm_equals_torch_grouped_mm(targets, caplog):
    """On a Hopper GPU, quack's varlen GEMM computes the frozen experts' projections, forward and input
    gradient (down's gathering its rows itself where the experts carry no LoRA) with the tile configurations
    measured for them, and the block's logits, loss and every gradient are bit for bit those of
    torch._grouped_mm; a quack kernel that fails at run time hands over to torch._grouped_mm with one warning,
    same results. auto takes quack where it runs."""
    cuda = torch.device("cuda")
    assert resolve_grouped_gemm("auto", cuda) == "quack"
    assert resolve_grouped_gemm("torch", cuda) == "torch"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(kernel_sized_qwen3_moe(), dtype=torch.bfloat16).cuda()
    base.config.use_cache = False
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0, moe_targets=targets)
    base = apply_lora(base, lora)
    for name, param in base.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param, std=0.05)
    inputs, labels = padded_batch()
    inputs, labels = {key: value.cuda() for key, value in inputs.items()}, labels.cuda()

    def run_with(backend: str, gemm=None) -> dict[str, torch.Tensor]:
        """The block's results with ``backend``, quack's GEMM entry point replaced by ``gemm`` meanwhile."""
        model = copy.deepcopy(base).train()
        use_fused_experts(model, decoder_layers(model), "fused", backend, cuda)
        quack = grouped_gemm._Quack.gemm
        grouped_gemm._Quack.gemm = gemm or quack
        try:
            return run(model, inputs, labels)
        finally:
            grouped_gemm._Quack.gemm, grouped_gemm._Quack.failure = quack, None

    calls = []
    quack = grouped_gemm._Quack.gemm

    def counting(*args, **kwargs):
        gathered = kwargs["A_idx"] is not None  # whether quack gathered the rows itself
        calls.append(gathered)
        tiles = (128, 256, False, 2, 1) if gathered else (192, 128, True, 1, 2)
        config = kwargs["config"]
        assert (config.tile_m, config.tile_n, config.pingpong, config.cluster_m, config.cluster_n) == tiles
        return quack(*args, **kwargs)

    def failing(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    expected = run_with("torch")
    counted = run_with("quack", counting)
    assert len(calls) == 2 * 4  # per layer: gate/up and down, forward and input gradient
    # Without LoRA on the experts, down's input gradient gathers its rows (the tokens' gradients) in the kernel.
    assert calls.count(True) == (2 if targets == ["attention"] else 0)
    caplog.set_level("WARNING", logger="shardtune")
    fallen_back = run_with("quack", failing)
    assert caplog.text.count("model.grouped_gemm: quack's kernel failed (RuntimeError: no kernel image") == 1
    for name, value in expected.items():
        assert torch.equal(counted[name], value), name
        assert torch.equal(fallen_back[name], value), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_router_logits_on_a_gpu_are_accumulated_and_written_in_fp32(compiled):
    """On a GPU the router multiplies bf16 operands on tensor cores into fp32: within fp32's summation error
    of the exact product (bf16 accumulation or output would be off by about 2e-3), eager and compiled, and its
    gradients are those of the exact product rounded to bf16. No fp32 copy of the tokens is made (2 MiB here)."""
    torch.manual_seed(0)
    tokens = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    product = torch.compile(Fp32Linear.apply, fullgraph=True) if compiled else Fp32Linear.apply
    product(tokens, weight)  # compiled: compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logits = product(tokens, weight)
    assert torch.cuda.max_memory_allocated() - before <= logits.numel() * 4 + 2**16
    exact = tokens.detach().double() @ weight.detach().double().t()
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    grad = torch.randn_like(logits)
    logits.backward(grad)
    for got, expected in ((tokens.grad, grad.double() @ weight.detach().double()),
                          (weight.grad, grad.double().t() @ tokens.detach().double())):  # fmt: skip
        torch.testing.assert_close(
            got, expected.to(torch.bfloat16), rtol=2**-7, atol=1e-3 * expected.abs().max().item()
        )


def rounding_spread(model: torch.nn.Module, ids: torch.Tensor, expected: dict[str, torch.Tensor]) -> float:
    """How far ``model``'s results (``expected`` on ``ids``) move when every weight changes by about one float32
    rounding (relative 1e-7): the largest relative change of any result. Any change of summation order may move them
    that far. It is about 1e-5 for most tiny models; the gradients through a gated delta rule (Qwen3-Next, Qwen3.5,
    Kimi Linear) move by 1e-4 to 4e-3 under it, and a batch with a token whose router scores sit at a tie further."""
    moved = copy.deepcopy(model)
    noise = torch.Generator(device=ids.device).manual_seed(0)
    with torch.no_grad():
        for param in moved.parameters():
            if param.is_floating_point():
                param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=noise, device=param.device))
    got = run(moved, {"input_ids": ids}, ids)
    return max(((got[name] - value).norm() / value.norm()).item() for name, value in expected.items())


# On a CPU (CI), three architectures that hold the bound to its cases: plain routing, gradients through a gated delta
# rule that move by up to 4e-3 under a rounding-sized change of the weights (Qwen3-Next), a router that samples
# (Phi-3.5-MoE), and biased experts whose routing weights' gradient gathers the bias rows again (GPT-OSS); on a GPU,
# every fused architecture.
COMPILED_ON_A_CPU = [arch for arch in ("qwen3_moe", "qwen3_next", "phimoe", "gpt_oss") if arch in ARCHS]
ON_A_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)"),
]


@pytest.mark.parametrize(
    ("device", "arch"),
    [*(("cpu", arch) for arch in COMPILED_ON_A_CPU), *(pytest.param("cuda", arch, marks=ON_A_GPU) for arch in ARCHS)],
)
def test_compiled_layers_equal_the_eager_fused_block(moe_dirs, device, arch):
    """Decoder layers compiled as training compiles them (on a GPU the routing kernels, inductor's fusions of each
    layout's activation and bookkeeping) give the eager fused block's logits, loss and every gradient, with LoRA on
    attention and the routed experts (where LoRA reaches them), the last expert given rows in every layer. In fp32,
    where the two differ by summation order only: each result within 2e-4 of its norm, or within 10 times what a
    rounding-sized change of the weights moves it where that is more (``rounding_spread``), on the batch of three
    that such a change moves least (in bf16, and at a tie in fp32, a token takes another expert in one of them),
    inductor drawing random numbers as eager does; and every layer compiled (``LayerCompiler`` fell back to eager
    nowhere: it took dynamo's request to trace a frame again for a failure, which Phi-3.5-MoE's router makes when other
    models have compiled the fused block's code in the process before it, and so ran every layer after it eagerly).
    Two faults of torch 2.11 (the GPU machine's) this found: inductor read a sliced searchsorted boundary from its
    base's start (GPT-OSS's last expert's rows got an expert id past its biases, a device-side assert), and dynamo
    dropped the backward of an autograd.Function whose forward returned a ``.to`` to the dtype its tensor had (every
    gradient through the fused block 0 in fp32: ``casts.in_dtype``)."""
    targets = ["attention"] if arch in EXPERTS_OUT_OF_LORA_REACH else ["attention", "routed_experts"]
    eager = fused_copy(build(moe_dirs[arch], targets)).to(device)
    compiled = copy.deepcopy(eager)
    compiler = LayerCompiler()
    for layer in decoder_layers(compiled):
        layer.compile(backend=compiler)
    counts = []

    def counting_rows(expert_ids: torch.Tensor, experts: int):
        order, inverse, bounds = expert_order(expert_ids, experts)
        counts.append(bounds.diff())
        return order, inverse, bounds

    batches = []
    for seed in (3, 4, 5):
        ids = torch.randint(3, 1000, (4, 64), generator=torch.Generator().manual_seed(seed)).to(device)
        counts.clear()
        with mock.patch("shardtune.model.fused_moe.expert_order", counting_rows):
            expected = run(copy.deepcopy(eager), {"input_ids": ids}, ids)
        batches.append((rounding_spread(eager, ids, expected), seed, ids, expected, list(counts)))
    spread, seed, ids, expected, rows = min(batches, key=lambda batch: batch[0])
    with torch._inductor.config.patch(fallback_random=True):  # Phi-3.5-MoE's router samples: eager's draws
        got = run(compiled, {"input_ids": ids}, ids)
    assert (compiler.failure, compiler.graphs > 0) == (None, True)  # compiled, not fallen back to eager
    assert rows and all(count[-1] > 0 for count in rows)  # the last expert's rows
    bound = max(2e-4, 10 * spread)
    for name, value in expected.items():
        assert (got[name] - value).norm() <= bound * value.norm(), (name, seed, spread)


@pytest.mark.parametrize("shared", [False, True], ids=["per-expert", "shared"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_on_routed_experts_keeps_no_rows_of_its_own_for_backward(moe_dirs, compiled, shared):
    """LoRA's A factors on the routed experts get their rows built again in backward: on gate/up gathered from
    the block's input (pairs / top_k rows, kept anyway) and on down computed from the gate/up output (kept
    for the activation's backward), eager and compiled (where the partitioner, left to itself, moved the
    gather into the forward graph and kept its output). The same for one adapter shared by all experts."""
    reference = build(moe_dirs["qwen3_moe"], ["routed_experts"], shared=shared)
    model = fused_copy(reference).to(torch.bfloat16)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    block = find_moe_blocks(model, decoder_layers(model))[0].block
    config = model.config
    tokens, hidden, top_k = 128, config.hidden_size, config.num_experts_per_tok
    pairs, width = tokens * top_k, config.moe_intermediate_size
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept: dict[int, tuple] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = (storage.nbytes(), tensor.shape)
        return tensor

    run = torch.compile(block) if compiled else block
    x = torch.randn(2, tokens // 2, hidden, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        run(x).sum().backward()
    lora_a = [param for name, param in block.named_parameters() if "lora_A" in name]
    assert lora_a and all(param.grad is not None and param.grad.abs().sum() > 0 for param in lora_a)
    bf16, fp32 = 2, 4
    bound = (
        tokens * hidden * bf16  # the block's input
        + pairs * 2 * width * bf16  # the gate/up GEMM output
        + 2 * tokens * config.num_experts * fp32  # the router's logits and probabilities
        + 64 * pairs  # indices, weights and the two low-rank products per pair
        + tokens * fp32  # a per-token column
        + 64  # the experts' row bounds
        # the LoRA factors: laid out per expert (rank 4 padded to 8), or a shared adapter's one copy
        + (1 if shared else config.num_experts) * 8 * (2 * hidden + 3 * width) * bf16
        + config.num_experts * hidden * fp32  # the router's fp32 weight (compiled)
    )
    # Either set of rows kept would break the bound.
    smallest_rows = pairs * min(hidden, width) * bf16
    assert sum(size for size, _ in kept.values()) <= bound < sum(size for size, _ in kept.values()) + smallest_rows


def test_fsdp_hands_the_routed_experts_their_fp32_routing_weights(moe_dirs, world, tmp_path):
    """Under FSDP with bf16 parameters, the routed experts get the routing weights as the router made them, in fp32:
    FSDP's cast of a unit's inputs rounded them to bf16, and torch 2.11's FSDP left that cast out when a checkpointed
    layer recomputed, so backward met fp32 where the forward had saved bf16 and stopped (Qwen3-30B-A3B, 2 H100s)."""
    from conftest import REPO

    from shardtune.config import load_config
    from shardtune.distributed.parallelize import parallelize
    from shardtune.distributed.strategy import ParallelPlan
    from shardtune.train.loop import build_run_model

    overrides = [f"model.name_or_path={moe_dirs['qwen3_moe']}", "model.init=random", "model.dtype=bfloat16",
                 "lora.target_modules=null", "lora.moe_targets=[attention,routed_experts]", "parallel.strategy=fsdp",
                 f"training.output_dir={tmp_path}"]  # fmt: skip
    config = load_config(REPO / "examples/quickstart.yaml", overrides)
    model, blocks = build_run_model(config, world)
    model = parallelize(model, ParallelPlan("fsdp", "asked", 0, 0, 0), config, world, torch.bfloat16, materialized=True)
    seen = []
    for block in blocks:  # after FSDP's own pre-forward hook: what the experts' forward receives
        experts = block.block.get_submodule("experts")
        experts.register_forward_pre_hook(lambda module, args: seen.append((args[0].dtype, args[2].dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(3, 1000, (2, 16))).logits.float().sum().backward()
    assert seen == [(torch.bfloat16, torch.float32)] * len(blocks)


@pytest.mark.skipif("lfm2_moe" not in ARCHS, reason="this transformers has no LFM2-MoE")
def test_lora_on_attention_adapts_a_hybrid_models_short_convolutions(moe_dirs):
    """LFM2-MoE mixes tokens with a short convolution in some layers: LoRA's attention group adapts its projections
    there as it adapts the attention projections in the others, and the MLPs stay as they are."""
    model = build(moe_dirs["lfm2_moe"], ["attention"])
    adapted = {
        name.split(".layers.")[1].split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A." in name
    }
    attention = {
        f"{layer}.self_attn.{projection}"
        for layer in (0, 2)
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj")
    }
    assert adapted == attention | {"1.conv.in_proj", "1.conv.out_proj"}


# The Mamba mixers' Linear projections LoRA's attention group adapts: all but the one whose weight the mixer reads
# itself (Jamba's dt_proj; Mamba-2's out_proj, which its fused training kernel takes where mamba-ssm is installed).
MAMBA_ADAPTED = {"jamba": {"in_proj", "x_proj", "out_proj"}, "granitemoehybrid": {"in_proj"}, "nemotron_h": {"in_proj"}}


@pytest.mark.parametrize("arch", [arch for arch in MAMBA_ADAPTED if arch in ARCHS])
def test_lora_on_attention_adapts_mamba_mixers_but_not_weights_they_read_themselves(moe_dirs, arch):
    """Mamba mixers are a hybrid model's token mixers, in LoRA's attention group beside its attention layers. A
    projection whose weight the mixer reads without calling it would keep an adapter that never trains: it is left
    out, and every adapter gets a gradient (``run`` asserts it)."""
    model = build(moe_dirs[arch], ["attention"])
    adapted = [name.split(".lora_A.")[0] for name, _ in model.named_parameters() if ".lora_A." in name]
    mixers = {name.rsplit(".", 1)[-1] for name in adapted if ".mamba." in name or ".mixer." in name}
    assert mixers - {"q_proj", "k_proj", "v_proj", "o_proj"} == MAMBA_ADAPTED[arch]  # Nemotron-H's attention: mixer
    inputs, labels = padded_batch()
    gradients = run(model, inputs, labels)
    assert all(gradients[f"{name}.lora_B.default.weight"].abs().sum() > 0 for name in adapted)


@pytest.mark.skipif("jamba" not in ARCHS, reason="this transformers has no Jamba")
def test_lora_never_adapts_a_linear_whose_weight_its_module_reads_itself(moe_dirs):
    """Jamba's Mamba mixer multiplies by dt_proj.weight: ``all-linear`` leaves dt_proj out (every other adapter
    trains), and naming it is one line."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_dirs["jamba"]), dtype=torch.float32)
    model.config.use_cache = False
    all_linear = apply_lora(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, lora_dropout=0, target_modules="all-linear")
    )
    adapted = {
        name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in all_linear.named_parameters() if ".lora_A." in name
    }
    assert {"in_proj", "x_proj", "out_proj", "q_proj"} <= adapted and "dt_proj" not in adapted
    for name, param in all_linear.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    inputs, labels = padded_batch()
    run(all_linear.train(), inputs, labels)  # asserts every trainable parameter got a gradient
    with pytest.raises(ConfigError) as raised:
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0, target_modules=["in_proj", "dt_proj"]))
    assert str(raised.value) == (
        "lora.target_modules: dt_proj names Linear modules whose weight their module reads itself instead of calling "
        "them (model.layers.0.mamba.dt_proj and 1 more), so adapters there would never train; leave it out"
    )


# Every fused layout has float8 experts and expert parallelism (tests/train/test_float8.py,
# tests/distributed/test_expert_parallel.py), LongCat-Flash's identity experts too: under EP their gate_up_proj rows
# (which nothing reads) split over the ranks as the GEMM experts do, so the EP size must divide both counts.
def test_identity_experts_that_do_not_split_over_the_ep_group_are_one_line(moe_dirs):
    """One line, from the one check (``ParallelDims.check_experts``) that training (on the model before it is
    fused), ``plan`` (on the model's shape) and the sharding of the fused experts ask, naming both counts and the
    sizes that divide them."""
    from conftest import REPO

    from shardtune.config import load_config
    from shardtune.distributed.expert_parallel import shard_experts
    from shardtune.distributed.mesh import ParallelDims
    from shardtune.plan.run import Cluster, check_expert_parallel
    from shardtune.plan.shape import planned_model_shape

    if "longcat_flash" not in ARCHS:
        pytest.skip("this transformers has no longcat_flash")
    reference = build(moe_dirs["longcat_flash"])
    dims = ParallelDims(world_size=4, rank=0, local_world_size=4, expert_parallel_size=4)  # 8 GEMM experts, 2 identity
    error = (
        r"^parallel.expert_parallel_size: 4 does not divide the 8 GEMM experts and 2 identity experts of {}; "
        r"choose a divisor of 2$"
    )
    with pytest.raises(ConfigError, match=error.format(r"\w+")):
        shard_experts(fused_copy(reference), dims)
    blocks = find_moe_blocks(reference, decoder_layers(reference))
    with pytest.raises(ConfigError, match=error.format("m")):
        dims.check_model([(block.num_experts, identity_experts(block.experts)) for block in blocks], "m")
    overrides = [f"model.name_or_path={moe_dirs['longcat_flash']}", "parallel.expert_parallel_size=4"]
    config = load_config(REPO / "examples/quickstart.yaml", overrides, check_paths=False)
    shape, _ = planned_model_shape(config)
    assert [layer.identity_experts for layer in shape.moe_layers] == [2] * len(blocks)
    with pytest.raises(ConfigError, match=error.format(re.escape(str(moe_dirs["longcat_flash"])))):
        check_expert_parallel(config, shape, Cluster(1, 4, 80 * 2**30))
    # EP 2 divides both: no refusal
    ParallelDims(world_size=2, rank=0, local_world_size=2, expert_parallel_size=2).check_model([(10, 2)], "m")


@pytest.mark.skipif("jetmoe" not in ARCHS, reason="this transformers has no JetMoE")
def test_jetmoes_mixture_of_attention_stays_on_transformers_in_the_attention_group(moe_dirs, caplog):
    """JetMoE's MLP is a block of two expert modules (moe.ExpertPair) that runs fused; its attention's mixture of
    query/output experts (JetMoeMoA, the attention's ``experts``) is no MoE block: it keeps transformers' code, says so
    in one line, and its expert weights (with its router's Linear) are LoRA's attention group, each expert's adapter
    its own even with lora.shared_expert_adapter (transformers computes them per expert; their gradients are held to
    PEFT's in test_lora_on_routed_experts_router_and_shared_experts_equals_peft)."""
    from shardtune.model.lora import moe_lora_targets
    from shardtune.model.moe import ExpertPair

    model = build(moe_dirs["jetmoe"])
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert [block.path for block in blocks] == ["mlp"] * len(layers)
    assert all(isinstance(block.experts, ExpertPair) and block.router_name == "router" for block in blocks)
    groups = {}
    for group in ("attention", "routed_experts", "router"):
        modules, parameters, found, _ = moe_lora_targets(layers, blocks, [group])
        groups[group] = (modules, parameters)
    assert found == {"attention": 2 * len(layers) + 2 * len(layers), "routed_experts": 2 * len(layers),
                     "router": len(layers)}  # fmt: skip
    assert groups["attention"] == (
        ["self_attention.experts.router.layer", "self_attention.kv_proj"],
        ["self_attention.experts.input_linear.weight", "self_attention.experts.output_linear.weight"],
    )
    assert groups["routed_experts"] == ([], ["mlp.input_linear.weight", "mlp.output_linear.weight"])
    assert groups["router"] == (["mlp.router.layer"], [])

    adapted = build(moe_dirs["jetmoe"], ["attention", "routed_experts"], shared=True)
    shared = {name: getattr(module, "shared_across_experts", False) for name, module in adapted.named_modules()
              if name.endswith(("input_linear", "output_linear"))}  # fmt: skip
    assert shared and all(value == (".mlp." in name) for name, value in shared.items())
    with caplog.at_level("INFO", logger="shardtune"):
        fused = fused_copy(adapted)
    assert [record.getMessage() for record in caplog.records if "mixture of attention" in record.getMessage()] == [
        "moe experts: the mixture of attention (JetMoeMoA) keeps transformers' code but for its gating's row counts "
        "(kept on the device) and its experts' grouped GEMMs; its routers are not recorded"
    ]
    assert all(type(layer.self_attention.experts).__name__ == "JetMoeMoA" for layer in decoder_layers(fused))
    assert all(isinstance(layer.mlp, FusedMoeBlock) for layer in decoder_layers(fused))


@pytest.mark.skipif("jetmoe" not in ARCHS, reason="this transformers has no JetMoE")
def test_jetmoes_attention_experts_keep_their_row_counts_on_the_device(moe_dirs):
    """transformers' JetMoE gating reads its experts' row counts to the host in every layer (a sync, and a graph
    break in each compiled layer); the fused model's attention experts take them as a tensor: its forward traces as
    one graph, where transformers' breaks (their results are held to transformers' in the parametrized tests)."""
    model = build(moe_dirs["jetmoe"])
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    breaks = {}
    for name, candidate in (("transformers", model), ("fused", fused_copy(model))):
        torch._dynamo.reset()
        breaks[name] = torch._dynamo.explain(candidate)(input_ids=ids).graph_break_count
    torch._dynamo.reset()
    assert breaks["transformers"] >= len(decoder_layers(model)) and breaks["fused"] == 0, breaks


def fsdp_run_model(moe_dirs, world, tmp_path, arch: str, targets: str):
    """``arch``'s tiny model built as a run with LoRA on ``targets`` (lora.moe_targets) and parallel.strategy fsdp
    builds it, in fp32, with its MoE blocks, and a function that shards it as that run does (FSDP2, one worker)."""
    from conftest import REPO

    from shardtune.config import load_config
    from shardtune.distributed.parallelize import parallelize
    from shardtune.distributed.strategy import ParallelPlan
    from shardtune.train.loop import build_run_model

    overrides = [f"model.name_or_path={moe_dirs[arch]}", "model.init=random", "model.dtype=float32",
                 "lora.target_modules=null", f"lora.moe_targets={targets}", "parallel.strategy=fsdp",
                 f"training.output_dir={tmp_path}"]  # fmt: skip
    config = load_config(REPO / "examples/quickstart.yaml", overrides)
    model, blocks = build_run_model(config, world)

    def sharded(model: torch.nn.Module) -> torch.nn.Module:
        return parallelize(model, ParallelPlan("fsdp", "asked", 0, 0, 0), config, world, torch.float32,
                           materialized=True)  # fmt: skip

    return model, blocks, sharded


@pytest.mark.skipif("jetmoe" not in ARCHS, reason="this transformers has no JetMoE")
def test_fsdp_makes_jetmoes_pair_of_expert_modules_one_unit(moe_dirs, world, tmp_path):
    """JetMoE's experts are two modules of its block (moe.ExpertPair, not in the module tree, which runs neither
    module's forward): under FSDP2 the two (with their adapters) are one unit, gathered around the pair's own forward
    (register_fsdp_forward_method) and reduced after its backward; the block, its router and bias are the decoder
    layer's (the dense mesh: under expert parallelism the experts' unit is on another). The model's logits, loss and
    adapter gradients are those of the same model unsharded."""
    from torch.distributed.fsdp import FSDPModule

    model, blocks, sharded = fsdp_run_model(moe_dirs, world, tmp_path, "jetmoe", "[attention,routed_experts]")
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(5))

    def logits_loss_and_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.zero_grad()
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
        grads = {
            name: param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad.clone()
            for name, param in model.named_parameters()
            if param.grad is not None
        }
        return {"logits": output.logits.detach(), "loss": output.loss.detach(), **grads}

    for module in model.modules():  # build's random adapters: LoRA's B starts at zero, which no A gradient passes
        if hasattr(module, "lora_B"):
            for linear in module.lora_B.values():
                torch.nn.init.normal_(linear.weight, std=0.1, generator=torch.Generator().manual_seed(6))
    expected = logits_loss_and_gradients(model)
    model = sharded(model)
    assert blocks and all(isinstance(block.block, FusedMoeBlock) and not isinstance(block.block, FSDPModule)
                          for block in blocks)  # fmt: skip
    for block in blocks:
        units = list(block.experts.adapted().values())
        assert all(isinstance(unit, FSDPModule) for unit in units)
        assert units[0]._get_fsdp_state() is units[1]._get_fsdp_state()  # one unit
    got = logits_loss_and_gradients(model)
    assert got.keys() == expected.keys()
    assert any(".mlp.input_linear.lora_A" in name for name in got)
    assert any(".mlp.output_linear.lora_B" in name for name in got)
    for name, tensor in got.items():
        assert tensor.abs().sum() > 0, name
        assert_same(tensor, expected[name], name)


@pytest.mark.skipif("dbrx" not in ARCHS, reason="this transformers has no DBRX")
def test_fsdp_keeps_dbrxs_slab_experts_found_under_the_class_it_makes_of_them(moe_dirs, world, tmp_path):
    """FSDP2 makes DBRX's experts module its unit and gives it a class of its own (FSDPDbrxExperts); the fused block
    still reads its 2-D slabs (found by the class's bases: before, by the class's name, every forward raised an
    AttributeError), and the logits are those of the same model unsharded."""
    from torch.distributed.fsdp import FSDPModule

    model, blocks, sharded = fsdp_run_model(moe_dirs, world, tmp_path, "dbrx", "[attention,router]")
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model = sharded(model)
    assert blocks and all(type(block.experts).__name__ == "FSDPDbrxExperts" for block in blocks)
    assert all(isinstance(block.experts, FSDPModule) for block in blocks)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert_same(got, expected, "logits")


def dbrx_variant(moe_dirs, directory, **ffn) -> torch.nn.Module:
    """The tiny DBRX with ``ffn`` set in its ffn_config, saved to ``directory`` and built as ``build`` builds."""
    config = AutoConfig.from_pretrained(moe_dirs["dbrx"])
    for key, value in ffn.items():
        setattr(config.ffn_config, key, value)
    config.save_pretrained(directory)
    return build(directory)


@pytest.mark.skipif("dbrx" not in ARCHS, reason="this transformers has no DBRX")
@pytest.mark.parametrize("p", [2.0, 0.5, None])
def test_dbrx_divides_its_weights_by_their_p_norm(moe_dirs, tmp_path, p):
    """DBRX's router divides the top-k softmax probabilities by their p-norm, p its moe_normalize_expert_weights (the
    tiny model's 1: their sum; None: as they are): the whole model's logits, loss and every gradient, and the weights
    themselves against the norm's (a 1-norm, the sum, would give other weights)."""
    reference = dbrx_variant(moe_dirs, tmp_path, moe_normalize_expert_weights=p)
    fused = fused_copy(reference)
    block = sparse_block(fused)
    assert (block.routing.normalize, block.routing.norm_p) == (p is not None, p or 1.0)
    tokens = torch.randn(21, block.router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    _, weights, _ = route(block.router_child, tokens, block.routing, block.block)
    probabilities = (tokens @ block.router.weight.t()).softmax(dim=-1).topk(2, dim=-1).values
    norm = probabilities.norm(p=p, dim=-1, keepdim=True) if p is not None else 1.0
    assert_same(weights, probabilities / norm)
    assert p is None or not torch.allclose(weights.sum(dim=-1), torch.ones(21))
    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(fused, inputs, labels)
    assert expected.keys() == got.keys()
    for name in expected:
        assert_same(got[name], expected[name], name)


@pytest.mark.skipif("dbrx" not in ARCHS, reason="this transformers has no DBRX")
def test_dbrx_jitter_draws_what_transformers_draws(moe_dirs, tmp_path):
    """In training DBRX's router multiplies its input in place by uniform noise in [1 - moe_jitter_eps, 1 +
    moe_jitter_eps], so the experts take the jittered tokens too: from one seed, the fused model draws the same noise
    and gives transformers' logits, loss and every gradient; another seed gives other logits (the noise acts)."""
    reference = dbrx_variant(moe_dirs, tmp_path, moe_jitter_eps=0.2)
    fused = fused_copy(reference)
    assert sparse_block(fused).block.router_jitter_noise == 0.2
    inputs, labels = padded_batch()
    results = []
    for model, seed in ((reference, 5), (fused, 5), (fused, 6)):
        model.zero_grad()
        results.append(run(model, inputs, labels, seed))
    expected, got, other = results
    assert expected.keys() == got.keys()
    for name in expected:
        assert_same(got[name], expected[name], name)
    assert (other["logits"] - expected["logits"]).abs().max() > 1e-3


@pytest.mark.skipif("dbrx" not in ARCHS, reason="this transformers has no DBRX")
def test_dbrx_experts_take_no_lora_and_its_attention_and_router_their_groups(moe_dirs):
    """DBRX's fused Wqkv and out_proj are in the attention group, its router's Linear child (router.layer) in router;
    its experts slice their 2-D slabs of every expert themselves, which PEFT's parameter adapters break (transformers'
    forward fails under them): routed_experts is one line."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from shardtune.model.lora import moe_lora_targets

    model = build(moe_dirs["dbrx"])
    layers = decoder_layers(model)
    blocks = find_moe_blocks(model, layers)
    assert [(block.path, block.router_name, block.num_experts, block.top_k) for block in blocks] == [
        ("ffn", "router", 8, 2)
    ] * 2
    assert all(block.router is layers[block.layer].ffn.router.layer for block in blocks)
    modules, parameters, found, _ = moe_lora_targets(layers, blocks, ["attention", "router"])
    assert modules == ["ffn.router.layer", "norm_attn_norm.attn.Wqkv", "norm_attn_norm.attn.out_proj"]
    assert parameters == [] and found["routed_experts"] == 0
    with pytest.raises(ConfigError) as error:
        apply_lora(model, LoraConfig(moe_targets=["attention", "routed_experts"]))
    assert str(error.value) == (
        "lora.moe_targets: routed_experts: DbrxExperts slices its 2-D expert slabs (mlp.w1, mlp.v1, mlp.w2) itself, "
        "which PEFT's parameter adapters break (its forward fails under them in transformers and PEFT); drop "
        "routed_experts"
    )
    adapted = get_peft_model(copy.deepcopy(model), PeftLoraConfig(r=2, target_parameters=["ffn.experts.mlp.w1"]))
    with pytest.raises(AttributeError, match="ParamWrapper"):  # what the refusal spares
        adapted(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.skipif("dbrx" not in ARCHS, reason="this transformers has no DBRX")
def test_dbrx_experts_of_another_activation_stay_on_transformers(moe_dirs, tmp_path):
    """The fused slabs compute SiLU-gated experts only: DBRX with GELU experts (ffn_act_fn) keeps transformers'."""
    model = dbrx_variant(moe_dirs, tmp_path, ffn_act_fn={"name": "gelu"})
    blocks = use_fused_experts(model, decoder_layers(model), "auto")
    assert blocks and not any(isinstance(block.block, FusedMoeBlock) for block in blocks)
    with pytest.raises(ConfigError, match="fused cannot run this model: DbrxExperts is neither SiLU"):
        use_fused_experts(model, decoder_layers(model), "fused")

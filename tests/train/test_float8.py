"""``model.float8_experts`` and ``model.float8_linear``: the frozen routed experts' and linear layers' GEMMs
in float8 e4m3 with rowwise scales (shardtune/model/float8.py). The quantization is e4m3's to its rounding; the
products and their input gradients are the dequantized operands' (the fp32 emulation CPUs run, and on a Hopper
GPU torch's float8 GEMMs, marked gpu); a model whose weights are quantized keeps its parameters' names and
shapes, saves none of the quantized tensors, and trains (eager and compiled, one process and two with DDP,
MoE and dense) within float8's precision of the unquantized model, yet not equal to it; the settings it cannot
run are one line each."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from cli_runs import RunsOnDemand, train
from test_fused_moe import (
    EXPERTS_OUT_OF_LORA_REACH,
    build,
    checkpointed_eager_and_compiled,
    fused_copy,
    padded_batch,
    run,
    three_recorded_steps,
)
from tiny_models import FUSED_MOE_ARCHITECTURES, write_tiny_model

from shardtune.distributed.parallelize import decoder_layers, use_float8
from shardtune.errors import ConfigError
from shardtune.model.float8 import (
    FLOAT8,
    Float8Linear,
    Float8Product,
    float8_grouped_mm,
    float8_unavailable,
    quantize_expert_weight,
    resolve_float8_grouped_gemm,
    rowwise_float8,
)
from shardtune.model.fused_moe import (
    Float8Experts,
    FusedMoeBlock,
    GatherRows,
    Permute,
    SumRows,
    WeightedReluSquared,
    WeightedSiluMul,
    expert_order,
    use_float8_experts,
)
from shardtune.model.moe import find_moe_blocks

CPU = torch.device("cpu")
LOG_LINE = "float8: the frozen routed experts of 2 MoE layers in e4m3, rowwise scales (emulated in fp32 on the CPU)"
BUFFERS = ("_scale", "_t", "_t_scale")
# e4m3: 3 mantissa bits, so a normal value (magnitude >= 2**-6) is within 2**-4 of itself, relatively; below,
# the subnormals are 2**-9 apart, within 2**-10 absolutely. The slack covers the fp32 scaling's own rounding.
NORMAL, SMALLEST_NORMAL, SUBNORMAL = 2**-4 * (1 + 1e-5), 2**-6, 2**-10 * (1 + 1e-5)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("float8") / "qwen3_moe", "qwen3_moe")


def assert_within_e4m3_rounding(dequantized: torch.Tensor, original: torch.Tensor, scales: torch.Tensor) -> None:
    """``dequantized`` (rows scaled by ``scales``) is ``original`` rounded to e4m3, row by row."""
    scale = scales.unsqueeze(-1)
    error = (dequantized - original).abs()
    normal = original.abs() >= SMALLEST_NORMAL * scale
    assert normal.any() and (~normal).any()
    assert (error <= NORMAL * original.abs())[normal].all(), (error / original.abs())[normal].max()
    assert (error <= SUBNORMAL * scale.expand_as(error))[~normal].all(), (error / scale)[~normal].max()


def uneven_rows() -> torch.Tensor:
    """Rows of magnitudes 1e-6 to 1e3, some entries of each far below its largest (e4m3's subnormals), and
    a row of zeros."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 96, generator=generator) * torch.tensor([1e-6, 1e-3, 1.0, 30.0, 1e3, 0.0]).unsqueeze(-1)
    rows[:, :8] *= torch.logspace(-1, -6, 8)  # 1e-1 to 1e-6 of the row's scale
    return rows


def test_rowwise_float8_scales_each_row_to_e4m3s_largest_value():
    rows = uneven_rows()
    values, scales = rowwise_float8(rows)
    assert values.dtype == FLOAT8 and values.shape == rows.shape
    assert scales.dtype == torch.float32 and scales.shape == (6,)
    magnitudes = values.float().abs().amax(dim=-1)
    assert magnitudes[:5].tolist() == [448.0] * 5  # each row's largest magnitude is e4m3's largest
    torch.testing.assert_close(scales[:5], rows[:5].abs().amax(dim=-1) / 448, rtol=1e-6, atol=0)
    dequantized = values.float() * scales.unsqueeze(-1)
    assert_within_e4m3_rounding(dequantized[:5], rows[:5], scales[:5])
    assert torch.equal(dequantized[5], torch.zeros(96)) and magnitudes[5] == 0 and scales[5] < 1e-30


def test_expert_weights_are_quantized_per_output_row_and_per_input_column():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 40, 24, generator=generator) * torch.logspace(-2, 1, 40).unsqueeze(-1)
    weight[..., :4] *= 1e-4  # small inputs' columns: subnormal in their rows, normal in W^T's
    values, scales, values_t, scales_t = quantize_expert_weight(weight)
    assert [(t.dtype, tuple(t.shape)) for t in (values, scales, values_t, scales_t)] == [
        (FLOAT8, (3, 40, 24)),
        (torch.float32, (3, 40)),
        (FLOAT8, (3, 24, 40)),
        (torch.float32, (3, 24)),
    ]
    transposed = weight.transpose(-2, -1)
    for expert in range(3):
        assert_within_e4m3_rounding(values[expert].float() * scales[expert, :, None], weight[expert], scales[expert])
        assert_within_e4m3_rounding(
            values_t[expert].float() * scales_t[expert, :, None], transposed[expert], scales_t[expert]
        )
    assert torch.equal(values.float().abs().amax(dim=-1), torch.full((3, 40), 448.0))
    assert torch.equal(values_t.float().abs().amax(dim=-1), torch.full((3, 24), 448.0))


def dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.float() * scales.unsqueeze(-1)


def grouped_reference(rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows @ weights[e]^T for the rows of each expert e, in float64."""
    out, start = [], 0
    for expert, count in enumerate(counts):
        out.append(rows[start : start + count].double() @ weights[expert].double().t())
        start += count
    return torch.cat(out).float()


def assert_relative(got: torch.Tensor, expected: torch.Tensor, tolerance: float, name: str = "") -> None:
    """Within ``tolerance`` of the reference's largest magnitude."""
    error, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert error <= tolerance * scale, (name, error / scale)


COUNTS = [5, 0, 41, 1, 3]  # an expert without a row, one with most of them


def test_float8_product_and_its_input_gradient_are_the_dequantized_operands_products():
    generator = torch.Generator().manual_seed(2)
    experts, fan_out, fan_in = len(COUNTS), 32, 48
    weight = torch.randn(experts, fan_out, fan_in, generator=generator) * 0.05
    values, scales, values_t, scales_t = quantize_expert_weight(weight)
    scales.requires_grad_()  # they get no gradient all the same
    scales_t.requires_grad_()
    bounds = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.randn(sum(COUNTS), fan_in, generator=generator) * torch.logspace(-3, 2, sum(COUNTS))[:, None]
    rows.requires_grad_()
    output = Float8Product.apply(rows, values, scales, values_t, scales_t, bounds, "torch")
    assert output.dtype == torch.float32 and output.shape == (sum(COUNTS), fan_out)
    expected = grouped_reference(dequantized(*rowwise_float8(rows.detach())), dequantized(values, scales), COUNTS)
    assert_relative(output.detach(), expected, 1e-6)
    # and a float8 product, not the fp32 one: each output within a few percent of it
    exact = grouped_reference(rows.detach(), weight, COUNTS)
    assert 1e-3 < (output.detach() - exact).norm() / exact.norm() < 1e-1

    grad = torch.randn(output.shape, generator=generator) * torch.logspace(1, -4, sum(COUNTS))[:, None]
    output.backward(grad)
    # grad @ W_e, W_e from its transposed copy: (values_t[e] * scales_t[e])^T
    expected_grad = grouped_reference(dequantized(*rowwise_float8(grad)), dequantized(values_t, scales_t), COUNTS)
    assert rows.grad.shape == rows.shape
    assert_relative(rows.grad, expected_grad, 1e-6)
    assert scales.grad is None and scales_t.grad is None


# The weighted activations Float8Experts computes (fused_moe.expert_activation): SiLU-gated, SiLU-gated with a SwiGLU
# limit low enough to clamp these rows (HY-V4's, DeepSeek-V4's), ungated ReLU² (Nemotron-H's), GELU-tanh-gated (Gemma
# 4's: its backward is GELU's, not the SiLU's).
ACTIVATIONS = {
    "silu": ("silu", None),
    "swiglu-limit": ("silu", 0.05),
    "relu2": ("relu2", None),
    "gelu_tanh": ("gelu_tanh", None),
}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_float8_experts_equal_their_steps_one_by_one(dtype, activation):
    """Float8Experts (frozen float8 experts without LoRA) quantizes each token once and gathers its e4m3 row, writes
    the down projection's rows and the gate/up input gradient's in e4m3 from the weighted activation, and quantizes
    each token's gradient once: bit for bit the step-by-step functions (GatherRows, Float8Product, WeightedSiluMul
    (with its SwiGLU limit or GELU-tanh) or WeightedReluSquared, Float8Product, SumRows), forward and the gradients of
    the tokens and of the routing weights, with an expert that gets no row."""
    kind, limit = ACTIVATIONS[activation]
    generator = torch.Generator().manual_seed(4)
    tokens_count, top_k, hidden, width = 13, 3, 48, 16
    tokens = torch.randn(tokens_count, hidden, generator=generator) * torch.logspace(-2, 2, tokens_count)[:, None]
    experts = len(COUNTS) + 1
    chosen = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens_count)])
    order, inverse, bounds = expert_order(chosen.reshape(-1), experts)
    assert bounds[-1] == bounds[-2]  # the last expert gets no row
    weights = torch.rand(tokens_count * top_k, generator=generator)
    gated = 1 if kind == "relu2" else 2
    gate_up = quantize_expert_weight(torch.randn(experts, gated * width, hidden, generator=generator) * 0.05)
    down = quantize_expert_weight(torch.randn(experts, hidden, width, generator=generator) * 0.05)
    grad = torch.randn(tokens_count, hidden, generator=generator).to(dtype)
    results = []
    for fused in (True, False):
        x = tokens.to(dtype).requires_grad_()
        row_weights = weights.clone().requires_grad_()
        if fused:
            token_of_row = (order // top_k).to(torch.int32)
            output = Float8Experts.apply(
                x, row_weights, token_of_row, inverse, top_k, bounds, "torch", kind, limit, None, *gate_up, *down
            )  # fmt: skip
        else:
            projected = Float8Product.apply(GatherRows.apply(x, order, inverse, top_k), *gate_up, bounds, "torch")
            if kind == "relu2":
                hidden_rows = WeightedReluSquared.apply(projected, row_weights)
            else:
                hidden_rows = WeightedSiluMul.apply(projected, row_weights, limit, kind)
                if limit is not None:  # the limit acts on these rows
                    assert (projected.detach().float().abs() > limit).float().mean() > 0.1
            rows = Float8Product.apply(hidden_rows, *down, bounds, "torch")
            output = SumRows.apply(rows, order, inverse, top_k)
        output.backward(grad)
        results.append((output.detach(), x.grad, row_weights.grad))
    assert results[0][0].dtype == dtype and results[0][0].shape == tokens.shape
    for fused, stepwise in zip(*results, strict=True):
        assert torch.equal(fused, stepwise)


def float8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` quantized as training quantizes it for ``model.float8_experts`` alone."""
    quantized = copy.deepcopy(model)
    use_float8(quantized, CPU, experts=True, linear=False)
    return quantized


def routed_experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding the routed experts' weights (under PEFT's wrappers where LoRA targets them)."""
    return [module for module in model.modules() if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def test_the_quantized_weights_stay_the_same_parameter_objects(qwen3_moe):
    """DDP lists a model's parameters when it is built, before the weights are quantized (every rank quantizes rank
    0's weights, which DDP's building sends), and keeps the list: a weight quantized into a new parameter object
    would keep its bf16 tensor alive through it."""
    model = fused_copy(build(qwen3_moe, ["attention"]))
    listed = list(model.parameters())
    use_float8(model, CPU, experts=True, linear=True)
    assert [id(param) for param in model.parameters()] == [id(param) for param in listed]
    quantized = [param for param in listed if param.dtype == FLOAT8]
    swapped = [module for module in model.modules() if isinstance(module, Float8Linear)]
    assert len(swapped) >= 8  # q, k, v and o of each of the 2 layers, at least
    assert len(quantized) == 2 * 2 + len(swapped)  # gate_up_proj and down_proj of each layer's experts


@pytest.mark.parametrize("targets", [["attention"], ["attention", "routed_experts"]])
def test_quantized_experts_keep_their_parameters_and_compute_within_float8s_precision(qwen3_moe, targets, caplog):
    caplog.set_level("INFO", logger="shardtune")
    reference = fused_copy(build(qwen3_moe, targets))
    shapes = {name: param.shape for name, param in reference.named_parameters()}
    state = set(reference.state_dict())
    model = float8_copy(reference)
    assert LOG_LINE in caplog.text
    experts = routed_experts_of(model)
    assert len(experts) == 2
    names = {name for name, _ in model.named_parameters()}
    assert names == set(shapes)
    for name, param in model.named_parameters():
        assert param.shape == shapes[name], name
        is_expert = name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
        assert (param.dtype == FLOAT8) == is_expert, name
        assert not (is_expert and param.requires_grad), name
    assert sum(name.endswith(("gate_up_proj", "down_proj")) for name in names) == 4
    buffers = dict(model.named_buffers())
    for module in experts:
        for weight in ("gate_up_proj", "down_proj"):
            for suffix in BUFFERS:
                assert isinstance(getattr(module, weight + suffix), torch.Tensor)
    added = {
        name for name in buffers if name.endswith(tuple(w + s for w in ("gate_up_proj", "down_proj") for s in BUFFERS))
    }
    assert len(added) == 2 * 2 * 3
    assert set(model.state_dict()) == state  # the buffers are not persistent; the parameters keep their names
    assert not added & set(model.state_dict())

    # The MoE block: within float8's precision of the fp32 block (about 6e-2 here), which bf16 would be within 2e-3 of.
    x = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    blocks = [find_moe_blocks(m, decoder_layers(m))[0].block for m in (reference, model)]
    assert all(isinstance(block, FusedMoeBlock) for block in blocks)
    with torch.no_grad():
        block_error = relative_error(blocks[1](x), blocks[0](x))
    if targets == ["attention"]:
        assert 1e-2 < block_error < 1e-1, block_error
    else:  # the experts' large random adapters (build's) dwarf the base product and its error
        assert 1e-3 < block_error < 1e-2, block_error

    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(model, inputs, labels)
    assert got.keys() == expected.keys()
    assert any("lora_" in name for name in got)
    assert any("experts" in name for name in got) == ("routed_experts" in targets)
    for name, grad in got.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    loss_error = abs(got["loss"].item() - expected["loss"].item()) / expected["loss"].item()
    assert loss_error < 1e-3, loss_error
    # fp32's summation orders alone would differ by about 1e-7
    assert 1e-6 < relative_error(got["logits"], expected["logits"]) < 5e-2
    # the adapters' large random factors (build's) on the experts amplify the experts' quantization error
    gradients = 1e-3 if targets == ["attention"] else 0.5
    for name in got:
        assert relative_error(got[name], expected[name]) < gradients, name


# The expert layouts besides Qwen3-MoE's (E, 2I, H) SiLU-gated ones: Llama 4's transposed (E, H, 2I) weights (its
# routing weights scale the experts' inputs), Nemotron-H's ungated ReLU² ones (up_proj, between latent projections),
# SiLU-gated ones with a SwiGLU limit (HY-V4, DeepSeek-V4: hash layers too), GPT-OSS's transposed, biased clamped-GLU
# ones (the biases added in their own dtype after the float8 products), Gemma 4's GELU-tanh-gated ones (beside its
# dense MLP, the decoder layer's forward kept) and LongCat-Flash's with identity experts (rows no GEMM writes; its
# gate_up_proj's rows of the identity experts quantized too, never read), DBRX's 2-D slabs (gate w1, up v1 and down w2,
# each expert's rows (in, out) for down; no LoRA reaches its experts, so its second case adapts the router instead),
# JetMoE's pair of expert modules of its MLP block (moe.ExpertPair: input_linear's and output_linear's ``weight``,
# SiLU-gated (E, 2I, H) and (E, H, I); the query and output experts of its mixture of attention,
# self_attention.experts, stay fp32: attention, as everywhere).
LAYOUTS = [
    "llama4_text", "nemotron_h", "hy_v4", "deepseek_v4", "gpt_oss", "gemma4_text", "longcat_flash", "dbrx", "jetmoe",
]  # fmt: skip
# The routed experts' weights by architecture, where they are not an ``experts`` module's gate_up_proj, up_proj and
# down_proj or slabs (under PEFT's ``base_layer`` where LoRA adapts them).
EXPERT_WEIGHTS = {"jetmoe": ("mlp.input_linear.weight", "mlp.output_linear.weight")}
# The gradients' bounds (LoRA on the attention; on the routed experts too) where Qwen3-MoE's (1e-3; 0.5) do not hold.
# DeepSeek-V4's tiny model carries float8's error further into its gradients (its attention's: 1.1e-2 at most,
# measured). Its tiny SwiGLU limit (0.05) clamps the random gate/up values near their own magnitude, and a clamped value
# takes no gradient: where float8's error moves a value across the limit its gradient switches on or off, which the
# experts' large random adapters (build's) carry into every gradient (0.57 at most; with a limit of 100, 0.04; HY-V4's
# values lie far beyond its limit: 7e-3).
# Gemma 4's layer RMS-normalizes its experts' output (post_feedforward_layernorm_2) before the residual, so the
# experts' relative error reaches the residual whole where other blocks' small outputs damp it, and a routing choice
# of layer 1 flips (3 of 69 tokens): with LoRA on attention its gradients lie up to 0.94 from fp32's (the expert
# weights rounded to e4m3 alone, everything else fp32: 0.50), its logits 8.2e-2 (5.3e-2). A zero or wrong-signed
# gradient is still 1 or more away.
# DBRX's second case adapts its router, whose gradient is the experts' outputs' differences, which float8's error
# moves most (0.19 at most, the router's lora_A; LoRA on attention alone: 2e-4): Qwen3-MoE's bounds hold.
GRADIENT_TOLERANCE = {"deepseek_v4": (2e-2, 1.0), "gemma4_text": (1.0, 0.5)}
LOGIT_TOLERANCE = {"gemma4_text": 1e-1}  # the logits' bound where Qwen3-MoE's (5e-2) does not hold


@pytest.fixture(scope="module")
def layout_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8-layouts")
    return {arch: write_tiny_model(root / arch, arch) for arch in LAYOUTS if arch in FUSED_MOE_ARCHITECTURES}


@pytest.mark.parametrize("targets", [["attention"], ["attention", "routed_experts"]])
@pytest.mark.parametrize("arch", LAYOUTS)
def test_float8_experts_of_every_layout_compute_within_float8s_precision(layout_dirs, arch, targets):
    """Each layout's expert weights quantized in the orientation its GEMMs take them (a transposed weight keeps its
    shape, holding W_e^T's rows, its ``_t`` buffers W_e's), and the model's loss, logits and gradients within
    float8's precision of the bf16-free fp32 model at the tolerances Qwen3-MoE's test holds (yet not equal to it):
    without LoRA on the experts through Float8Experts (Llama 4's weighted inputs through the step-by-step
    functions), with it through Float8Product and the adapters' grouped GEMMs."""
    if arch not in layout_dirs:
        pytest.skip(f"this transformers has no {arch}")
    if arch in EXPERTS_OUT_OF_LORA_REACH:  # DBRX's: LoRA on the router beside the attention instead
        targets = [target.replace("routed_experts", "router") for target in targets]
    reference = fused_copy(build(layout_dirs[arch], targets))
    weights = EXPERT_WEIGHTS.get(arch, ("gate_up_proj", "up_proj", "down_proj", *SLABS))
    originals = {
        name: param.detach().clone()
        for name, param in reference.named_parameters()
        if (name.replace(".base_layer", "").endswith(weights) if arch in EXPERT_WEIGHTS else ".experts." in name)
    }
    model = float8_copy(reference)
    quantized = {name: param for name, param in model.named_parameters() if param.dtype == FLOAT8}
    assert set(quantized) == {name for name in originals if "lora_" not in name and not name.endswith("_bias")}
    assert all(name.replace(".base_layer", "").endswith(weights) for name in quantized) and quantized
    for name, param in quantized.items():
        assert param.shape == originals[name].shape and not param.requires_grad, name
        # The parameter holds the float8 values alone: the weight's own storage is gone.
        assert param.untyped_storage().nbytes() == param.numel(), name
        for values, scale, original in float8_forms(model, name, param, originals[name]):
            error = (dequantized(values, scale) - original).abs()  # e4m3's rounding, normal or subnormal
            assert (error <= torch.maximum(NORMAL * original.abs(), SUBNORMAL * scale.unsqueeze(-1))).all(), name

    inputs, labels = padded_batch()
    expected, got = run(reference, inputs, labels), run(model, inputs, labels)
    assert got.keys() == expected.keys()
    routed = ".mlp.input_linear." if arch == "jetmoe" else "experts"  # JetMoE's attention experts: its attention's
    assert any(routed in name for name in got) == ("routed_experts" in targets)
    loss_error = abs(got["loss"].item() - expected["loss"].item()) / expected["loss"].item()
    assert loss_error < 1e-3, loss_error
    assert 1e-6 < relative_error(got["logits"], expected["logits"]) < LOGIT_TOLERANCE.get(arch, 5e-2)
    gradients = GRADIENT_TOLERANCE.get(arch, (1e-3, 0.5))[targets != ["attention"]]
    for name in set(got) - {"loss", "logits"}:  # DeepSeek-V4's logits: 1.7e-3, within the bound above
        assert torch.isfinite(got[name]).all(), name
        assert relative_error(got[name], expected[name]) < gradients, name


SLABS = ("mlp.w1", "mlp.v1", "mlp.w2")  # DBRX's (fused_moe.SLAB_EXPERTS)


def float8_forms(model: torch.nn.Module, name: str, param: torch.Tensor, original: torch.Tensor) -> list[tuple]:
    """(e4m3 values, their rows' scales, what they round) of a quantized expert weight: the parameter's own values and
    its transpose's. A transposed weight's parameter holds W_e^T's rows, its ``_t`` buffer W_e's; DBRX's slabs (E*I,
    H) are (E, I, H) per expert, gate's and up's transposes held together ([gate | up]^T, w1_v1_t: gate's columns
    first), down's (each expert's rows (in, out)) as a transposed weight's."""
    owner, weight = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    if not name.endswith(SLABS):
        return [
            (param, getattr(owner, f"{weight}_scale"), original),
            (getattr(owner, f"{weight}_t"), getattr(owner, f"{weight}_t_scale"), original.mT),
        ]
    width = model.config.ffn_config.ffn_hidden_size
    per_expert = original.view(-1, width, original.shape[-1])
    if weight == "w2":
        transposed, transposed_scale = owner.w2_t, owner.w2_t_scale
    else:
        half = slice(0, width) if weight == "w1" else slice(width, 2 * width)
        transposed, transposed_scale = owner.w1_v1_t[..., half], owner.w1_v1_t_scale
    return [
        (param.view(per_expert.shape), getattr(owner, f"{weight}_scale"), per_expert),
        (transposed, transposed_scale, per_expert.mT),
    ]


@pytest.mark.skipif("dbrx" not in FUSED_MOE_ARCHITECTURES, reason="this transformers has no DBRX")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dbrx_float8_slabs_compute_what_gate_up_proj_and_down_proj_would(layout_dirs, dtype):
    """DBRX's float8 slabs keep their parameter objects, names and (E*I, H) shapes and hold e4m3 values (1 byte a
    weight; the buffers another: what the bf16 weights took), and its experts compute, bit for bit, what the ``silu``
    layout's float8 experts (Float8Experts, quantize_expert_weight) compute of the same weights laid out as Qwen3-MoE's:
    gate_up_proj (E, 2I, H) the [w1 | v1] rows of each expert, down_proj (E, H, I) each expert's w2 rows transposed;
    forward, the tokens' and the routing weights' gradients, every expert chosen (one with no row)."""
    model = fused_copy(build(layout_dirs["dbrx"], ["attention"])).to(dtype)
    block = find_moe_blocks(model, decoder_layers(model))[0]
    experts = block.experts
    slabs = {name: getattr(experts.mlp, name) for name in ("w1", "v1", "w2")}
    width, hidden = model.config.ffn_config.ffn_hidden_size, model.config.d_model
    count = block.num_experts
    gate, up, down = (slabs[name].detach().clone().view(count, width, hidden) for name in ("w1", "v1", "w2"))
    use_float8(model, CPU, experts=True, linear=False)
    assert all(getattr(experts.mlp, name) is slab for name, slab in slabs.items())
    assert [(slab.dtype, tuple(slab.shape)) for slab in slabs.values()] == [(FLOAT8, (count * width, hidden))] * 3
    weights = sum(slab.numel() for slab in slabs.values())
    assert sum(slab.untyped_storage().nbytes() for slab in slabs.values()) == weights  # the bf16 or fp32 data gone
    transposes = [experts.mlp.w1_v1_t, experts.mlp.w2_t]
    assert [tuple(t.shape) for t in transposes] == [(count, hidden, 2 * width), (count, hidden, width)]
    assert sum(t.untyped_storage().nbytes() for t in transposes) == weights
    assert not {name for name, _ in experts.named_buffers()} & set(model.state_dict())

    gate_up_forms = quantize_expert_weight(torch.cat([gate, up], dim=1))
    down_forms = quantize_expert_weight(down.mT.contiguous())
    assert torch.equal(slabs["w2"].view(count, width, hidden), down_forms[2])  # the transposed weight's own values
    generator = torch.Generator().manual_seed(8)
    tokens_count, top_k = 11, 2
    tokens = torch.randn(tokens_count, hidden, generator=generator).to(dtype)
    chosen = torch.stack([torch.randperm(count - 1, generator=generator)[:top_k] for _ in range(tokens_count)])
    weights = torch.rand(tokens_count, top_k, generator=generator)
    grad = torch.randn(tokens_count, hidden, generator=generator).to(dtype)
    results = []
    for slab_experts in (True, False):
        x, w = tokens.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
        if slab_experts:
            output = experts(x, chosen, w)
        else:
            order, inverse, bounds = expert_order(chosen.reshape(-1), count)
            output = Float8Experts.apply(
                x, Permute.apply(w.reshape(-1), order, inverse), (order // top_k).to(torch.int32), inverse, top_k,
                bounds, "torch", "silu", None, None, *gate_up_forms, *down_forms,
            )  # fmt: skip
        output.backward(grad)
        results.append((output.detach(), x.grad, w.grad))
    assert results[0][0].dtype == dtype and results[0][0].abs().sum() > 0
    for slab_result, layout_result in zip(*results, strict=True):
        assert torch.equal(slab_result, layout_result)


@pytest.mark.variants
def test_compiled_bf16_float8_layers_are_one_graph_each_and_train_like_eager(qwen3_moe):
    """What GPUs run, on the CPU: the model cast to bf16 and then quantized (Module.to(dtype) would convert the
    float8 weights too), inductor compiling each checkpointed decoder layer outside its wrapper with fullgraph
    (a graph break fails the test): three AdamW steps give the eager float8 model's losses, which decrease."""
    eager = float8_copy(fused_copy(build(qwen3_moe, ["attention", "routed_experts"])).to(torch.bfloat16))
    assert {param.dtype for param in eager.parameters()} == {torch.bfloat16, FLOAT8}
    eager, compiled = checkpointed_eager_and_compiled(eager)
    losses = []
    for model in (eager, compiled):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            losses.append(three_recorded_steps(model))
        calls = sum(event.count for event in profile.key_averages() if "float8_grouped_mm_emulated" in event.key)
        # per step and MoE layer at least the two projections forward and their two input gradients
        assert calls >= 3 * 2 * 4, calls
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    assert losses[0][-1] < losses[0][0]


def test_trainable_experts_cannot_be_quantized(qwen3_moe):
    full = fused_copy(build(qwen3_moe))  # no LoRA: every weight trains
    with pytest.raises(ConfigError) as raised:
        use_float8_experts(full)
    assert str(raised.value) == (
        "model.float8_experts: the routed experts train in this run; float8 is for frozen ones (lora.enabled: "
        "true, the experts' weights frozen); set it to false"
    )
    assert float8_unavailable(CPU) is None


STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, qwen3_moe):
    """The tiny Qwen3-MoE trained with LoRA (on the attention: lora.moe_targets' default), with and without
    float8 experts, in one process (accumulating two micro-batches) and in two (DDP)."""
    tmp_path = tmp_path_factory.mktemp("float8-runs")
    common = [f"model.name_or_path={qwen3_moe}", "model.init=random", "lora.target_modules=null"]
    single = ["training.gradient_accumulation_steps=2"]
    float8 = "model.float8_experts=true"
    return RunsOnDemand(
        {
            "plain": lambda: train(tmp_path, "plain", 1, *common, *single, steps=STEPS),
            "float8": lambda: train(tmp_path, "float8", 1, *common, *single, float8, steps=STEPS),
            "float8-ddp": lambda: train(
                tmp_path, "float8-ddp", 2, *common, "parallel.strategy=ddp", float8, steps=STEPS
            ),
        }
    )


def adapter_tensors(out) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    from safetensors import safe_open

    with safe_open(out / "final/adapter_model.safetensors", "pt") as adapter:
        return {
            name: (adapter.get_tensor(name).dtype, tuple(adapter.get_tensor(name).shape))
            for name in adapter.keys()  # noqa: SIM118 (safe_open is no dict)
        }


def assert_float8_run_like_plain(plain: dict, float8: dict) -> dict:
    """The float8 run logged its line, trained STEPS steps with falling losses within float8's precision of the plain
    run's (about 4e-5 apart by step 4; fp32's summation orders alone would be 1e-7 apart), yet not equal to them, and
    saved the adapter the plain run saves (names, dtypes, shapes); returns that adapter's."""
    assert LOG_LINE in float8["log"] and "float8: the frozen" not in plain["log"]
    assert len(float8["losses"]) == len(plain["losses"]) == STEPS
    assert float8["losses"] == pytest.approx(plain["losses"], rel=5e-4)
    assert max(abs(a / b - 1) for a, b in zip(float8["losses"], plain["losses"], strict=True)) > 5e-6
    assert float8["losses"][-1] < float8["losses"][0]
    saved, reference = adapter_tensors(float8["out"]), adapter_tensors(plain["out"])
    assert saved == reference
    return saved


def test_a_float8_run_trains_within_float8s_precision_and_saves_the_same_adapter(runs):
    saved = assert_float8_run_like_plain(runs["plain"], runs["float8"])
    assert saved and all("lora_" in name for name in saved)
    assert {dtype for dtype, _ in saved.values()} == {torch.float32}


@pytest.fixture(scope="module")
def dbrx_runs(tmp_path_factory):
    """The tiny DBRX trained with LoRA on the attention and the router (its experts take none), with and without float8
    experts, in one process."""
    tmp_path = tmp_path_factory.mktemp("float8-dbrx")
    model = write_tiny_model(tmp_path / "dbrx", "dbrx")
    common = [f"model.name_or_path={model}", "model.init=random", "lora.target_modules=null",
              "lora.moe_targets=[attention,router]", "training.gradient_accumulation_steps=2"]  # fmt: skip
    return RunsOnDemand(
        {
            "plain": lambda: train(tmp_path, "plain", 1, *common, steps=STEPS),
            "float8": lambda: train(tmp_path, "float8", 1, *common, "model.float8_experts=true", steps=STEPS),
        }
    )


@pytest.mark.skipif("dbrx" not in FUSED_MOE_ARCHITECTURES, reason="this transformers has no DBRX")
def test_a_dbrx_float8_run_trains_within_float8s_precision_and_saves_the_same_adapter(dbrx_runs):
    """DBRX's slabs quantized in a run: its losses within float8's precision of the unquantized run's (1.4e-4 apart at
    most, measured), yet not equal to them, and the adapter (attention and router) saved as that run saves it."""
    saved = assert_float8_run_like_plain(dbrx_runs["plain"], dbrx_runs["float8"])
    assert any(".ffn.router." in name for name in saved) and not any(".experts." in name for name in saved)


@pytest.mark.data_parallel
@pytest.mark.representative
def test_two_ddp_workers_with_float8_experts_train_like_one(runs):
    """Every rank quantizes rank 0's weights (after DDP's broadcast) alike: the two workers' losses are the
    one process's."""
    reference, ddp = runs["float8"], runs["float8-ddp"]
    assert ddp["metrics"]["world_size"] == 2
    assert LOG_LINE in ddp["log"]
    assert ddp["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["lora.enabled=false"], "model.float8_experts: quantizes frozen weights; needs lora.enabled: true"),
        *[
            (
                [setting],
                "model.float8_experts: needs the weights whole on every rank (one GPU, or parallel.strategy: ddp); "
                "FSDP and expert parallelism split them",
            )
            for setting in ("parallel.strategy=fsdp", "parallel.expert_parallel_size=2")
        ],
        (
            ["model.float8_experts=false", "model.float8_linear=true", "lora.enabled=false"],
            "model.float8_linear: quantizes frozen weights; needs lora.enabled: true",
        ),
        (
            # the base weights of a random init exist only in the run, and it holds them in float8
            ["model.init=random", "training.merge_final=true"],
            "training.merge_final: a random init's base weights exist only in the run, which holds them in float8 "
            "(model.float8_experts); merge a checkpoint with shardtune export CHECKPOINT --merge, which draws the "
            "init again",
        ),
    ],
)
def test_settings_float8_experts_cannot_run_are_one_line(overrides, error, capsys):
    from conftest import REPO

    from shardtune.cli import main

    assert main(["train", str(REPO / "examples/quickstart.yaml"), "model.float8_experts=true", *overrides]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"shardtune: error: {error}"]
    assert "Traceback" not in captured.out + captured.err


NO_FUSED_BLOCKS = (
    "shardtune: error: model.float8_experts: this model has no fused MoE blocks (model.experts_implementation: "
    "fused runs the routed experts' GEMMs it quantizes); set it to false"
)


@pytest.mark.parametrize("model", ["dense", pytest.param("eager-experts", marks=pytest.mark.variants)])
def test_a_model_without_fused_experts_stops_with_one_line(tmp_path, qwen3_moe, model):
    import subprocess
    import sys

    from conftest import REPO

    overrides = (
        [f"model.name_or_path={qwen3_moe}", "model.init=random", "lora.target_modules=null",
         "model.experts_implementation=eager"]
        if model == "eager-experts" else []
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "shardtune", "train", "examples/quickstart.yaml", "--nproc", "1",
         f"training.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=1",
         "model.float8_experts=true", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-4000:]
    assert [line for line in result.stderr.splitlines() if "error" in line] == [NO_FUSED_BLOCKS]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "run" / "logs" / "train_log.jsonl").exists()  # no step ran


def test_a_float8_linear_layer_is_the_dequantized_product_and_keeps_its_state():
    """Float8Linear: the forward and the input gradient are the dequantized operands' products (W from its own
    copy, W^T from the transposed one, laid out contiguously as a float8 GEMM takes it), the bias is added in
    the output's dtype, and the state dict keeps the Linear's names and shapes with the float8 values."""
    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(48, 32, bias=True).requires_grad_(False)
    linear.weight.copy_(torch.randn(32, 48, generator=generator) * 0.05)
    linear.bias.copy_(torch.randn(32, generator=generator))
    weight = linear.weight.clone()
    layer = Float8Linear(linear)  # its weight is the Linear's parameter, which now holds the float8 values
    assert layer.weight is linear.weight
    assert layer.weight.dtype == layer.weight_t.dtype == FLOAT8 and not layer.weight.requires_grad
    assert layer.weight_t.shape == (48, 32) and layer.weight_t.is_contiguous()
    assert {name: tuple(t.shape) for name, t in layer.state_dict().items()} == {"weight": (32, 48), "bias": (32,)}
    x = (torch.randn(2, 7, 48, generator=generator) * torch.logspace(-2, 2, 7)[:, None]).requires_grad_()
    output = layer(x)
    assert output.shape == (2, 7, 32)
    rows = x.detach().reshape(-1, 48)
    expected = dequantized(*rowwise_float8(rows)) @ dequantized(layer.weight, layer.weight_scale).t() + linear.bias
    assert_relative(output.detach().reshape(-1, 32), expected, 1e-6)
    exact = torch.nn.functional.linear(rows, weight, linear.bias)
    assert 1e-3 < relative_error(output.detach().reshape(-1, 32), exact) < 1e-1  # float8's, not fp32's
    grad = torch.randn(2, 7, 32, generator=generator)
    output.backward(grad)
    expected_grad = (
        dequantized(*rowwise_float8(grad.reshape(-1, 32))) @ dequantized(layer.weight_t, layer.weight_t_scale).t()
    )
    assert_relative(x.grad.reshape(-1, 48), expected_grad, 1e-6)


def test_float8_linear_quantizes_the_frozen_linear_layers_and_leaves_the_rest(qwen3_moe, caplog):
    """On a fused MoE model with LoRA on the attention: the attention's base layers become Float8Linear, LoRA's
    own factors, the routers, the routed experts, the embeddings and the output layer stay as they were."""
    model = fused_copy(build(qwen3_moe, ["attention"]))
    routers = [
        block.block.get_submodule(block.block.router_name) for block in find_moe_blocks(model, decoder_layers(model))
    ]
    with caplog.at_level("INFO", logger="shardtune"):
        use_float8(model, CPU, experts=False, linear=True)
    swapped = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert swapped == {
        f"base_model.model.model.layers.{layer}.self_attn.{projection}.base_layer"
        for layer in range(2)
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    assert (
        "float8: 8 frozen linear layers of the decoder layers in e4m3, rowwise scales (emulated in fp32 on the CPU)"
        in caplog.text
    )
    assert all(router.weight.dtype == torch.float32 for router in routers)
    assert {param.dtype for name, param in model.named_parameters() if not name.endswith("base_layer.weight")} == {
        torch.float32
    }
    inputs, labels = padded_batch()
    reference, quantized = run(fused_copy(build(qwen3_moe, ["attention"])), inputs, labels), run(model, inputs, labels)
    assert reference.keys() == quantized.keys()
    assert 1e-6 < relative_error(quantized["logits"], reference["logits"]) < 5e-2
    assert quantized["loss"].item() == pytest.approx(reference["loss"].item(), rel=1e-3)


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory):
    """A tiny Llama trained with LoRA on every linear layer, with and without model.float8_linear."""
    tmp_path = tmp_path_factory.mktemp("float8-dense")
    common = [f"model.name_or_path={write_tiny_model(tmp_path / 'llama', 'llama')}", "model.init=random"]
    return RunsOnDemand(
        {
            "plain": lambda: train(tmp_path, "plain", 1, *common, steps=STEPS),
            "float8": lambda: train(tmp_path, "float8", 1, *common, "model.float8_linear=true", steps=STEPS),
        }
    )


def test_a_dense_model_trains_with_float8_linear_layers_and_saves_the_same_adapter(dense_runs):
    plain, float8 = dense_runs["plain"], dense_runs["float8"]
    assert "float8: 14 frozen linear layers of the decoder layers in e4m3, rowwise scales" in float8["log"]
    assert "float8:" not in plain["log"]
    assert float8["losses"] == pytest.approx(plain["losses"], rel=5e-3)
    assert max(abs(a / b - 1) for a, b in zip(float8["losses"], plain["losses"], strict=True)) > 5e-6
    assert float8["losses"][-1] < float8["losses"][0]
    assert adapter_tensors(float8["out"]) == adapter_tensors(plain["out"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_float8_grouped_mm_on_a_gpu_equals_the_emulation():
    """On a Hopper GPU the float8 grouped GEMM (shardtune's kernel, the same as torch._scaled_grouped_mm's bit for
    bit: test_float8_grouped_kernel.py) multiplies the quantized operands (fast accumulation, bf16 output) as
    the fp32 emulation does, to bf16's rounding of the outputs; forward and input gradient, an
    expert without a row among them, the experts' row counts not multiples of 16 (tokens route as they like)."""
    cuda = torch.device("cuda")
    if torch.cuda.get_device_capability(cuda)[0] != 9:
        reason = float8_unavailable(cuda)
        if reason is not None:
            pytest.skip(reason)
    assert float8_unavailable(cuda) is None
    generator = torch.Generator().manual_seed(5)
    counts = [37, 0, 200, 5, 14, 0, 1, 63]
    weight = torch.randn(len(counts), 384, 256, generator=generator) * 0.02
    rows = torch.randn(sum(counts), 256, generator=generator).to(torch.bfloat16)
    grad = torch.randn(sum(counts), 384, generator=generator).to(torch.bfloat16)
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    results = {}
    for device in (CPU, cuda):
        quantized = [tensor.to(device) for tensor in quantize_expert_weight(weight.to(device))]
        x = rows.to(device).detach().requires_grad_()
        backend = resolve_float8_grouped_gemm("auto", device)  # on a Hopper GPU shardtune's kernel
        output = Float8Product.apply(x, *quantized, bounds.to(device), backend)
        output.backward(grad.to(device))
        direct = float8_grouped_mm(
            *rowwise_float8(rows.to(device)), *quantized[:2], bounds.to(device), torch.bfloat16, backend
        )
        results[device.type] = [tensor.detach().cpu().float() for tensor in (output, x.grad, direct)]
    for name, got, emulated in zip(
        ["output", "input gradient", "direct"], results["cuda"], results["cpu"], strict=True
    ):
        assert got.shape == emulated.shape, name
        # Both are rounded to bf16 from sums in another order: a value may land one bf16 step (2**-7 relative)
        # away, no more; overall they agree to about 1e-3 (measured on an H200: 9.4e-4).
        assert_relative(got, emulated, 2**-7, name)
        assert relative_error(got, emulated) < 3e-3, name


# The SiLU-gated layouts' tokens' gradient on a GPU against the emulation: the SiLU's backward rounds its bf16 in
# another order on a CPU and a GPU, and quantizing the gate/up gradient to e4m3 turns a last-bit difference into a whole
# e4m3 step (2**-3) now and then. Measured on an H200: Qwen3-MoE's (the plain SiLU layout) 1.7e-2, DBRX's 1.8e-2,
# JetMoE's 1.8e-2; LongCat-Flash's, half of whose experts are identities, 4.6e-4.
SILU_TOKEN_GRADIENT = {(arch, "tokens' gradient"): 3e-2 for arch in ("qwen3_moe", "dbrx", "jetmoe")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "gemma4_text", "longcat_flash", "dbrx", "jetmoe"])
def test_float8_experts_of_each_layout_on_a_gpu_equal_the_emulation(layout_dirs, arch, monkeypatch, tmp_path):
    """On a GPU, bf16 float8 experts of Qwen3-MoE (the plain SiLU layout), GPT-OSS (biases added after the float8
    products), Gemma 4 (GELU-tanh: not the SiLU's Triton kernels), LongCat-Flash (identity rows, which torch's grouped
    GEMM leaves unwritten, set to 0; only the GEMM experts' forms reach it), DBRX (gate's and up's GEMMs apart, from
    (E, I, H) views of its slabs) and JetMoE (its pair of expert modules, their float8 forms on each) compute the
    output, the tokens' and the routing weights' gradients that the CPU's emulation does, to float8's rounding
    (SILU_TOKEN_GRADIENT), on the same routing (every expert chosen, identities among them). The weighted SiLU's
    float8 Triton kernels are off: they round the activation in their own order, which moves a hidden value across an
    e4m3 step now and then (DBRX's and JetMoE's outputs then lay 1.4e-2 and 1.7e-2 from the emulation's on an H200),
    and test_compiled_float8_blocks_train_through_the_kernels_like_through_rowwise_float8 holds them to the torch ops;
    here the layouts' GEMMs are what is compared."""
    from shardtune.model import fused_moe

    cuda = torch.device("cuda")
    if float8_unavailable(cuda) is not None:
        pytest.skip(float8_unavailable(cuda))
    if arch not in layout_dirs and arch != "qwen3_moe":
        pytest.skip(f"this transformers has no {arch}")
    monkeypatch.setattr(fused_moe, "weighted_silu_mul_float8", None)
    monkeypatch.setattr(fused_moe, "weighted_silu_mul_backward_float8", None)
    directory = write_tiny_model(tmp_path / arch, arch) if arch == "qwen3_moe" else layout_dirs[arch]
    reference = fused_copy(build(directory, ["attention"])).to(torch.bfloat16)
    experts_count = find_moe_blocks(reference, decoder_layers(reference))[0].num_experts
    generator = torch.Generator().manual_seed(7)
    tokens_count, top_k, hidden = 50, 2, reference.config.hidden_size
    tokens = torch.randn(tokens_count, hidden, generator=generator).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(experts_count, generator=generator)[:top_k] for _ in range(tokens_count)])
    weights = torch.rand(tokens_count, top_k, generator=generator)
    grad = torch.randn(tokens_count, hidden, generator=generator).to(torch.bfloat16)
    results = {}
    for device in (CPU, cuda):
        model = copy.deepcopy(reference).to(device)
        use_float8(model, device, experts=True, linear=False)
        experts = find_moe_blocks(model, decoder_layers(model))[0].experts
        x, w = tokens.to(device).detach().requires_grad_(), weights.to(device).detach().requires_grad_()
        output = experts(x, chosen.to(device), w)
        output.backward(grad.to(device))
        results[device.type] = [tensor.detach().cpu().float() for tensor in (output, x.grad, w.grad)]
    names = ["output", "tokens' gradient", "weights' gradient"]
    for name, got, emulated in zip(names, results["cuda"], results["cpu"], strict=True):
        assert torch.isfinite(got).all(), name
        assert relative_error(got, emulated) < SILU_TOKEN_GRADIENT.get((arch, name), 1e-2), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_float8_linear_on_a_gpu_equals_the_emulation():
    """A Float8Linear on a GPU (torch._scaled_mm, which takes each weight laid out along the summed dimension)
    computes its output and input gradient as the fp32 emulation does, to bf16's rounding; a row count that is
    not a multiple of 16 among them."""
    cuda = torch.device("cuda")
    if float8_unavailable(cuda, grouped=False) is not None:
        pytest.skip(float8_unavailable(cuda, grouped=False))
    if torch.cuda.get_device_capability(cuda)[0] == 9:
        assert float8_unavailable(cuda) is None  # Hopper runs both
    generator = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(256, 384, bias=True).requires_grad_(False)
    linear.weight.copy_(torch.randn(384, 256, generator=generator) * 0.02)
    x = torch.randn(3, 77, 256, generator=generator).to(torch.bfloat16)
    grad = torch.randn(3, 77, 384, generator=generator).to(torch.bfloat16)
    results = {}
    for device in (CPU, cuda):
        layer = Float8Linear(copy.deepcopy(linear).to(device=device, dtype=torch.bfloat16))
        inputs = x.to(device).detach().requires_grad_()
        output = layer(inputs)
        output.backward(grad.to(device))
        results[device.type] = [output.detach().cpu().float(), inputs.grad.cpu().float()]
    for name, got, emulated in zip(["output", "input gradient"], results["cuda"], results["cpu"], strict=True):
        assert_relative(got, emulated, 2**-7, name)
        assert relative_error(got, emulated) < 3e-3, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_compiled_float8_blocks_train_through_the_kernels_like_through_rowwise_float8():
    """On a GPU, a compiled bf16 Qwen3-MoE model with float8 experts trains through the weighted SiLU's float8 Triton
    kernels (Float8Experts) as through the torch ops and ``rowwise_float8``: the same loss and gradients to float8's
    precision, and the compiled graphs call both kernels."""
    from tiny_models import kernel_sized_qwen3_moe
    from torch._inductor.utils import run_and_get_code
    from transformers import AutoModelForCausalLM

    from shardtune.model import fused_moe

    cuda = torch.device("cuda")
    if float8_unavailable(cuda) is not None:
        pytest.skip(float8_unavailable(cuda))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(kernel_sized_qwen3_moe(), dtype=torch.bfloat16).cuda()
    base.config.use_cache = False
    fused_moe.use_fused_experts(base, decoder_layers(base), "fused", "torch", cuda)
    base.requires_grad_(False)
    base.get_input_embeddings().requires_grad_(True)  # a gradient through every layer, as LoRA's needs
    use_float8_experts(base)
    ids = torch.randint(0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def step(kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model = copy.deepcopy(base).train()
        for layer in decoder_layers(model):
            layer.compile(fullgraph=True)
        names = ("weighted_silu_mul_float8", "weighted_silu_mul_backward_float8")
        saved = [getattr(fused_moe, name) for name in names]
        if not kernels:
            for name in names:
                setattr(fused_moe, name, None)
        try:
            torch._dynamo.reset()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            for name, kernel in zip(names, saved, strict=True):
                setattr(fused_moe, name, kernel)
        return loss.detach(), model.get_input_embeddings().weight.grad

    (loss, grad), code = run_and_get_code(step, True)
    assert any("_weighted_silu_mul_float8_kernel" in source for source in code)
    assert any("_weighted_silu_mul_backward_float8_kernel" in source for source in code)
    expected_loss, expected_grad = step(False)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=0)
    assert relative_error(grad, expected_grad) < 5e-2

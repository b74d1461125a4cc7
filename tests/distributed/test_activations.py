"""Tiled MLPs, activation checkpointing and activation offloading change memory, never the numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from shardtune.config import LoraConfig, TrainingConfig
from shardtune.data.collate import collate
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.distributed.activations import apply_activation_checkpointing, layer_sublayers, tile_mlps
from shardtune.distributed.parallelize import decoder_layers
from shardtune.model.lora import apply_lora
from shardtune.plan.memory import Checkpointing
from shardtune.train.loss import summed_token_loss


def packed_batch():
    """Two packed rows of three and two examples, prompts masked, one row padded."""
    rng = np.random.default_rng(0)
    rows = []
    for lengths in ((13, 9, 20), (25, 11)):
        ids = rng.integers(3, 1000, sum(lengths))
        targets = ids.copy()
        targets[0:4] = IGNORE_INDEX
        positions = np.concatenate([np.arange(n) for n in lengths])
        rows.append((ids, targets, positions))
    return collate(rows, pad_token_id=0, packed=True)


def loss_and_gradients(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed token loss of the packed batch, and every parameter's gradient under its name without
    checkpoint wrappers."""
    loss = summed_token_loss(model, packed_batch(), None)
    loss.backward()
    grads = {
        name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


def loss_and_grads(model_dir, *, lora: bool, chunk: int = 0, checkpointing: bool = False, offload: bool = False):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = apply_lora(model, LoraConfig(r=4, lora_dropout=0.0))
    layers = decoder_layers(model)
    if chunk:
        assert tile_mlps(model, layers, chunk) == len(layers)
    if checkpointing:
        assert apply_activation_checkpointing(model, layers, offload=offload) == len(layers)
    return (*loss_and_gradients(model), model)


@pytest.mark.parametrize("lora", [True, False])
def test_tiled_mlps_with_offloaded_checkpoints_give_the_same_loss_and_gradients(tiny_model_dir, lora):
    plain_loss, plain_grads, _ = loss_and_grads(tiny_model_dir, lora=lora)
    for variant in ({"chunk": 7}, {"checkpointing": True, "offload": True}, {"chunk": 5, "checkpointing": True}):
        loss, grads, model = loss_and_grads(tiny_model_dir, lora=lora, **variant)
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5, msg=str(variant))
        assert grads.keys() == plain_grads.keys() and grads, variant
        for name, grad in grads.items():
            scale = max(plain_grads[name].abs().max().item(), 1.0)
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6 * scale, msg=f"{variant} {name}")
    # Tiling replaces no module: parameter names (checkpoints, adapters) are unchanged.
    tiled = {name for name, _ in loss_and_grads(tiny_model_dir, lora=lora, chunk=7)[2].named_parameters()}
    assert tiled == {name for name, _ in loss_and_grads(tiny_model_dir, lora=lora)[2].named_parameters()}


def test_a_tiled_mlp_runs_slice_by_slice(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layers = decoder_layers(model)
    tile_mlps(model, layers, 7)
    slices = []
    layers[0].mlp.gate_proj.register_forward_hook(lambda module, args, out: slices.append(args[0].shape[0]))
    batch = packed_batch()
    with torch.no_grad():
        model(**batch.model_inputs())
    assert slices == [7] * (batch.input_ids.numel() // 7) + (
        [batch.input_ids.numel() % 7] if batch.input_ids.numel() % 7 else []
    )


def test_offloading_needs_checkpointing():
    with pytest.raises(ValueError, match="activation_offloading: needs gradient_checkpointing"):
        TrainingConfig(activation_offloading=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gpt_neox", "falcon", "phi3"])
def test_recomputed_sublayers_give_the_same_loss_and_gradients(arch):
    """A layer that recomputes its MLP, or its attention and its MLP, runs exactly those forwards twice
    (once more in backward) and gives the loss and gradients of a layer that recomputes nothing; LoRA
    targets every linear layer, so every sublayer's parameters get gradients through the recomputation."""

    def run(checkpointing: Checkpointing | None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        model = apply_lora(model, LoraConfig(r=4, lora_dropout=0.0, target_modules="all-linear"))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)  # PEFT starts B at zero: A would get no gradient
        layers = decoder_layers(model)
        calls = {"attention": 0, "mlp": 0}
        for layer in layers:
            attention, mlp = layer_sublayers(layer)
            for key, name in (("attention", attention), ("mlp", mlp)):
                layer.get_submodule(name).register_forward_pre_hook(
                    lambda *_, key=key: calls.__setitem__(key, calls[key] + 1)
                )
        if checkpointing is not None:
            assert apply_activation_checkpointing(model, layers, checkpointing) == checkpointing.count
        return (*loss_and_gradients(model), calls)

    plain_loss, plain_grads, plain_calls = run(None)
    assert plain_calls == {"attention": 2, "mlp": 2}  # two layers, one forward each
    for parts, recomputed in (
        (("mlp", None), {"attention": 2, "mlp": 3}),
        (("sublayers", "mlp"), {"attention": 3, "mlp": 4}),
    ):
        loss, grads, calls = run(Checkpointing(parts))
        assert calls == recomputed, parts
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == plain_grads.keys() and len(grads) > 8
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=f"{parts} {name}")


def test_a_layer_without_an_mlp_module_has_no_sublayers():
    """OPT computes its MLP with two linear layers of the decoder layer itself, and Gemma 4 its routed experts (the
    decoder layer is its MoE block, its ``mlp`` the dense MLP beside them): only whole layers can be checkpointed
    there (plan.memory.checkpoint_parts); every other architecture has both sublayers."""
    from tiny_models import FUSED_MOE_ARCHITECTURES

    archs = (
        "opt",
        "llama",
        "gpt2",
        "gpt_neox",
        "falcon",
        *(["gemma4_text"] if "gemma4_text" in FUSED_MOE_ARCHITECTURES else []),
    )
    found = {
        arch: layer_sublayers(decoder_layers(AutoModelForCausalLM.from_config(tiny_config(arch)))[0]) for arch in archs
    }
    assert found == {
        **({"gemma4_text": None} if "gemma4_text" in archs else {}),
        "opt": None,
        "llama": ("self_attn", "mlp"),
        "gpt2": ("attn", "mlp"),
        "gpt_neox": ("attention", "mlp"),
        "falcon": ("self_attention", "mlp"),
    }
